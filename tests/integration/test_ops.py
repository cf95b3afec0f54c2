"""Operator experience: health endpoints, Ping without registration, config errors that suggest the right
name, ``kvbm config show``, ``kvbm plan``, the Prometheus page (histograms, process metrics) and
``kvbm status --watch``. Daemons run as real subprocesses over a real SeaweedFS."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import ServeProc

from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.cli.main import main
from kvbm.config import load_config
from kvbm.errors import ConfigError

LAYOUT = KVLayout(model="ops", num_layers=1, num_kv_heads=1, head_size=64, dtype="float16", tokens_per_block=64)
NB = LAYOUT.block_nbytes


def keys(n: int, tag: bytes) -> list[BlockKey]:
    return [BlockKey(LAYOUT.namespace, (tag + i.to_bytes(4, "big")).ljust(16, b"\x00")) for i in range(n)]


def data(k: BlockKey) -> np.ndarray:
    return np.frombuffer((k.hash * (NB // len(k.hash) + 1))[:NB], np.uint8).copy()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def s3_daemon(tmp_path_factory, s3_server):
    """G2 + G4 (no disk): an onboard after evicting G2 comes from the bucket."""
    tmp = tmp_path_factory.mktemp("opsd")
    d = ServeProc(tmp, {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"enabled": False},
        "s3": {"endpoint": s3_server.endpoint, "bucket": s3_server.bucket, "prefix": f"ops-{tmp.name}",
               "access_key": s3_server.access_key, "secret_key": s3_server.secret_key},
        "embedded_s3": {"enabled": False},
        "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp}/d.sock", "events_endpoint": "", "metrics_port": -1,
                   "index_bucket": "start"},
    }).start()
    yield d
    d.stop()
    assert d.proc.returncode == 0, d.log_path.read_text()[-3000:]


# -- health ---------------------------------------------------------------------------------------------------
def test_healthz_and_readyz_answer_over_plain_http(s3_daemon):
    port = s3_daemon.info["metrics_port"]
    status, body = get(port, "/healthz")
    assert status == 200 and body.strip() == "ok"
    status, body = get(port, "/readyz")
    assert status == 200, body
    rep = json.loads(body)
    assert rep["ready"] is True
    assert rep["checks"]["serving"] is True and rep["checks"]["bucket_indexed"] is True
    assert rep["s3"]["breaker"] == "closed"
    assert get(port, "/nothing")[0] == 404


def test_readyz_is_503_while_the_bucket_is_unreachable(tmp_path, weed_binary):
    from kvbm.s3server import EmbeddedS3

    srv = EmbeddedS3(tmp_path / "weed", weed=weed_binary, bucket="kvbm-ready", stop_timeout_s=2.0, reuse=False)
    with srv:
        d = ServeProc(tmp_path, {
            "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
            "disk": {"enabled": False},
            "s3": {"endpoint": srv.endpoint, "bucket": srv.bucket, "access_key": srv.access_key,
                   "secret_key": srv.secret_key, "max_retries": 0, "connect_timeout_s": 1.0,
                   "breaker_failures": 1, "breaker_reset_s": 600},
            "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": f"ipc://{tmp_path}/d.sock", "events_endpoint": "", "metrics_port": -1,
                       "index_bucket": "start"},
        }).start()
    try:
        port = d.info["metrics_port"]
        with d.client() as c:
            c.register(LAYOUT, worker_id="ready")
            ks = keys(2, b"r")
            ack = c.store(ks, [data(k) for k in ks], durable=True)  # its PUTs fail: the bucket is gone
            assert ack.durable == 0
        status, body = get(port, "/readyz")
        assert status == 503, body
        rep = json.loads(body)
        assert rep["ready"] is False and rep["checks"]["bucket_reachable"] is False
        assert rep["checks"]["serving"] is True and rep["s3"]["breaker"] == "open"
        assert get(port, "/healthz")[0] == 200  # alive, just not ready
        fams = families(port)
        assert fams["kvbm_ready"].samples[0].value == 0
        assert fams["kvbm_s3_breaker_open"].samples[0].value == 1
        assert fams["kvbm_s3_breaker_opens"].samples[0].value == 1
        # The writes that did not happen are visible: failed or shed G4 copies, by exception type.
        failed = {s.labels["type"]: s.value for s in fams["kvbm_manager_background_errors"].samples
                  if s.labels["tier"] == "G4" and s.name.endswith("_total")}
        assert sum(failed.values()) == 2, failed
    finally:
        d.stop()


def test_ping_needs_no_registration(s3_daemon):
    with s3_daemon.client() as c:
        assert not c.token
        c.ping()  # a health probe: no Register first


# -- metrics --------------------------------------------------------------------------------------------------
def families(port: int) -> dict[str, object]:
    status, text = get(port, "/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(text)}


def hist_count(fams: dict[str, object], name: str, **labels: str) -> float:
    fam = fams[name]
    assert fam.type == "histogram", (name, fam.type)
    return sum(s.value for s in fam.samples
               if s.name == f"{name}_count" and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_page_parses_and_has_latency_histograms_after_store_and_onboard(s3_daemon):
    port = s3_daemon.info["metrics_port"]
    with s3_daemon.client(admin=True) as c:  # it evicts: the admin token from the daemon's token file
        c.register(LAYOUT, worker_id="metrics")
        ks = keys(3, b"m")
        assert c.store(ks, [data(k) for k in ks], durable=True).durable == 3
        c.evict(ks, tiers=["G2"])
        look = c.lookup(ks)
        assert look.matched == 3 and look.tiers == ["G4"] * 3
        outs = [np.zeros(NB, np.uint8) for _ in ks]
        assert c.load(ks, outs) == 3
        assert all(np.array_equal(o, data(k)) for o, k in zip(outs, ks, strict=True))
    fams = families(port)
    assert hist_count(fams, "kvbm_lookup_seconds", tier="G4") >= 1
    assert hist_count(fams, "kvbm_onboard_seconds") >= 1
    assert hist_count(fams, "kvbm_onboard_block_seconds", tier="G4") >= 3  # by the onboard or its prefetch
    assert hist_count(fams, "kvbm_offload_seconds", tier="G4") >= 3  # one per block written to the bucket
    assert hist_count(fams, "kvbm_s3_request_seconds", op="put") >= 3
    assert hist_count(fams, "kvbm_s3_request_seconds", op="get") >= 3
    # Counters and gauges of the snapshot, and the process collector.
    assert fams["kvbm_tier_blocks"].type == "gauge"
    assert {s.labels["tier"] for s in fams["kvbm_tier_blocks"].samples} == {"G2", "G4"}
    assert fams["kvbm_daemon_requests"].type == "counter"
    assert "process_cpu_seconds" in fams and "process_resident_memory_bytes" in fams
    assert fams["kvbm_ready"].samples[0].value == 1


def test_grafana_dashboard_only_uses_metrics_the_daemon_exports(s3_daemon):
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "scripts/grafana/kvbm-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    used = {re.sub(r"_(bucket|total|count|sum)$", "", m) for e in exprs
            for m in re.findall(r"\b((?:kvbm|process)_[a-z0-9_]+)", e)}
    assert len(used) >= 20
    assert used <= set(families(s3_daemon.info["metrics_port"])), used - set(families(s3_daemon.info["metrics_port"]))


def test_two_metrics_registries_in_one_process_do_not_collide():
    from kvbm.daemon.metrics import Metrics

    a, b = Metrics(lambda: {}), Metrics(lambda: {})
    a.lookup.labels(tier="G2").observe(0.001)
    assert "kvbm_lookup_seconds_count" in a.render().decode() and b.render()


# -- status --watch -----------------------------------------------------------------------------------------
def test_status_watch_refreshes_the_daemon_view(s3_daemon):
    res = CliRunner().invoke(main, ["status", "--daemon", s3_daemon.endpoint, "--watch", "0.2", "--count", "3"],
                             env={"KVBM_CONFIG": str(s3_daemon.cfg_path)}, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert res.output.count(f"daemon {s3_daemon.endpoint}:") == 3


# -- config errors --------------------------------------------------------------------------------------------
def test_misspelled_env_variable_fails_status_with_the_suggestion(tmp_path):
    env = {"KVBM_S3_ENABLED": "false", "KVBM_DISK_DIR": str(tmp_path), "KVBM_EMBEDDED_S3_ENABLED": "false",
           "KVBM_DAEMON_ENDPOINT": f"ipc://{tmp_path}/none.sock", "KVBM_CONFIG": None, "KVBM_DAEMON": None,
           "KVBM_S3_ENDPIONT": "http://127.0.0.1:1"}
    res = CliRunner().invoke(main, ["status", "--direct"], env=env, catch_exceptions=False)
    assert res.exit_code == 1, res.output
    assert "KVBM_S3_ENDPIONT: unknown; did you mean KVBM_S3_ENDPOINT?" in res.output
    del env["KVBM_S3_ENDPIONT"]
    assert CliRunner().invoke(main, ["status", "--direct"], env=env).exit_code == 0


def test_variables_that_are_not_config_overrides_stay_allowed():
    from kvbm.config import NON_CONFIG_ENV

    env = {name: "x" for name in NON_CONFIG_ENV if name != "KVBM_CONFIG"}
    assert {"KVBM_DAEMON", "KVBM_REQUIRE", "KVBM_LOG_LEVEL", "KVBM_WEED"} <= set(env)
    load_config(environ=env)
    with pytest.raises(ConfigError, match=r"KVBM_BLOK_BYTES: unknown; did you mean KVBM_BLOCK_BYTES\?"):
        load_config(environ={"KVBM_BLOK_BYTES": "4MiB"})


@pytest.mark.parametrize("text, msg", [
    ("s3:\n  endpiont: http://x\n", "s3.endpiont: unknown field; did you mean s3.endpoint?"),
    ("blok_bytes: 4MiB\n", "blok_bytes: unknown field; did you mean block_bytes?"),
    ("dsk:\n  dir: /x\n", "dsk: unknown field; did you mean disk?"),
])
def test_unknown_yaml_field_names_the_closest_field(tmp_path, text, msg):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(f, environ={})
    assert msg in str(ei.value)


# -- config show ----------------------------------------------------------------------------------------------
def test_config_show_redacts_secrets_and_says_where_each_value_came_from(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("s3:\n  secret_key: topsecret-file\n  endpoint: http://s3.example\ndisk:\n  capacity: 3GiB\n")
    env = {"KVBM_CONFIG": str(f), "KVBM_S3_BUCKET": "from-env", "KVBM_S3_ACCESS_KEY": "AKIAENVKEY"}
    res = CliRunner().invoke(main, ["config", "show", "--json"], env=env, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "topsecret" not in res.output and "AKIAENVKEY" not in res.output
    rows = {r["field"]: r for r in json.loads(res.output)["fields"]}
    assert rows["s3.secret_key"]["value"] == "<redacted>" and rows["s3.secret_key"]["source"] == "file"
    assert rows["s3.access_key"] == {"field": "s3.access_key", "value": "<redacted>",
                                     "source": "env KVBM_S3_ACCESS_KEY"}
    assert rows["s3.bucket"] == {"field": "s3.bucket", "value": "from-env", "source": "env KVBM_S3_BUCKET"}
    assert rows["disk.capacity"]["value"] == "3GiB" and rows["disk.capacity"]["source"] == "file"
    assert rows["s3.region"]["source"] == "default" and rows["embedded_s3.secret_key"]["value"] == ""
    text = CliRunner().invoke(main, ["config", "show"], env=env, catch_exceptions=False)
    assert text.exit_code == 0 and "topsecret" not in text.output
    line = next(ln for ln in text.output.splitlines() if ln.startswith("s3.bucket"))
    assert "from-env" in line and "env KVBM_S3_BUCKET" in line


# -- plan -----------------------------------------------------------------------------------------------------
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16",
            "_name_or_path": "meta-llama/Llama-3.1-8B"}


def plan_json(tmp_path, cfg: dict, *args: str) -> dict:
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    res = CliRunner().invoke(main, ["plan", "--model-config", str(f), "--json", *args], env={"KVBM_CONFIG": None},
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_plan_llama_8b(tmp_path):
    one = plan_json(tmp_path, LLAMA_8B, "--tp", "1", "--block-bytes", "8MiB")
    assert one["bytes_per_token_per_rank"] == 128 * 1024 and one["tokens_per_block"] == 64
    four = plan_json(tmp_path, LLAMA_8B, "--tp", "4", "--host", "64GiB", "--disk", "2TiB", "--block-bytes", "8MiB")
    assert four["bytes_per_token_per_rank"] == 32 * 1024 and four["bytes_per_token"] == 128 * 1024
    assert four["tokens_per_block"] == 256
    tiers = {t["tier"]: t for t in four["tiers"]}
    assert tiers["G2"]["blocks"] == 64 * 1024 // 8  # 8 MiB slots
    assert tiers["G2"]["tokens"] == 64 * 2**30 // (128 * 1024)  # 512Ki tokens of context across the 4 ranks
    # Disk blocks carry a 4 KiB header: slightly fewer than 2 TiB / 8 MiB.
    assert tiers["G3"]["blocks"] == 2 * 2**40 // (8 * 2**20 + 4096)
    assert tiers["G3"]["tokens"] == tiers["G3"]["blocks"] // 4 * 256


def test_plan_mla_model_and_text(tmp_path):
    ds = {"num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048,
          "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
    rep = plan_json(tmp_path, ds, "--tp", "2", "--block-bytes", "8MiB")
    # MLA: one joint latent of 512 + 64 per layer, replicated on every rank.
    assert rep["bytes_per_token_per_rank"] == 27 * 576 * 2 and rep["mla"] is True
    f = tmp_path / "config.json"
    res = CliRunner().invoke(main, ["plan", "--model-config", str(f), "--host", "1GiB"], env={"KVBM_CONFIG": None})
    assert res.exit_code == 0 and "bytes per token" in res.output and "G2" in res.output
    f.write_text(json.dumps({"hidden_size": 10}))
    res = CliRunner().invoke(main, ["plan", "--model-config", str(f)], env={"KVBM_CONFIG": None})
    assert res.exit_code == 1 and "num_hidden_layers" in res.output
