"""The connector's zero-tuning parts, fast: vLLM's plugin loader finds it by name, and it reads the block
geometry from a real daemon (``kvbm serve`` in a subprocess). tests/integration/test_vllm_e2e.py runs them in vLLM."""

from __future__ import annotations

import importlib.util

import pytest
from needs import needs
from serve_proc import ServeProc, wait_until

pytestmark = needs("vllm", importlib.util.find_spec("vllm") is not None,
                   "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
MiB = 1 << 20
# Lookups are answered off the scheduler thread; a generous wait makes each call below return the answer.
ANSWER_NOW = {"lookup_wait_ms": 10_000}
K1 = {"vllm_blocks_per_kvbm_block": 1, **ANSWER_NOW}


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
    from kvbm.integrations.vllm import Geometry, daemon_block_bytes

    with daemon_1mib.client() as c:
        slot = daemon_block_bytes(c)  # read before (and without) registering
    assert slot == MiB
    g = Geometry(16, 16 * 16 * 1024, None)  # 16-token vLLM blocks of a 16 KiB/token model: 256 KiB
    assert g.resolve(slot) == 4 and g.k == 4
    assert g.resolve(slot) == 4  # fixed once resolved
    assert Geometry(16, 16 * 16 * 1024, 2).resolve(slot) == 2  # an explicit k that fits is kept


def test_a_vllm_block_bigger_than_the_daemons_is_a_clear_error(daemon_1mib):
    from kvbm.integrations.vllm import Geometry, MisconfiguredError, daemon_block_bytes

    with daemon_1mib.client() as c:
        slot = daemon_block_bytes(c)
    # The case: 16 KiB/token, vLLM's 128-token blocks (2 MiB) against a 1 MiB daemon.
    with pytest.raises(MisconfiguredError) as e:
        Geometry(128, 128 * 16 * 1024, None).resolve(slot)
    msg = str(e.value)
    assert "2097152 B" in msg and "1048576 B" in msg, msg
    assert "block_bytes" in msg and "--block-size to at most 64 tokens" in msg, msg
    assert "unavailable" not in msg
    # An explicit k too big for the daemon names that setting too.
    with pytest.raises(MisconfiguredError, match="vllm_blocks_per_kvbm_block"):
        Geometry(16, 16 * 16 * 1024, 8).resolve(slot)


def scheduler_connector(model: str, extra: dict):
    """The connector as vLLM builds it in the EngineCore process, from a real vLLM config."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvbm.integrations.vllm import KvbmConnector

    ktc = KVTransferConfig(kv_connector="KvbmConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    cfg = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=4096, block_size=16,
                     kv_transfer_config=ktc).create_engine_config()
    return KvbmConnector(cfg, KVConnectorRole.SCHEDULER), cfg


@pytest.mark.parametrize("extra,error", [
    ({"vllm_blocks_per_kvbm_blok": 2},
     "kv_connector_extra_config.vllm_blocks_per_kvbm_blok: unknown key; did you mean vllm_blocks_per_kvbm_block?"),
    ({"vllm_blocks_per_kvbm_block": "2"},
     "kv_connector_extra_config.vllm_blocks_per_kvbm_block: expected int, got str"),
    ({"vllm_blocks_per_kvbm_block": 0}, "kv_connector_extra_config.vllm_blocks_per_kvbm_block: expected int >= 1"),
    ({"save": "false"}, "kv_connector_extra_config.save: expected bool, got str"),  # bool("false") was True
    ({"timeout_s": "5"}, "kv_connector_extra_config.timeout_s: expected float, got str"),
    ({"load_failure_policy": "recompte"},  # anything but "recompute" silently meant "fail"
     "kv_connector_extra_config.load_failure_policy: invalid enum value 'recompte'"),
    ({"version": 2}, "kv_connector_extra_config.version: invalid enum value 2"),
])
def test_extra_config_errors_name_the_field(tiny_model, daemon_1mib, extra, error):
    from kvbm.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        scheduler_connector(tiny_model, {"daemon": daemon_1mib.endpoint, **extra})
    assert str(e.value) == error


def test_extra_config_reaches_the_scheduler_side(tiny_model, daemon_1mib):
    conn, cfg = scheduler_connector(tiny_model, {"version": 1, "daemon": daemon_1mib.endpoint, "model_name": "m1",
                                                 "vllm_blocks_per_kvbm_block": 2, "timeout_s": 10,
                                                 "load_failure_policy": "fail"})
    try:
        (lay,) = conn.layouts()  # registered with the daemon at start-up, one layout per TP rank
        assert lay.model == "m1" and lay.tokens_per_block == 2 * 16 and lay.tp_rank == 0
        assert cfg.kv_transfer_config.kv_load_failure_policy != "recompute"  # "fail" leaves vLLM's policy
    finally:
        conn.shutdown()
    conn, cfg = scheduler_connector(tiny_model, {"daemon": daemon_1mib.endpoint})
    try:
        (lay,) = conn.layouts()
        assert lay.tokens_per_block % 16 == 0 and lay.tokens_per_block > 16  # k derived from 1 MiB blocks
        assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"
    finally:
        conn.shutdown()


def _stored_request(conn, daemon, n_blocks: int, first_token: int):
    """A real vLLM Request of ``n_blocks`` full 16-token blocks (+1 token) whose kvbm blocks (k=1) the daemon
    holds under the scheduler's layout."""
    import numpy as np
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    from kvbm.blocks import BlockKey

    fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)
    req = Request("r1", list(range(first_token, first_token + 16 * n_blocks + 1)), SamplingParams(max_tokens=1), None,
                  block_hasher=kcu.get_request_block_hasher(16, fn))
    (lay,) = conn.layouts()
    keys = [BlockKey(lay.namespace, bytes(h)) for h in req.block_hashes]
    with daemon.client() as c:
        c.register(lay, worker_id="filler")
        assert c.store(keys, [np.zeros(lay.block_nbytes, np.uint8)] * len(keys)).stored == len(keys)
    return req


