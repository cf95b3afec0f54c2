"""A peer in ``kvbm bench tiers``: LMCache's S3 connector against the same S3 server, in the same run.

LMCache pins numpy and cupy versions that clash with kvbm's, so it lives in its own virtual environment
(``scripts/lmcache_venv.sh``) and runs as a subprocess: this module writes :data:`PEER_SCRIPT` to a file,
runs it with the peer's python (``--peer-python``) and reads one JSON object from its stdout.

LMCache's S3 connector (awscrt) addresses buckets virtual-hosted only (``<bucket>.<domain>``), so the
bench starts SeaweedFS with ``-s3.domainName=<domain>`` and runs the peer in a private mount namespace
whose ``/etc/hosts`` maps ``<bucket>.<domain>`` to 127.0.0.1 (``unshare -m``; needs root).

The peer script does what kvbm's S3 rows do, with LMCache's public connector API, one pass per "pass"
line on its stdin (so the bench interleaves the peer's passes with kvbm's): PUT ``blocks`` objects of
``block_bytes`` with all requests in flight (``asyncio.gather`` of ``connector.put``, which LMCache
queues to its awscrt client), then GET them all the same way; wall time, its own process CPU (getrusage,
every thread) and the server's CPU per pass; every GET is checked byte for byte against what was PUT
(outside the timed part). LMCache's ``put`` logs and swallows failures, so a pass whose objects do not
all read back is an error, never a figure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

# Runs under the peer's python (not kvbm's): only the standard library, torch and lmcache.
PEER_SCRIPT = r'''
import asyncio, json, os, resource, sys, threading, time


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def srv_cpu(pid):
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
    except OSError:
        return None
    fields = st[st.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    cfg = json.loads(sys.stdin.readline())
    import logging
    logging.disable(logging.WARNING)
    import torch
    import lmcache
    from importlib.metadata import version
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    n, size = cfg["blocks"], cfg["block_bytes"]
    # One LMCache chunk = one kvbm block: (layers=1, K/V=2, chunk=256 tokens, heads=1, head_size) fp16.
    head = size // (2 * 256 * 2)
    if head * 2 * 256 * 2 != size:
        raise SystemExit(f"block_bytes {size} is not a multiple of 1024")
    url = f"s3://{cfg['bucket']}.{cfg['domain']}:{cfg['port']}"
    extra = {"s3_num_io_threads": cfg["io_threads"], "disable_tls": True, "s3_prefer_http2": False,
             "aws_access_key_id": cfg["access_key"], "aws_secret_access_key": cfg["secret_key"],
             "s3_region": "us-east-1"}
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=False, max_local_cpu_size=(n + 8) * size / 2**30 + 0.5, remote_url=url,
        remote_serde="naive", extra_config=extra)
    meta = LMCacheMetadata(model_name=cfg["model"], world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float16, kv_shape=(1, 2, 256, 1, head))
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    backend = LocalCPUBackend(config, meta)
    conn = CreateConnector(url, loop, backend, config, meta)

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    g = torch.Generator().manual_seed(cfg["seed"])
    objs, want = [], []
    for i in range(n):
        inner = getattr(conn, "_connector", conn)  # CreateConnector wraps it for LMCache's stats
        m = backend.allocate(inner.meta_shapes, inner.meta_dtypes, inner.meta_fmt)
        if m is None:
            raise SystemExit("LocalCPUBackend could not allocate a chunk")
        t = m.tensor.view(torch.uint8).view(-1)
        t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8, generator=g))
        objs.append(m)
        want.append(bytes(t.numpy()))
    meta = {"component": "lmcache", "version": version("lmcache"), "client": "S3Connector (awscrt)",
            "url": url, "io_threads": cfg["io_threads"]}
    # One object through each path first, untimed (connections, the bucket's volumes, the first-GET cost).
    warm = CacheEngineKey(cfg["model"], 1, 0, 0, torch.float16)
    run(conn.put(warm, objs[0]))
    m = run(conn.get(warm))
    if m is None:
        raise SystemExit(f"warm-up object did not read back from {url}")
    m.ref_count_down()
    print("PEER-READY " + json.dumps(meta), flush=True)
    r = 0
    for line in sys.stdin:  # one command a line: "pass" (PUT all, then GET all) or "quit"
        if line.strip() != "pass":
            break
        keys = [CacheEngineKey(cfg["model"], 1, 0, r * n + i + 1, torch.float16) for i in range(n)]

        async def put_all():
            await asyncio.gather(*(conn.put(k, m) for k, m in zip(keys, objs)))

        async def get_all():
            return await asyncio.gather(*(conn.get(k) for k in keys))

        out = {}
        s0, c0, t0 = srv_cpu(cfg["server_pid"]), cpu(), time.perf_counter()
        run(put_all())
        wall, c, s1 = time.perf_counter() - t0, cpu() - c0, srv_cpu(cfg["server_pid"])
        out["put"] = {"wall": wall, "cpu": c, "server_cpu": None if s0 is None else s1 - s0}
        s0, c0, t0 = srv_cpu(cfg["server_pid"]), cpu(), time.perf_counter()
        got = run(get_all())
        wall, c, s1 = time.perf_counter() - t0, cpu() - c0, srv_cpu(cfg["server_pid"])
        out["get"] = {"wall": wall, "cpu": c, "server_cpu": None if s0 is None else s1 - s0}
        bad = [i for i, m in enumerate(got)
               if m is None or bytes(m.tensor.view(torch.uint8).view(-1).numpy()) != want[i]]
        if bad:
            raise SystemExit(f"pass {r}: {len(bad)} of {n} objects did not read back as written (first: {bad[0]})")
        for m in got:
            m.ref_count_down()
        print("PEER-PASS " + json.dumps(out), flush=True)
        r += 1
    # The connector's close() waits on its priority-queue executor from inside the loop it runs on and
    # never returns (lmcache 0.5.6): the figures are out, so leave without it.
    sys.stderr.flush()
    os._exit(0)


main()
'''


class PeerError(RuntimeError):
    """The peer could not run (not installed, no host mapping, a failed pass): the message says why."""


def hosts_mapping_command(argv: list[str], hostname: str, tmp: Path) -> list[str]:
    """``argv`` run where ``hostname`` resolves to 127.0.0.1: a private mount namespace with its own
    /etc/hosts (root only), or ``argv`` unchanged when the name already resolves to loopback."""
    import socket

    with contextlib.suppress(OSError):
        if socket.gethostbyname(hostname) == "127.0.0.1":
            return argv
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        raise PeerError(f"lmcache: its S3 connector needs {hostname} to resolve to 127.0.0.1; run as root (the "
                        f"bench then uses `unshare -m` with a private /etc/hosts) or add it to /etc/hosts")
    hosts = tmp / "hosts"
    base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
    hosts.write_text(base + f"\n127.0.0.1 {hostname}\n")
    return [unshare, "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]


def peer_connections(pid: int, port: int) -> int:
    """Established TCP connections that process ``pid`` holds to ``port`` (its sockets in /proc/net/tcp)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    n = 0
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # local, remote, state (01 = ESTABLISHED), ..., inode
            if len(f) > 9 and f[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) == port and f[9] in inodes:
                n += 1
    return n


