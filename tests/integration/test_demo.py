"""``kvbm demo``, the README's main job, end to end on a real SeaweedFS and a temp disk tier."""

import json

from click.testing import CliRunner

from kvbm.cli.main import main


def test_demo_onboards_from_every_tier_byte_exact_and_cleans_up(tmp_path, s3_server, s3_prefix, monkeypatch):
    env = {
        "KVBM_BLOCK_BYTES": "1MiB", "KVBM_DEVICE_CAPACITY": "16MiB", "KVBM_HOST_CAPACITY": "16MiB",
        "KVBM_DISK_DIR": str(tmp_path / "disk"), "KVBM_DISK_FSYNC": "false",
        "KVBM_S3_ENDPOINT": s3_server.endpoint, "KVBM_S3_ACCESS_KEY": s3_server.access_key,
        "KVBM_S3_SECRET_KEY": s3_server.secret_key, "KVBM_S3_BUCKET": s3_server.bucket, "KVBM_S3_PREFIX": s3_prefix,
        "KVBM_EMBEDDED_S3_ENABLED": "false",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("KVBM_CONFIG", raising=False)
    out = tmp_path / "demo.json"
    res = CliRunner().invoke(main, ["demo", "--blocks", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["blocks"] == 4 and report["block_bytes"] == 1 << 20
    assert [r["source"] for r in report["onboard"]] == ["G1", "G2", "G3", "G4"]
    assert all(r["blocks"] == 4 and r["exact"] for r in report["onboard"])
    assert report["stack"]["transfer"] == {"memory": "torch", "file": "posix"}
    assert "G4" in res.output and "bytes exact" in res.output
    # Without --keep the demo's blocks are gone from disk (and from the bucket, which status would show).
    assert not list((tmp_path / "disk").rglob("*.kvb"))
    tiers = {t["tier"]: t for t in report["stack"]["tiers"]}
    assert tiers["G4"]["stats"]["puts"] == 4 and tiers["G4"]["stats"]["hits"] >= 4, tiers