def test_a_request_whose_load_failed_is_not_offered_kvbm_tokens_again(tiny_model, daemon_1mib):
    """vLLM reports a failed load as invalid block ids and reschedules the request; offering the same prefix
    again made a stuck loader fail it again, in a loop (thousands of times in the TP=2 long-doc bench). The
    scheduler side recomputes that request instead; other requests still load."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput

    from kvbm.integrations.vllm.metadata import KvbmWorkerMetadata

    conn, _cfg = scheduler_connector(tiny_model, {"daemon": daemon_1mib.endpoint, **K1})
    try:
        req = _stored_request(conn, daemon_1mib, 4, 100)
        ext, _async = conn.get_num_new_matched_tokens(req, 0)
        assert ext == 64
        conn.update_state_after_alloc(req, KVCacheBlocks((tuple(KVCacheBlock(i) for i in range(10, 15)),)), ext)
        meta = conn.build_connector_meta(_empty_scheduler_output())
        # The step's output, as a worker answers it: its load failed, and it copied what its pins held.
        conn.update_connector_output(KVConnectorOutput(invalid_block_ids={12},
                                                       kv_connector_worker_meta=KvbmWorkerMetadata({meta.step})))
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # recomputed, not offered again
        conn.request_finished(req, [])
        assert conn.get_num_new_matched_tokens(req, 0)[0] == 64  # a new request of that id may load again
        conn.request_finished(req, [])  # it goes unscheduled: its pins go, as the first load's did
        assert wait_until(lambda: _pins(daemon_1mib) == 0, timeout=10)
    finally:
        conn.shutdown()


def _pins(daemon) -> int:
    with daemon.client(timeout_s=5) as c:
        return c.stats()["daemon"]["pins"]


def test_loads_are_synchronous_by_default_on_cpu(tiny_model, daemon_1mib):
    """On a CPU engine an async load waits on a loader thread that vLLM's busy steps starve (measured: TP=1
    G4 hit 5.0x its bytes-at-bandwidth + tail vs 1.07x loading in the step; TP=2 stalled): the default there
    is a synchronous load; ``async_load`` set explicitly wins."""
    conn, _cfg = scheduler_connector(tiny_model, {"daemon": daemon_1mib.endpoint, **K1})
    try:
        req = _stored_request(conn, daemon_1mib, 2, 1000)
        assert conn.get_num_new_matched_tokens(req, 0) == (32, False)
    finally:
        conn.shutdown()
    conn, _cfg = scheduler_connector(tiny_model, {"daemon": daemon_1mib.endpoint, **K1,
                                                  "async_load": True})
    try:
        req = _stored_request(conn, daemon_1mib, 2, 2000)
        assert conn.get_num_new_matched_tokens(req, 0) == (32, True)
    finally:
        conn.shutdown()


def _empty_scheduler_output():
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0, scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, num_common_prefix_blocks=[], finished_req_ids=set(),
                           free_encoder_mm_hashes=[])


def test_a_block_a_sliding_window_already_freed_is_not_saved(tiny_model, daemon_1mib):
    """Under vLLM's hybrid KV cache manager a sliding-window group frees blocks that fall out of its window,
    and vLLM may hand them to another request in the same step. A kvbm block whose first vLLM blocks were
    computed in an earlier chunk and are out of the window by now is skipped; the rest are saved with the
    block ids of every group, group after group."""
    import dataclasses

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    from kvbm.integrations.vllm import KvbmConnector

    _conn, cfg = scheduler_connector(tiny_model, {"daemon": daemon_1mib.endpoint, "vllm_blocks_per_kvbm_block": 2,
                                                  **ANSWER_NOW})
    _conn.shutdown()
    spec = {"block_size": 16, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**spec)),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], SlidingWindowSpec(**spec, sliding_window=16))])

    conn = KvbmConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config=kv)
    try:
        fn = get_hash_fn_by_name("sha256")
        kcu.init_none_hash(fn)
        req = Request("swa", list(range(5000, 5064)), SamplingParams(max_tokens=1), None,
                      block_hasher=kcu.get_request_block_hasher(16, fn))
        assert len(req.block_hashes) == 4  # 4 vLLM blocks of 16 tokens: 2 kvbm blocks
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        full, swa = [10, 11, 12, 13], [20, 21, 22, 23]
        conn.update_state_after_alloc(req, KVCacheBlocks((tuple(map(KVCacheBlock, full)),
                                                          tuple(map(KVCacheBlock, swa)))), 0)
        # Step 2 of a chunked prefill: tokens 0-39 computed, 24 scheduled. vLLM has freed the sliding blocks
        # before token 40 - 16 + 1 = 25, i.e. vLLM block 0 (tokens 0-15): kvbm block 0 cannot be saved.
        cached = CachedRequestData(req_ids=[req.request_id], resumed_req_ids=set(), new_token_ids=[],
                                   all_token_ids={}, new_block_ids=[None], num_computed_tokens=[40],
                                   num_output_tokens=[0])
        out = dataclasses.replace(_empty_scheduler_output(), num_scheduled_tokens={req.request_id: 24},
                                  scheduled_cached_reqs=cached)
        meta = conn.build_connector_meta(out)
        assert [tr.block_ids for tr in meta.saves] == [[[12, 13, 22, 23]]]  # one kvbm block: k ids per group
        assert meta.saves[0].hashes == [bytes(req.block_hashes[3])]
    finally:
        conn.shutdown()
