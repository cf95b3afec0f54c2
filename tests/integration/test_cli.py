"""``kvbm status``, ``kvbm purge`` and ``kvbm prewarm`` against the real SeaweedFS of the conftest, a disk
directory in tmp, and (once) a real daemon subprocess."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from serve_proc import ServeProc

from kvbm import ops
from kvbm.blocks import BlockKey
from kvbm.blocks.hashing import prefix_hashes
from kvbm.cli.main import main
from kvbm.config import S3Config
from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.manager.core import BlockManager
from kvbm.ops import Entry, Selector, parse_duration, plan_purge
from kvbm.tiers.disk import DiskTier
from kvbm.tiers.s3 import S3Tier, make_s3_tier

pytestmark = pytest.mark.s3

NS = "tiny-llama-0123456789abcdef"
NS2 = "tiny-llama-fedcba9876543210"  # same model, another layout
NS3 = "other-model-00112233aabbccdd"
PAYLOAD = 3000


def bkey(ns: str, i: int, tag: bytes = b"") -> BlockKey:
    return BlockKey(ns, (tag + i.to_bytes(4, "big")).ljust(16, b"\x07"))


def data_for(k: BlockKey, n: int = PAYLOAD) -> bytes:
    return (k.hash * (n // len(k.hash) + 1))[:n]


def cli_env(srv, prefix: str, tmp: Path, **over) -> dict[str, str | None]:
    env: dict[str, str | None] = {
        "KVBM_S3_ENDPOINT": srv.endpoint, "KVBM_S3_ACCESS_KEY": srv.access_key, "KVBM_S3_SECRET_KEY": srv.secret_key,
        "KVBM_S3_BUCKET": srv.bucket, "KVBM_S3_PREFIX": prefix, "KVBM_DISK_DIR": str(tmp / "disk"),
        "KVBM_EMBEDDED_S3_ENABLED": "false", "KVBM_EMBEDDED_S3_DIR": str(tmp / "weed"),
        "KVBM_TRANSFER_BACKEND": "plain", "KVBM_DISK_FSYNC": "false", "KVBM_DISK_O_DIRECT": "false",
        # No daemon: the implicit probe finds no socket file and falls back at once.
        "KVBM_DAEMON_ENDPOINT": f"ipc://{tmp}/no-daemon.sock", "KVBM_DAEMON": None, "KVBM_CONFIG": None,
    }
    env.update(over)
    return env


def run(env, *args, ok: bool | None = True):
    res = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    if ok is True:
        assert res.exit_code == 0, res.output
    elif ok is False:
        assert res.exit_code != 0, res.output
    return res


def one_line_error(res) -> str:
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert "Traceback" not in res.output, res.output
    assert lines and lines[-1].startswith("Error:"), res.output
    return lines[-1]


def tier_for(srv, prefix: str) -> S3Tier:
    return make_s3_tier(S3Config(bucket=srv.bucket, prefix=prefix), srv.endpoint, (srv.access_key, srv.secret_key))


async def put_s3(srv, prefix: str, keys, n: int = PAYLOAD, foreign: list[str] = ()) -> None:
    t = tier_for(srv, prefix)
    await t.start()
    try:
        await asyncio.gather(*(t.put(k, data_for(k, n)) for k in keys))
        assert t.stats.errors == 0 and t.stats.shed == 0
        for fk in foreign:
            await t.session.client.put_object(Bucket=srv.bucket, Key=fk, Body=b"not a kvbm block")
    finally:
        await t.close()


async def list_s3(srv, prefix: str) -> list[str]:
    t = tier_for(srv, prefix)
    await t.start()
    try:
        out = []
        token = None
        while True:
            kw = {"Bucket": srv.bucket, "Prefix": prefix.split("/")[0]}
            if token:
                kw["ContinuationToken"] = token
            r = await t.session.client.list_objects_v2(**kw)
            out += [o["Key"] for o in r.get("Contents", [])]
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated"):
                return sorted(out)
    finally:
        await t.close()


def foreign_keys(prefix: str) -> list[str]:
    h = bkey(NS, 0, b"F").hex
    return [
        f"{prefix}/notes.txt",  # under the prefix, not a block
        f"{prefix}/{NS}/README",  # namespace dir, no shard
        f"{prefix}/{NS}/{h[:2]}/{h}.bak",  # not hex
        f"{prefix}/{NS}/zz/{h}",  # wrong shard
        f"{prefix}/not-a-namespace/{h[:2]}/{h}",  # no fingerprint
        f"{prefix}-sibling/{NS}/{h[:2]}/{h}",  # a sibling prefix that merely starts the same
    ]


def put_disk(root: Path, keys, n: int = PAYLOAD, mtime: float | None = None) -> DiskTier:
    async def go():
        d = DiskTier(root, 1 << 30, fsync=False, o_direct=False)
        for k in keys:
            await d.put(k, data_for(k, n))
        await d.close()
        return d

    d = asyncio.run(go())
    if mtime is not None:
        for k in keys:
            os.utime(d.path_for(k), (mtime, mtime))
    return d


# -- unit: parsing and planning --------------------------------------------------------------------------
def test_parse_duration_and_plan():
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("1d12h") == 36 * 3600
    assert parse_duration("90m") == 5400 and parse_duration("45s") == 45 and parse_duration("2w") == 14 * 86400
    assert parse_duration("3600") == 3600
    for bad in ("", "7x", "d", "-1d", "1d 2q"):
        with pytest.raises(ConfigError):
            parse_duration(bad)
    with pytest.raises(ConfigError):
        Selector(namespaces=("no-fingerprint",))
    assert Selector(model="Meta-Llama/Llama 3").model == "meta-llama-llama-3"

    now = 10_000.0
    es = [Entry("bucket", bkey(NS, i), f"k{i}", 100, now - 1000 * i) for i in range(6)]
    es += [Entry("disk", bkey(NS2, i), f"d{i}", 100, now - 1000 * i) for i in range(3)]
    with pytest.raises(ConfigError):
        plan_purge(es, Selector(namespaces=(NS,)))  # scope only: no criterion
    old = plan_purge(es, Selector(older_than_s=2500), now)
    assert sorted(e.ref for e in old) == ["k3", "k4", "k5"]
    # Budget per (store, namespace), oldest first.
    bud = plan_purge(es, Selector(max_bytes=250), now)
    assert sorted(e.ref for e in bud) == ["d2", "k2", "k3", "k4", "k5"]
    both = plan_purge(es, Selector(older_than_s=4500, max_bytes=300), now)
    assert sorted(e.ref for e in both) == ["k3", "k4", "k5"]  # k5 by age, then k4, k3 by budget; disk fits
    assert plan_purge(es, Selector(model="tiny-llama", all=True), now)[0].ref == "k5"  # oldest first
    assert len(plan_purge(es, Selector(model="other-model", all=True), now)) == 0


# -- status ----------------------------------------------------------------------------------------------
def test_status_direct_matches_written(s3_server, s3_prefix, tmp_path):
    keys1 = [bkey(NS, i) for i in range(7)]
    keys2 = [bkey(NS3, i) for i in range(3)]
    asyncio.run(put_s3(s3_server, s3_prefix, keys1 + keys2, foreign=foreign_keys(s3_prefix)))
    disk = put_disk(tmp_path / "disk", keys1[:4])
    (tmp_path / "disk" / "README").write_text("foreign")
    env = cli_env(s3_server, s3_prefix, tmp_path)

    rep = json.loads(run(env, "status", "--json").output)
    assert rep["mode"] == "direct" and not rep["daemon"]["running"] and "no daemon" in rep["daemon"]["reason"]
    b = rep["bucket"]
    assert b["namespaces"][NS]["objects"] == 7 and b["namespaces"][NS]["bytes"] == 7 * (PAYLOAD + 128)
    assert b["namespaces"][NS3]["objects"] == 3
    assert b["total"]["objects"] == 10 and b["total"]["bytes"] == 10 * (PAYLOAD + 128)
    assert b["foreign_objects"] == 5  # the sibling prefix is not even listed
    assert b["total"]["oldest"] <= b["total"]["newest"]
    d = rep["disk"]
    assert d["total"]["objects"] == 4 and list(d["namespaces"]) == [NS]
    assert d["total"]["bytes"] == sum(os.path.getsize(disk.path_for(k)) for k in keys1[:4])

    text = run(env, "status", "--direct").output
    assert NS in text and NS3 in text and "TOTAL" in text and "not kvbm blocks" in text


def fresh_machine_env(tmp_path: Path, weed: str) -> dict[str, str]:
    """A new user's environment: the packaged default config (embedded SeaweedFS, disk tier and daemon socket
    under the cache dir), an empty cache dir, no KVBM_* settings but where ``weed`` is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), HOME=str(tmp_path / "home"), KVBM_WEED=weed)
    return env


