"""Identity is exact: namespaces every tier accepts, length-prefixed root hashes, old block formats never
served, one process per disk directory."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner
from serve_proc import ServeProc

from kvbm.blocks import BlockKey
from kvbm.blocks.hashing import prefix_hashes, root_hash
from kvbm.blocks.keys import check_namespace, is_namespace, model_slug
from kvbm.blocks.layout import KVLayout
from kvbm.cli.main import main
from kvbm.config import S3Config
from kvbm.errors import ConfigError
from kvbm.ops import Selector, iter_disk
from kvbm.tiers.disk import DiskTier
from kvbm.tiers.s3 import make_s3_tier

PAYLOAD = 4096

AWKWARD = [
    "./m", "/abs/path/Model", "org/Model-7B", "..", ".", "", "-", "_.-", "модель/Ünïcødé-模型", "Café",
    "x" * 300, "a/" * 100 + "b", "../../etc/passwd", "tab\tnewline\nnul\0", "UPPER_case.v1",
]


def layout(model: str, **kw) -> KVLayout:
    return KVLayout(model=model, num_layers=2, num_kv_heads=2, head_size=64, tokens_per_block=16, **kw)


def payload(k: BlockKey) -> bytes:
    return (k.hash * (PAYLOAD // len(k.hash) + 1))[:PAYLOAD]


# -- namespaces ---------------------------------------------------------------------------------------------
def test_slug_and_namespace_syntax():
    assert model_slug("./m") == "m"
    assert model_slug("/abs/path/Model") == "abs-path-model"
    assert model_slug("org/Model-7B") == "org-model-7b"
    assert model_slug("..") == "model" and model_slug("") == "model"
    assert model_slug("Café") == "cafe"
    assert len(model_slug("x" * 300)) == 48
    namespaces = {layout(m).namespace for m in AWKWARD}
    assert len(namespaces) == len(AWKWARD)  # the fingerprint holds the full name: no two collide
    for ns in namespaces:
        assert check_namespace(ns) == ns
    for bad in ("", ".-m-0123456789abcdef", "..-0123456789abcdef", "a/b-0123456789abcdef", "m-0123456789ABCDEF",
                "m-0123", "модель-0123456789abcdef", "-m-0123456789abcdef", "m\0-0123456789abcdef"):
        assert not is_namespace(bad)
        with pytest.raises(ConfigError, match="not a kvbm namespace"):
            check_namespace(bad)
        with pytest.raises(ConfigError, match="not a kvbm namespace"):
            Selector(namespaces=(bad,))


def test_awkward_model_names_through_disk_and_s3(s3_server, s3_prefix, tmp_path):
    """Every model name yields a namespace that the disk tier and the bucket store, index and list back."""
    keys = [BlockKey(layout(m).namespace, bytes([i]) * 16) for i, m in enumerate(AWKWARD)]

    async def go():
        disk = DiskTier(tmp_path / "disk", 1 << 30, fsync=False, o_direct=False)
        s3 = make_s3_tier(S3Config(bucket=s3_server.bucket, prefix=s3_prefix), s3_server.endpoint,
                          (s3_server.access_key, s3_server.secret_key))
        await disk.start()
        await s3.start()
        try:
            for k in keys:
                await disk.put(k, payload(k))
                await s3.put(k, payload(k))
            for k in keys:
                for t in (disk, s3):
                    out = bytearray(PAYLOAD)
                    assert await t.get_into(k, memoryview(out)) == PAYLOAD and bytes(out) == payload(k), (t, k)
            listed = {b.key async for b in s3.scan()}
            assert listed == set(keys)
            assert {s3.parse_key(s3.object_key(k)) for k in keys} == set(keys)
        finally:
            await disk.close()
            await s3.close()
        again = DiskTier(tmp_path / "disk", 1 << 30, fsync=False, o_direct=False)
        await again.start()  # re-index from the files
        try:
            assert {b.key async for b in again.scan()} == set(keys) and again.stats.corrupt == 0
        finally:
            await again.close()

    asyncio.run(go())
    assert {e.key for e in iter_disk(tmp_path / "disk")} == set(keys)


# -- hashing and format ---------------------------------------------------------------------------------------
def test_root_hash_fields_cannot_run_into_each_other():
    assert root_hash("a", "b\0lora\0") != root_hash("a\0lora\0b", "")
    assert root_hash("ab", "") != root_hash("a", "b")
    assert root_hash(None, None) == root_hash("", "")
    toks = list(range(32))
    assert prefix_hashes(toks, 16, salt="a", lora="b\0lora\0") != prefix_hashes(toks, 16, salt="a\0lora\0b")


def v1_block(key: BlockKey, data: bytes, header_len: int) -> bytes:
    """A block exactly as format version 1 (kvbm 0.1) wrote it."""
    fields = struct.pack("<4sHHIQQQ8sB32s", b"KVBM", 1, header_len, 0, len(data), xxhash.xxh3_64_intdigest(data),
                         time.time_ns(), bytes.fromhex(key.fingerprint), len(key.hash), key.hash.ljust(32, b"\0"))
    head = fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))
    return head.ljust(header_len, b"\0") + data


def test_old_format_blocks_are_never_served(s3_server, s3_prefix, tmp_path):
    k = BlockKey(layout("org/Model").namespace, b"\x42" * 16)

    async def go():
        disk = DiskTier(tmp_path / "disk", 1 << 30, fsync=False, o_direct=False)
        path = disk.path_for(k)
        path.parent.mkdir(parents=True)
        path.write_bytes(v1_block(k, payload(k), disk.header_len))
        await disk.start()
        s3 = make_s3_tier(S3Config(bucket=s3_server.bucket, prefix=s3_prefix), s3_server.endpoint,
                          (s3_server.access_key, s3_server.secret_key))
        await s3.start()
        try:
            await s3.session.client.put_object(Bucket=s3.bucket, Key=s3.object_key(k),
                                               Body=v1_block(k, payload(k), 128))
            _ = [b async for b in s3.scan()]
            for t in (disk, s3):
                out = bytearray(PAYLOAD)
                assert await t.get_into(k, memoryview(out)) is None, t
                assert not t.contains(k)
        finally:
            await disk.close()
            await s3.close()

    asyncio.run(go())


# -- one process per disk directory ---------------------------------------------------------------------------
def daemon_cfg(tmp: Path, name: str, disk: Path) -> dict:
    return {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(disk), "capacity": "64MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
        "daemon": {"endpoint": f"ipc://{tmp}/{name}.sock", "events_endpoint": "", "metrics_port": 0},
    }


def test_one_process_owns_a_disk_directory(tmp_path):
    disk = tmp_path / "disk"
    keys = [BlockKey(layout("org/Model").namespace, bytes([i]) * 16) for i in range(3)]

    async def fill():
        d = DiskTier(disk, 1 << 30, fsync=False, o_direct=False)  # not started: like kvbm prewarm, no lock
        for k in keys:
            await d.put(k, payload(k))
        await d.close()

    asyncio.run(fill())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ServeProc(tmp_path / "a", daemon_cfg(tmp_path, "a", disk))
    second = ServeProc(tmp_path / "b", daemon_cfg(tmp_path, "a", disk))  # the same config, started twice
    env = {"KVBM_DISK_DIR": str(disk), "KVBM_S3_ENABLED": "false", "KVBM_EMBEDDED_S3_ENABLED": "false",
           "KVBM_DISK_FSYNC": "false", "KVBM_DISK_O_DIRECT": "false", "KVBM_TRANSFER_BACKEND": "plain",
           "KVBM_HOST_CAPACITY": "1MiB", "KVBM_HOST_PIN": "false", "KVBM_BLOCK_BYTES": "64KiB",
           "KVBM_DAEMON_ENDPOINT": f"ipc://{tmp_path}/a.sock", "KVBM_DAEMON": None, "KVBM_CONFIG": None,
           "KVBM_DAEMON_ADMIN_TOKEN_FILE": str(first.admin_token_path)}  # purging the daemon's files needs it
    try:
        first.start()
        with pytest.raises(RuntimeError, match="daemon exited") as e:
            second.start()
        assert "is in use by another kvbm process" in str(e.value) and f"pid {first.proc.pid}" in str(e.value)
        assert first.proc.poll() is None
        with first.client() as c:  # the first still owns its endpoint and its blocks
            assert {t["tier"]: t["blocks"] for t in c.stats()["tiers"]}["G3"] == 3

        # kvbm demo on the same directory: a clear one-line error, nothing written.
        r = CliRunner().invoke(main, ["demo", "--blocks", "1"], env=env, catch_exceptions=False)
        assert r.exit_code != 0 and "is in use by another kvbm process" in r.output, r.output

        # status --direct reads the directory under the live daemon.
        r = CliRunner().invoke(main, ["status", "--direct", "--json"], env=env, catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["disk"]["total"]["objects"] == 3
        # purge --direct would delete behind the daemon's back: refused, every file stays.
        r = CliRunner().invoke(main, ["purge", "--direct", "--from", "disk", "--all", "--yes"], env=env,
                               catch_exceptions=False)
        assert r.exit_code != 0 and "kvbm daemon" in r.output and "--direct" in r.output, r.output
        assert len(list(iter_disk(disk))) == 3
        # Through the daemon it goes, and the daemon is told.
        r = CliRunner().invoke(main, ["purge", "--from", "disk", "--all", "--yes", "--json"], env=env,
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        out = json.loads(r.output.strip().splitlines()[-1])
        assert out["deleted"] == 3 and "dropped 3 index entries from G3" in out["daemon"]
    finally:
        first.stop()
        second.stop()
    # With the daemon gone the directory is free again: a direct purge works, a new daemon starts.
    r = CliRunner().invoke(main, ["purge", "--direct", "--from", "disk", "--all", "--yes"], env=env,
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    try:
        second.start()
    finally:
        second.stop()
