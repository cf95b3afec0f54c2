"""Which vLLM the connector supports: a clear startup error outside the range, and the connector's hooks
checked against vLLM's KV-connector base class as source (the installed 0.32, and the 0.33 wheel)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from needs import needs

from kvbm.integrations.vllm import apicheck
from kvbm.integrations.vllm.compat import ALLOW_ENV, SUPPORTED, UnsupportedVllmError, check_vllm, major_minor

ROOT = Path(__file__).resolve().parents[2]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = needs("vllm", HAVE_VLLM, "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
VLLM_033 = "0.33.0"  # the newest vLLM on the registry; its CPU build stops at 0.32.0


@pytest.mark.parametrize("v", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1.dev4+gabc123"])
def test_supported_versions_pass(v):
    check_vllm(v)


@pytest.mark.parametrize("v", ["0.31.2", "0.34.0", "1.0.0", "dev"])
def test_an_unsupported_vllm_is_an_error_naming_the_range(v, monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UnsupportedVllmError) as e:
        check_vllm(v)
    msg = str(e.value)
    assert f"supports vLLM {SUPPORTED}" in msg and f"this is vLLM {v}" in msg and ALLOW_ENV in msg, msg


def test_the_override_lets_an_unsupported_vllm_start_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(ALLOW_ENV, "1")
    check_vllm("0.34.0")
    assert "this is vLLM 0.34.0" in caplog.text and ALLOW_ENV in caplog.text


def test_major_minor():
    assert major_minor("0.33.1.dev4+gabc") == (0, 33) and major_minor("dev") is None


@needs_vllm
def test_connector_startup_refuses_an_unsupported_vllm(tiny_model, monkeypatch):
    """The real connector, as vLLM builds it from a real config: outside the range it does not start."""
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from kvbm.integrations.vllm import KvbmConnector

    ktc = KVTransferConfig(kv_connector="KvbmConnector", kv_role="kv_both",
                           kv_connector_extra_config={"daemon": "ipc:///nonexistent/kvbm.sock"})
    cfg = EngineArgs(model=tiny_model, skip_tokenizer_init=True, max_model_len=256, block_size=16,
                     kv_transfer_config=ktc).create_engine_config()
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(UnsupportedVllmError, match=rf"supports vLLM {SUPPORTED}.*this is vLLM 0\.34\.0"):
        KvbmConnector(cfg, KVConnectorRole.SCHEDULER)


@needs_vllm
def test_connector_hooks_match_the_installed_vllm_base_class():
    report = apicheck.check(apicheck.installed_reader())
    assert report["problems"] == [], report["problems"]
    assert "get_num_new_matched_tokens" not in report["inherited"]  # the hooks kvbm overrides are compared


@needs_vllm
def test_a_drifted_hook_signature_is_reported():
    """The comparison is not vacuous: the installed base with one hook's parameter renamed, one hook made
    abstract, is reported against kvbm's connector."""
    base = apicheck.installed_reader()(apicheck.BASE_MODULE)
    assert base is not None
    drifted = base.replace("num_computed_tokens: int", "num_local_computed_tokens: int", 1)
    assert drifted != base
    ours = (ROOT / "kvbm/integrations/vllm/connector.py").read_text()
    problems, _ = apicheck.compare_hooks(drifted, ours)
    assert any(p.startswith("get_num_new_matched_tokens:") and "num_local_computed_tokens" in p
               for p in problems), problems
    abstract = base.replace("    def take_events(self)", "    @abstractmethod\n    def take_events(self)", 1)
    assert abstract != base
    problems, _ = apicheck.compare_hooks(abstract, ours)
    assert "take_events: abstract in vLLM's KVConnectorBase_V1, not implemented by kvbm" in problems, problems


@pytest.fixture(scope="module")
def vllm_033_wheel() -> Path:
    """vLLM 0.33.0's wheel (no dependencies), kept in ~/.cache/kvbm/wheelhouse: 336 MB, downloaded once."""
    wh = Path.home() / ".cache" / "kvbm" / "wheelhouse" / f"vllm-{VLLM_033}"
    found = sorted(wh.glob(f"vllm-{VLLM_033}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={VLLM_033}", "-d",
                        str(wh)], check=True, capture_output=True)
        found = sorted(wh.glob(f"vllm-{VLLM_033}-*.whl"))
    assert found, f"pip download vllm=={VLLM_033} left no wheel in {wh}"
    return found[0]


def test_connector_matches_vllm_033_statically(vllm_033_wheel):
    """scripts/vllm_compat.py on the 0.33 wheel: kvbm's hooks keep 0.33's signatures, its vLLM imports
    resolve, and 0.33's new hooks (sleep mode) are listed as inherited defaults."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts/vllm_compat.py"), "--wheel", str(vllm_033_wheel)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["vllm"] == VLLM_033 and report["supported"] is True and report["problems"] == [], report
    assert {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"} <= set(report["inherited"]), report