def test_status_with_no_daemon_starts_nothing_and_says_so(weed_binary, tmp_path):
    """`kvbm status` on a fresh machine: no daemon, no SeaweedFS running. An inspection command starts nothing
    (before: it launched the embedded SeaweedFS, left it running, and never said the daemon was down); once the
    embedded server runs (`kvbm s3 start`), status lists its bucket without starting anything else."""
    from kvbm.s3server import stop_dir, weeds_serving

    kvbm = str(Path(sys.executable).parent / "kvbm")
    env = fresh_machine_env(tmp_path, weed_binary)
    weed_dir = tmp_path / "cache" / "kvbm" / "seaweedfs"
    try:
        r = subprocess.run([kvbm, "status"], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.splitlines()[0] == "daemon: not running (kvbm serve)", r.stdout
        assert "embedded SeaweedFS is not running" in r.stdout, r.stdout
        assert not weeds_serving(weed_dir), "kvbm status started the embedded SeaweedFS"
        rep = json.loads(subprocess.run([kvbm, "status", "--json"], env=env, capture_output=True, text=True,
                                        timeout=120, check=True).stdout)
        assert rep["daemon"] == {"running": False, "endpoint": f"ipc://{tmp_path}/cache/kvbm/run/kvbm.sock",
                                 "reason": rep["daemon"]["reason"]} and "no daemon socket" in rep["daemon"]["reason"]
        assert rep["bucket"] == {"embedded": str(weed_dir), "running": False}, rep
        assert rep["disk"]["total"]["objects"] == 0 and not weeds_serving(weed_dir)

        subprocess.run([kvbm, "s3", "start"], env=env, capture_output=True, timeout=120, check=True)
        (pid, _), = weeds_serving(weed_dir)
        rep = json.loads(subprocess.run([kvbm, "status", "--json"], env=env, capture_output=True, text=True,
                                        timeout=120, check=True).stdout)
        assert rep["bucket"]["reachable"] and rep["bucket"]["total"]["objects"] == 0, rep
        assert [p for p, _ in weeds_serving(weed_dir)] == [pid]  # the running one, reused
    finally:
        stop_dir(weed_dir, stop_timeout_s=5.0)


def test_errors_are_one_line(s3_server, s3_prefix, s3_bucket, tmp_path):
    env = cli_env(s3_server, s3_prefix, tmp_path)
    r = run({**env, "KVBM_S3_SECRET_KEY": "wrong-secret"}, "status", "--direct", ok=False)
    assert "credentials rejected" in one_line_error(r)
    r = run({**env, "KVBM_S3_BUCKET": s3_bucket}, "purge", "--all", "--dry-run", ok=False)
    assert "does not exist" in one_line_error(r)
    # An explicit endpoint never starts the embedded SeaweedFS, even with embedded_s3 enabled.
    r = run({**env, "KVBM_S3_ENDPOINT": "http://127.0.0.1:9", "KVBM_EMBEDDED_S3_ENABLED": "true",
             "KVBM_S3_MAX_RETRIES": "0", "KVBM_S3_CONNECT_TIMEOUT_S": "0.5"}, "status", "--direct", ok=False)
    assert "unreachable" in one_line_error(r)
    assert not (tmp_path / "weed").exists()
    r = run(env, "status", "--daemon", f"ipc://{tmp_path}/nope.sock", ok=False)
    assert "no daemon" in one_line_error(r)
    r = run(env, "status", "--daemon", "tcp://127.0.0.1:9", ok=False)
    assert "nothing listens" in one_line_error(r)
    r = run({**env, "KVBM_S3_MAX_CONCURRENCY": "lots"}, "status", ok=False)
    assert "max_concurrency" in one_line_error(r)
    # Bad arguments: click usage errors (exit 2), never a traceback.
    for args, words in [
        (["purge"], "nothing selected"),
        (["purge", "--namespace", NS], "only narrow the scope"),
        (["purge", "--older-than", "7x"], "duration"),
        (["purge", "--max-bytes", "lots"], "size"),
        (["purge", "--namespace", NS, "--model", "m", "--all"], "not both"),
        (["purge", "--from", "tape", "--all"], "tape"),
        (["prewarm", "--namespace", "nope"], "not a kvbm namespace"),
        (["prewarm", "--namespace", NS, "--tokens", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["prewarm", "--namespace", NS, "--block-tokens", "4"], "only apply to --tokens"),
        (["prewarm", "--namespace", NS, "--to", "host", "--direct"], "through the daemon"),
    ]:
        r = run(env, *args, ok=False)
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, (args, r.output)
    (tmp_path / "t.jsonl").write_text("[1, 2, 3]\n")
    r = run(env, "prewarm", "--namespace", NS, "--tokens", str(tmp_path / "t.jsonl"), ok=False)
    assert r.exit_code == 2 and "needs --block-tokens" in r.output
    (tmp_path / "t.jsonl").write_text("[1, 2, 3]\nnot json\n")
    r = run(env, "prewarm", "--namespace", NS, "--tokens", str(tmp_path / "t.jsonl"), "--block-tokens", "2", ok=False)
    assert "t.jsonl:2: not JSON" in one_line_error(r)
    r = run(env, "prewarm", "--namespace", NS, "--to", "host", ok=False)
    assert "needs a running daemon" in one_line_error(r)


# -- purge -----------------------------------------------------------------------------------------------
def test_purge_by_namespace_model_prefix_never_foreign(s3_server, s3_prefix, tmp_path):
    a = [bkey(NS, i) for i in range(6)]
    b = [bkey(NS2, i) for i in range(4)]
    c = [bkey(NS3, i) for i in range(3)]
    foreign = foreign_keys(s3_prefix)
    asyncio.run(put_s3(s3_server, s3_prefix, a + b + c, foreign=foreign))
    root = tmp_path / "disk"
    disk = put_disk(root, a + c)
    outside = tmp_path / "outside.kvb"
    outside.write_bytes(b"precious")
    lnk = root / NS / "ee" / ("ee" * 8 + ".kvb")  # a block-shaped name that is a symlink out of the tree
    lnk.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, lnk)
    (root / NS / a[0].hex[:2] / "notes.txt").write_text("foreign")
    env = cli_env(s3_server, s3_prefix, tmp_path)
    tier = tier_for(s3_server, s3_prefix)

    def s3_keys():
        return asyncio.run(list_s3(s3_server, s3_prefix))

    before = s3_keys()
    # Dry run: reports, deletes nothing.
    out = json.loads(run(env, "purge", "--all", "--dry-run", "--json").output)
    assert out["selected"] == len(a + b + c) * 2 - len(b) and out["deleted"] == 0
    assert out["selected_bytes"] > 0 and s3_keys() == before and disk.path_for(a[0]).exists()
    # Without --yes and without a terminal: refused, nothing deleted.
    r = run(env, "purge", "--namespace", NS, "--all", ok=False)
    assert "no terminal" in one_line_error(r) and s3_keys() == before

    # --prefix: one shard of NS in the bucket only.
    shard = a[0].hex[:2]
    in_shard = [k for k in a if k.hex[:2] == shard]
    run(env, "purge", "--prefix", f"{s3_prefix}/{NS}/{shard}", "--from", "bucket", "--yes")  # a full key works too
    gone = set(before) - set(s3_keys())
    assert gone == {tier.object_key(k) for k in in_shard}
    assert disk.path_for(a[0]).exists()  # --from bucket left the disk alone
    # --model: both layouts of tiny-llama, both stores; other-model and foreign objects stay.
    r = run(env, "purge", "--model", "tiny-llama", "--all", "--yes")
    assert "deleted" in r.output and "not told" in r.output
    left = set(s3_keys())
    assert left == set(foreign) | {tier.object_key(k) for k in c}
    assert not any(disk.path_for(k).exists() for k in a) and all(disk.path_for(k).exists() for k in c)
    # --namespace --all; then the widest filter there is: everything kvbm owns.
    run(env, "purge", "--namespace", NS3, "--all", "--yes", "--from", "disk")
    assert not any(disk.path_for(k).exists() for k in c)
    out = json.loads(run(env, "purge", "--all", "--yes", "--json").output)
    assert out["deleted"] == len(c) and out["errors"] == 0
    assert set(s3_keys()) == set(foreign)
    assert outside.read_bytes() == b"precious" and os.path.islink(lnk)
    assert (root / NS / a[0].hex[:2] / "notes.txt").exists()
    # Idempotent: nothing left to do.
    assert "nothing to delete" in run(env, "purge", "--all", "--yes").output


def test_purge_as_a_library_call_asks_before_deleting(s3_server, s3_prefix, tmp_path):
    """``kvbm.ops.run_purge`` is what a cron job imports: the same run as the command, its lines and its question
    through a PurgeUI; without ``yes`` and a UI that answers, nothing is deleted."""
    from kvbm.config import load_config
    from kvbm.ops.purge_run import PurgeAborted, PurgeOptions, PurgeUI, PurgeUsageError, run_purge

    a = [bkey(NS, i) for i in range(4)]
    disk = put_disk(tmp_path / "disk", a)
    cfg = load_config(environ={k: v for k, v in cli_env(s3_server, s3_prefix, tmp_path).items() if v is not None})
    with pytest.raises(PurgeUsageError, match="nothing selected"):
        run_purge(cfg, PurgeOptions(source="disk"))
    with pytest.raises(PurgeAborted):
        run_purge(cfg, PurgeOptions(all=True, source="disk"))  # the default UI answers no
    assert all(disk.path_for(k).exists() for k in a)
    lines: list[str] = []
    asked: list[tuple[int, int, int]] = []
    ui = PurgeUI(say=lines.append, confirm=lambda *q: asked.append(q) or True)
    out = run_purge(cfg, PurgeOptions(all=True, source="disk"), ui)
    assert asked == [(4, out["selected_bytes"], 0)] and out["deleted"] == 4 and out["errors"] == 0
    assert lines[0].startswith("to delete: 4 blocks") and not any(disk.path_for(k).exists() for k in a)


def test_purge_age_and_budget(s3_server, s3_prefix, tmp_path):
    old = [bkey(NS, i, b"o") for i in range(5)] + [bkey(NS3, i, b"o") for i in range(5)]
    asyncio.run(put_s3(s3_server, s3_prefix, old))
    now = time.time()
    root = tmp_path / "disk"
    put_disk(root, [bkey(NS, i, b"o") for i in range(5)], mtime=now - 10 * 86400)
    disk = put_disk(root, [bkey(NS, i, b"n") for i in range(3)], mtime=now - 3600)
    time.sleep(7)  # S3 LastModified cannot be set: let the first wave age
    new = [bkey(NS, i, b"n") for i in range(3)] + [bkey(NS3, i, b"n") for i in range(3)]
    asyncio.run(put_s3(s3_server, s3_prefix, new))
    new_at = time.time()
    env = cli_env(s3_server, s3_prefix, tmp_path)
    tier = tier_for(s3_server, s3_prefix)

    def left():
        return set(asyncio.run(list_s3(s3_server, s3_prefix)))

    # Age, one namespace: only NS's first wave goes from the bucket.
    # The cut lies 4 s after the second wave (its LastModified is truncated to the second, and a loaded
    # machine may take seconds to start the CLI) and well after the first: independent of load.
    cut = math.ceil(time.time() - new_at) + 4
    out = json.loads(run(env, "purge", "--older-than", f"{cut}s", "--namespace", NS, "--from", "bucket", "--yes",
                         "--json").output)
    assert out["deleted"] == 5
    assert left() == {tier.object_key(k) for k in old[5:] + new}
    # On disk (mtimes set back): only the 10-day-old files; a re-run has nothing left to do.
    out = json.loads(run(env, "purge", "--older-than", "1w", "--yes", "--json", "--from", "disk").output)
    assert out["deleted"] == 5
    assert sorted(p.name for p in root.rglob("*.kvb")) == sorted(disk.path_for(k).name for k in new[:3])
    out = json.loads(run(env, "purge", "--older-than", "1w", "--from", "disk", "--yes", "--json").output)
    assert out["deleted"] == 0
    # Budget: keep NS3 at most 3 objects' worth in the bucket -> its 5 oldest go, its 3 newest stay.
    obj = PAYLOAD + 128
    out = json.loads(run(env, "purge", "--namespace", NS3, "--max-bytes", str(3 * obj + 10), "--yes",
                         "--json").output)
    assert out["deleted"] == 5 and out["bytes_freed"] == 5 * obj
    assert left() == {tier.object_key(k) for k in new}
    status = json.loads(run(env, "status", "--direct", "--json").output)
    assert all(u["bytes"] <= 3 * obj + 10 for u in status["bucket"]["namespaces"].values())
    # A budget given in units, across every namespace: 1KiB keeps nothing of 3 KB blocks.
    out = json.loads(run(env, "purge", "--max-bytes", "1KiB", "--from", "bucket", "--yes", "--json").output)
    assert out["deleted"] == len(new) and left() == set()


def test_interrupted_purge_rerun_finishes(s3_server, s3_prefix, tmp_path, monkeypatch):
    keys = [bkey(NS, i) for i in range(23)]
    foreign = foreign_keys(s3_prefix)
    asyncio.run(put_s3(s3_server, s3_prefix, keys, foreign=foreign))
    env = cli_env(s3_server, s3_prefix, tmp_path)
    monkeypatch.setattr(ops.purge, "DELETE_BATCH", 5)
    calls: list[int] = []
    real = S3Tier.delete_many

    async def flaky(self, s3_keys):
        s3_keys = list(s3_keys)
        calls.append(len(s3_keys))
        if len(calls) == 2:
            raise TierUnavailableError("S3 endpoint went away (simulated)")
        return await real(self, s3_keys)

    monkeypatch.setattr(S3Tier, "delete_many", flaky)
    r = run(env, "purge", "--all", "--yes", "--from", "bucket", ok=False)
    assert "stopped early" in one_line_error(r) and "run the same command again" in r.output
    assert calls == [5, 5]
    assert len(asyncio.run(list_s3(s3_server, s3_prefix))) == len(foreign) + len(keys) - 5
    # Ctrl-C in the middle of the second run's second batch.
    calls.clear()

    async def ctrl_c(self, s3_keys):
        s3_keys = list(s3_keys)
        calls.append(len(s3_keys))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return await real(self, s3_keys)

    monkeypatch.setattr(S3Tier, "delete_many", ctrl_c)
    r = run(env, "purge", "--all", "--yes", "--from", "bucket", ok=False)
    assert "interrupted (Ctrl-C)" in one_line_error(r) and "deleted 5 of 18 blocks" in r.output
    assert len(asyncio.run(list_s3(s3_server, s3_prefix))) == len(foreign) + len(keys) - 10
    monkeypatch.setattr(S3Tier, "delete_many", real)
    out = json.loads(run(env, "purge", "--all", "--yes", "--from", "bucket", "--json").output)
    assert out["deleted"] == len(keys) - 10 and out["errors"] == 0
    assert sorted(asyncio.run(list_s3(s3_server, s3_prefix))) == sorted(foreign)


# -- prewarm ---------------------------------------------------------------------------------------------
def test_prewarm_tokens_and_hashes_into_disk(s3_server, s3_prefix, tmp_path):
    bt = 4
    p1 = list(range(100, 113))  # 3 full blocks + 1 token
    p2 = list(range(100, 108)) + list(range(500, 508))  # shares block 0..1 with p1, then 2 of its own
    h1 = prefix_hashes(p1, bt)
    h2 = prefix_hashes(p2, bt)
    k1 = [BlockKey(NS, h) for h in h1]
    k2 = [BlockKey(NS, h) for h in h2]
    assert k1[:2] == k2[:2] and len(k2) == 4
    # The bucket has all of p1 and p2's block 3 but not its block 2 (a gap): block 3 is unreachable.
    extra = [bkey(NS, i, b"x") for i in range(3)]
    asyncio.run(put_s3(s3_server, s3_prefix, [*k1, k2[3], *extra]))
    (tmp_path / "prompts.jsonl").write_text(json.dumps(p1) + "\n\n" + json.dumps(p2) + "\n")
    env = cli_env(s3_server, s3_prefix, tmp_path)
    out = json.loads(run(env, "prewarm", "--namespace", NS, "--tokens", str(tmp_path / "prompts.jsonl"),
                         "--block-tokens", str(bt), "--concurrency", "3", "--json").output)
    assert out["requested"] == 5 and out["fetched"] == 3 and out["missing"] == 1
    assert out["missing_keys"] == [str(k2[2])] and out["unreachable_after_gap"] == 1
    assert out["bytes"] == 3 * PAYLOAD and out["bytes_per_s"] > 0 and out["failed"] == 0

    async def lookups():
        d = DiskTier(tmp_path / "disk", 1 << 30, fsync=False, o_direct=False)
        m = BlockManager([d])
        await m.start()
        try:
            return m.lookup(k1), m.lookup(k2), await m.read(k1[2])
        finally:
            await m.close()

    t1, t2, data = asyncio.run(lookups())
    assert t1 == ["G3"] * 3 and t2 == ["G3"] * 2 and data == data_for(k1[2])

    # --hashes: one present, one already on disk, one absent; text report names the missing one.
    absent = bkey(NS, 77, b"x")
    (tmp_path / "h.txt").write_text(f"# hot blocks\n{extra[0].hex}\n\n{k1[0].hex}\n{absent.hex}\n")
    r = run(env, "prewarm", "--namespace", NS, "--hashes", str(tmp_path / "h.txt"))
    assert "3 blocks requested, 1 already there, 1 fetched" in r.output
    assert "missing: 1 blocks not in the bucket" in r.output and str(absent) in r.output
    # --namespace alone: the rest of the namespace; a second run finds it all there.
    out = json.loads(run(env, "prewarm", "--namespace", NS, "--json").output)
    assert out["requested"] == 7 and out["already_present"] == 4 and out["fetched"] == 3
    out = json.loads(run(env, "prewarm", "--namespace", NS, "--json").output)
    assert out["already_present"] == 7 and out["fetched"] == 0
    # The disk capacity is respected.
    out = json.loads(run({**env, "KVBM_DISK_DIR": str(tmp_path / "small"), "KVBM_DISK_CAPACITY": "20KiB"},
                         "prewarm", "--namespace", NS, "--json").output)
    assert out["fetched"] == 2 and out["skipped_no_room"] == 5


# -- the installed console script and a real daemon ------------------------------------------------------
def _console_env(env: dict[str, str | None]) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("KVBM_")}
    out.update({k: v for k, v in env.items() if v is not None})
    return out