class PeerProcess:
    """The LMCache peer as a long-lived subprocess: start it (imports, connector, warm-up: untimed), then ask
    for one timed pass (PUT all blocks, GET them all back) at a time, so the bench can interleave the peer's
    passes with kvbm's on a shared machine."""

    def __init__(self, python: str, *, srv: dict[str, Any], domain: str, blocks: int, block_bytes: int,
                 io_threads: int = 64, seed: int = 0, timeout_s: float = 600.0) -> None:
        if not Path(python).exists():
            raise PeerError(f"lmcache: peer python {python} does not exist (scripts/lmcache_venv.sh builds one)")
        host, _, port = srv["endpoint"].removeprefix("http://").partition(":")
        if host != "127.0.0.1":
            raise PeerError(f"lmcache: the peer runs against a loopback endpoint only, not {srv['endpoint']}")
        # Absolute (not resolved: a venv's python is a symlink whose path picks the venv): the peer runs from
        # its own temp dir, where a path relative to ours names nothing.
        self.python = os.path.abspath(python)
        self.timeout_s = timeout_s
        self.cfg = {"bucket": srv["bucket"], "domain": domain, "port": int(port), "access_key": srv["access_key"],
                    "secret_key": srv["secret_key"], "model": f"{srv['prefix']}-lmcache", "blocks": blocks,
                    "block_bytes": block_bytes, "io_threads": io_threads, "seed": seed,
                    "server_pid": srv.get("pid")}
        self.hostname = f"{srv['bucket']}.{domain}"
        self.port = int(port)
        self.meta: dict[str, Any] = {}
        self.passes: list[dict[str, Any]] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> PeerProcess:
        # Say "not installed" before anything else (find_spec imports nothing: fast).
        probe = subprocess.run([self.python, "-c", "import importlib.util as u, sys; "
                                "sys.exit(0 if u.find_spec('lmcache') and u.find_spec('torch') else 3)"],
                               capture_output=True, text=True, timeout=120)
        if probe.returncode == 3:
            raise PeerError(f"lmcache: not installed for {self.python} (scripts/lmcache_venv.sh builds a venv "
                            "with it)")
        if probe.returncode != 0:
            raise PeerError(f"lmcache: {self.python} does not run: {probe.stderr.strip()[-500:]}")
        self._tmp = tempfile.TemporaryDirectory(prefix="kvbm-bench-peer-")
        tmp = Path(self._tmp.name)
        script = tmp / "lmcache_peer.py"
        script.write_text(PEER_SCRIPT)
        argv = hosts_mapping_command([self.python, str(script)], self.hostname, tmp)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KVBM_"))}
        env["PYTHONUNBUFFERED"] = "1"
        self._err = open(tmp / "stderr.log", "w+")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                      text=True, env=env, cwd=tmp)
        # The secret travels on stdin, never on a command line.
        self._send(json.dumps(self.cfg))
        self.meta = json.loads(self._reply("PEER-READY "))
        return self

    def run_pass(self) -> dict[str, Any]:
        """One timed pass: {"put": {wall, cpu, server_cpu}, "get": {...}} (seconds), plus "conns": the most
        connections the peer held open to the server at once (its in-flight depth; sampled from here)."""
        import threading

        assert self._proc is not None
        stop, peak = threading.Event(), [0]

        def sample() -> None:
            # Once more after the reply: a pass shorter than the interval still counts its (kept-alive) connections.
            while True:
                done = stop.wait(0.01)
                peak[0] = max(peak[0], peer_connections(self._proc.pid, self.port))  # type: ignore[union-attr]
                if done:
                    return

        th = threading.Thread(target=sample, name="peer-conns", daemon=True)
        th.start()
        try:
            self._send("pass")
            got: dict[str, Any] = json.loads(self._reply("PEER-PASS "))
        finally:
            stop.set()
            th.join()
        got["conns"] = peak[0]
        self.passes.append(got)
        return got

    def close(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(OSError, ValueError):
                self._send("quit")
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None
        if self._tmp is not None:
            self._err.close()
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> PeerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, line: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()

    def _reply(self, prefix: str) -> str:
        import select

        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + self.timeout_s
        out = self._proc.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._proc.kill()
                raise PeerError(f"lmcache: no answer from the peer in {self.timeout_s:.0f} s")
            ready, _, _ = select.select([out], [], [], min(left, 1.0))
            if not ready:
                if self._proc.poll() is not None:
                    raise self._died()
                continue
            line = out.readline()
            if not line:
                self._proc.wait(10)
                raise self._died()
            if line.startswith(prefix):
                return line[len(prefix) :]

    def _died(self) -> PeerError:
        self._err.flush()
        self._err.seek(0)
        tail = self._err.read()[-3000:]
        rc = self._proc.returncode if self._proc else None
        if "No module named 'lmcache'" in tail or "No module named 'torch'" in tail:
            return PeerError(f"lmcache: not installed for {self.python} (scripts/lmcache_venv.sh builds a venv "
                             "with it)")
        return PeerError(f"lmcache: peer exited {rc}: {tail.strip()[-1500:]}")
