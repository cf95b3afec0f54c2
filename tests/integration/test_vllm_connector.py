"""The connector's zero-tuning parts, fast: vLLM's plugin loader finds it by name, and it reads the block
geometry from a real daemon (``kvbm serve`` in a subprocess). tests/integration/test_vllm_e2e.py runs them in vLLM."""

from __future__ import annotations

import importlib.util

import pytest
from needs import needs
from serve_proc import ServeProc

pytestmark = needs("vllm", importlib.util.find_spec("vllm") is not None,
                   "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
MiB = 1 << 20


def test_vllm_general_plugins_register_the_connector_by_name():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)  # what vLLM runs in each of its processes
    assert "kvbm" in plugins, sorted(plugins)
    plugins["kvbm"]()
    plugins["kvbm"]()  # vLLM may load plugins more than once: a second call is harmless
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="KvbmConnector", kv_role="kv_both"))
    from kvbm.integrations.vllm import KvbmConnector

    assert cls is KvbmConnector


@pytest.fixture(scope="module")
def daemon_1mib(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvbmd")
    d = ServeProc(tmp, {
        "block_bytes": "1MiB", "device": {"enabled": False}, "host": {"capacity": "4MiB"},
        "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp}/kvbm.sock", "events_endpoint": f"ipc://{tmp}/events.sock",
                   "metrics_port": -1},
    }).start()
    yield d
    d.stop()


def test_k_is_derived_from_the_daemons_block_bytes(daemon_1mib):
    from kvbm.integrations.vllm import _daemon_block_bytes, _Geometry

    with daemon_1mib.client() as c:
        slot = _daemon_block_bytes(c)  # read before (and without) registering
    assert slot == MiB
    g = _Geometry(16, 16 * 16 * 1024, None)  # 16-token vLLM blocks of a 16 KiB/token model: 256 KiB
    assert g.resolve(slot) == 4 and g.k == 4
    assert g.resolve(slot) == 4  # fixed once resolved
    assert _Geometry(16, 16 * 16 * 1024, 2).resolve(slot) == 2  # an explicit k that fits is kept


def test_a_vllm_block_bigger_than_the_daemons_is_a_clear_error(daemon_1mib):
    from kvbm.integrations.vllm import MisconfiguredError, _daemon_block_bytes, _Geometry

    with daemon_1mib.client() as c:
        slot = _daemon_block_bytes(c)
    # The case: 16 KiB/token, vLLM's 128-token blocks (2 MiB) against a 1 MiB daemon.
    with pytest.raises(MisconfiguredError) as e:
        _Geometry(128, 128 * 16 * 1024, None).resolve(slot)
    msg = str(e.value)
    assert "2097152 B" in msg and "1048576 B" in msg, msg
    assert "block_bytes" in msg and "--block-size to at most 64 tokens" in msg, msg
    assert "unavailable" not in msg
    # An explicit k too big for the daemon names that setting too.
    with pytest.raises(MisconfiguredError, match="vllm_blocks_per_kvbm_block"):
        _Geometry(16, 16 * 16 * 1024, 8).resolve(slot)
