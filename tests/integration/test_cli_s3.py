"""``kvbm s3 start|status|stop`` manage the embedded SeaweedFS named by the config."""

import json

from click.testing import CliRunner
from needs import require

from kvbm.cli.main import main
from kvbm.s3server import weed_runs


def test_embedded_s3_lifecycle(tmp_path, monkeypatch):
    ok, why = weed_runs()
    require("s3", ok, f"SeaweedFS cannot run here: {why}")
    monkeypatch.setenv("KVBM_EMBEDDED_S3_DIR", str(tmp_path / "weed"))
    monkeypatch.delenv("KVBM_CONFIG", raising=False)
    r = CliRunner()
    res = r.invoke(main, ["s3", "status"])
    assert res.exit_code == 3 and json.loads(res.output)["running"] is False
    res = r.invoke(main, ["s3", "start"])
    assert res.exit_code == 0, res.output
    started = json.loads(res.output)
    try:
        assert started["status"] == "started" and started["endpoint"].startswith("http://127.0.0.1:")
        again = json.loads(r.invoke(main, ["s3", "start"]).output)
        assert again["status"] == "reused" and again["pid"] == started["pid"]
        st = json.loads(r.invoke(main, ["s3", "status"]).output)
        assert st["running"] and st["pid"] == started["pid"]
    finally:
        res = r.invoke(main, ["s3", "stop", "--timeout", "3"])
    assert res.exit_code == 0 and res.output.strip() == "stopped"
    assert r.invoke(main, ["s3", "status"]).exit_code == 3