def test_console_script_and_daemon(s3_server, s3_prefix, tmp_path):
    kvbm = Path(sys.executable).parent / "kvbm"
    assert kvbm.exists()
    keys = [bkey(NS, i) for i in range(6)]
    asyncio.run(put_s3(s3_server, s3_prefix, keys, foreign=foreign_keys(s3_prefix)))
    env = _console_env(cli_env(s3_server, s3_prefix, tmp_path))
    r = subprocess.run([kvbm, "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bucket"]["namespaces"][NS]["objects"] == 6
    r = subprocess.run([kvbm, "purge", "--older-than", "soon"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--older-than" in r.stderr

    # A daemon over the same bucket and its own disk dir. It serves at once and lists the bucket in the
    # background; wait for both.
    sock = tmp_path / "d.sock"
    daemon = ServeProc(tmp_path, {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "2MiB", "pin": False},
        "disk": {"dir": str(tmp_path / "ddisk"), "capacity": "64MiB", "fsync": False, "o_direct": False},
        "s3": {"endpoint": s3_server.endpoint, "bucket": s3_server.bucket, "prefix": s3_prefix,
               "access_key": s3_server.access_key, "secret_key": s3_server.secret_key},
        "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{sock}", "events_endpoint": "", "metrics_port": 0},
    })
    try:
        daemon.start(marks=("daemon.started", "bucket.indexed"))
        # The CLI's config names the daemon's admin token file (prewarm --to host and purge need it).
        denv = cli_env(s3_server, s3_prefix, tmp_path, KVBM_DAEMON=f"ipc://{sock}",
                       KVBM_DAEMON_ADMIN_TOKEN_FILE=str(daemon.admin_token_path))
        rep = json.loads(run(denv, "status", "--json").output)
        assert rep["mode"] == "daemon" and rep["workers"] == 0
        tiers = {t["tier"]: t for t in rep["tiers"]}
        assert set(tiers) == {"G2", "G3", "G4"} and tiers["G4"]["blocks"] == 6 and rep["s3"]["healthy"]
        assert "G4" in run(denv, "status").output
        # Prewarm into the daemon's host tier: its index knows at once.
        (tmp_path / "h.txt").write_text("\n".join(k.hex for k in keys[:4]) + "\n" + bkey(NS, 99, b"z").hex + "\n")
        out = json.loads(run(denv, "prewarm", "--namespace", NS, "--hashes", str(tmp_path / "h.txt"), "--to", "host",
                             "--json").output)
        assert out["fetched"] == 4 and out["missing"] == 1 and out["bytes"] == 4 * PAYLOAD
        rep = json.loads(run(denv, "status", "--json").output)
        assert {t["tier"]: t["blocks"] for t in rep["tiers"]}["G2"] == 4 and rep["workers"] == 0
        # Prewarm into the daemon's disk directory: the daemon re-reads it and knows the files at once.
        (tmp_path / "d.txt").write_text("\n".join(k.hex for k in keys[4:]) + "\n")
        out = json.loads(run({**denv, "KVBM_DISK_DIR": str(tmp_path / "ddisk")}, "prewarm", "--namespace", NS,
                             "--hashes", str(tmp_path / "d.txt"), "--to", "disk", "--json").output)
        assert out["fetched"] == 2 and "indexed them (2 new blocks" in out["note"]
        rep = json.loads(run(denv, "status", "--json").output)
        assert {t["tier"]: t["blocks"] for t in rep["tiers"]}["G3"] == 2
        # Purge tells the daemon, which drops the blocks from its G4 index.
        out = json.loads(run(denv, "purge", "--namespace", NS, "--all", "--from", "bucket", "--yes", "--json").output)
        assert out["deleted"] == 6 and "dropped 6 index entries from G4" in out["daemon"]
        rep = json.loads(run(denv, "status", "--json").output)
        assert {t["tier"]: t["blocks"] for t in rep["tiers"]}["G4"] == 0
    finally:
        daemon.stop()


def test_tokens_file_hashing_matches_manager(tmp_path):
    toks = list(range(1, 20))
    (tmp_path / "p.jsonl").write_text(json.dumps(toks) + "\n")
    for scheme, vbs in (("kvbm", None), ("vllm", 2)):
        chains = ops.keys_from_tokens_file(str(tmp_path / "p.jsonl"), NS, 4, scheme, vbs)
        assert chains == [[BlockKey(NS, h) for h in prefix_hashes(toks, 4, scheme=scheme, vllm_block_size=vbs)]]
        assert len(chains[0]) == 4
    (tmp_path / "bad.jsonl").write_text("[1, 99999999999]\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: token ids must fit"):
        ops.keys_from_tokens_file(str(tmp_path / "bad.jsonl"), NS, 2)
    (tmp_path / "h.txt").write_text("abcd\nxyz\n")
    with pytest.raises(ConfigError, match=r"h\.txt:2"):
        ops.keys_from_hashes_file(str(tmp_path / "h.txt"), NS)


def test_group_config_loads_lazily_once_for_every_command_and_commands_keep_their_own(tmp_path):
    """``kvbm --config FILE CMD`` and ``kvbm CMD --config FILE`` (the command's wins); a command that needs no
    config (``keys generate``, ``--help``) runs whatever the group was given; a bad one names the field."""
    good, missing, bad = tmp_path / "good.yaml", tmp_path / "missing.yaml", tmp_path / "bad.yaml"
    good.write_text(json.dumps({
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "disk": {"dir": str(tmp_path / "disk")},
        "daemon": {"endpoint": f"ipc://{tmp_path}/no-daemon.sock"},
    }))
    bad.write_text("daemon: {max_workers: 0}\n")
    env = {"KVBM_CONFIG": None, "KVBM_DAEMON": None}
    for args in (["--config", str(good), "status"], ["status", "--config", str(good)],
                 ["--config", str(missing), "status", "--config", str(good)]):
        rep = json.loads(run(env, *args, "--direct", "--json").output)
        assert rep["disk"]["dir"] == str(tmp_path / "disk") and "bucket" not in rep, args
    shown = json.loads(run(env, "--config", str(good), "config", "show", "--json").output)
    assert shown["config_file"] == str(good)
    assert json.loads(run({**env, "KVBM_CONFIG": str(good)}, "config", "show", "--json").output)["config_file"] == \
        str(good)
    run(env, "--config", str(missing), "keys", "generate", "--dir", str(tmp_path / "keys"))
    assert (tmp_path / "keys" / "client.key").exists()
    assert "Usage" in run(env, "--config", str(missing), "--help").output
    assert "cannot read config file" in one_line_error(run(env, "--config", str(missing), "status", ok=False))
    for cmd in (["status", "--direct"], ["config", "show"], ["s3", "status"], ["demo"]):
        line = one_line_error(run(env, "--config", str(bad), *cmd, ok=False))
        assert "daemon.max_workers: must be >= 1" in line, (cmd, line)
