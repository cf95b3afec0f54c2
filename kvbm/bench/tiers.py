"""``kvbm bench tiers``: throughput of every path the block manager moves bytes on, next to a raw baseline.

Each kvbm figure goes through :class:`~kvbm.manager.BlockManager` over tiers built by
:func:`kvbm.stack.build_stack` (``onboard`` for upward moves, ``offload(durable=True)`` for downward ones);
each baseline moves the same bytes in the same process with the plainest code that does the job:

==================  ========================================  ===========================================
path                kvbm                                      baseline
==================  ========================================  ===========================================
G2->G1, G1->G2      manager onboard / offload (memory mover)  numpy ``copyto`` per block (and torch copy_)
G2->G3              offload durable (DiskTier, fsync)         open + pwrite + fdatasync per file, 1 thread
G3->G2 cold/warm    onboard (page cache dropped / kept)       pread per file (fadvise DONTNEED / kept)
G2->G4 PUT          offload durable (S3Tier http|aio|nixl)    boto3 put_object, N threads
G4->G2 GET          onboard                                   boto3 get_object().read(), N threads
==================  ========================================  ===========================================

Repeats of kvbm and baseline are interleaved so drift hits both; the S3 rows run in rounds (every S3 path
once per round, then the LMCache peer's pass), so each path's i-th run sits next to the others' i-th run.
CPU is ``getrusage(RUSAGE_SELF)``
user+sys over the run (every thread of this process); the S3 server's CPU comes from ``/proc/<pid>/stat``
of the embedded SeaweedFS (its whole process group), when this bench started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvbm.bench.common import (
    MB,
    BenchTarget,
    CpuMeter,
    boto3_client,
    delete_prefix,
    load_avg,
    machine,
    median,
    rnd_bytes,
    s3_server,
    temp_dir,
)
from kvbm.blocks import BlockKey
from kvbm.config import Config

MiB = 1024 * 1024


@dataclass
class TiersOptions(BenchTarget):
    block_bytes: int = 8 * MiB
    blocks: int = 64
    repeats: int = 3
    groups: tuple[str, ...] = ("memory", "disk", "s3")
    s3_clients: tuple[str, ...] = ("aiobotocore", "nixl")
    file_io: tuple[str, ...] = ("auto",)  # transfer.backend values for G3: auto, plain, nixl
    disk_modes: tuple[str, ...] = ("direct", "buffered")  # G3 with O_DIRECT and with the page cache
    boto3_threads: int = 8
    s3_concurrency: int = 8  # s3.max_concurrency of the kvbm tier
    s3_reference: bool = True  # also time plain aiobotocore (the S3Tier's library, without kvbm)
    peer_python: str | None = None  # python of a venv with LMCache: its S3 connector runs as a peer
    peer_domain: str = "s3.kvbm.test"  # SeaweedFS -s3.domainName (the peer addresses <bucket>.<domain>)
    peer_io_threads: int = 64  # LMCache's s3_num_io_threads (its default)
    extra: dict[str, Any] = field(default_factory=dict)


def _namespace() -> str:
    return f"kvbm-bench-{secrets.token_hex(8)}"


def _config(opts: TiersOptions, work: Path, *, backend: str = "auto", o_direct: bool = True,
            s3: dict[str, Any] | None = None, client: str = "aiobotocore", prefix: str = "kvbm") -> Config:
    cap = (opts.blocks + 1) * opts.block_bytes
    d: dict[str, Any] = {
        "block_bytes": opts.block_bytes,
        "device": {"enabled": True, "capacity": cap, "device": "auto"},
        "host": {"capacity": cap, "pin": True},
        "disk": {"dir": str(work / f"g3-{uuid.uuid4().hex[:6]}"), "capacity": 2 * cap + (64 << 20),
                 "o_direct": o_direct, "fsync": True},
        "s3": {"enabled": s3 is not None},
        "embedded_s3": {"enabled": False},
        "transfer": {"backend": backend},
    }
    if s3 is not None:
        d["s3"] = {"enabled": True, "endpoint": s3["endpoint"], "bucket": s3["bucket"], "prefix": prefix,
                   "access_key": s3["access_key"], "secret_key": s3["secret_key"], "client": client,
                   "max_concurrency": opts.s3_concurrency, "max_pending_writes": max(64, opts.blocks)}
    return msgspec.convert(d, Config)


@dataclass
class _Pair:
    """One kvbm path and its baseline, for :meth:`_Runner.rounds`; ``after`` runs untimed after each kvbm run
    (e.g. comparing what it read with what was written)."""

    path: str
    impl: str
    kvbm_run: Callable[[], Awaitable[Any]]
    kvbm_setup: Callable[[], Awaitable[Any]] | None
    baseline: str
    base_run: Callable[[], Any] | None
    base_setup: Callable[[], Any] | None = None
    s3: bool = True
    after: Callable[[], Awaitable[Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class _Runner:
    """Runs kvbm/baseline pairs and collects rows."""

    def __init__(self, opts: TiersOptions, nbytes: int, server_pid: int | None, echo: Callable[[str], None]):
        self.opts = opts
        self.nbytes = nbytes
        self.server_pid = server_pid
        self.echo = echo
        self.rows: list[dict[str, Any]] = []

    async def pair(
        self,
        path: str,
        impl: str,
        kvbm_run: Callable[[], Awaitable[Any]],
        kvbm_setup: Callable[[], Awaitable[Any]] | None,
        baseline: str,
        base_run: Callable[[], Any] | None,
        base_setup: Callable[[], Any] | None = None,
        *,
        s3: bool = False,
    ) -> dict[str, Any]:
        kv: list[CpuMeter] = []
        bl: list[CpuMeter] = []
        pid = self.server_pid if s3 else None
        for _ in range(self.opts.repeats):
            if kvbm_setup is not None:
                await kvbm_setup()
            with CpuMeter(pid) as m:
                await kvbm_run()
            kv.append(m)
            if base_run is not None:
                if base_setup is not None:
                    await asyncio.to_thread(base_setup)
                with CpuMeter(pid) as b:
                    await asyncio.to_thread(base_run)
                bl.append(b)
        row = self._row(path, impl, kv, baseline, bl, s3)
        self.rows.append(row)
        base = f"{row['baseline_MBps']:.0f}" if row["baseline_MBps"] else "-"
        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
        self.echo(f"  {path:<18} {impl:<22} {row['MBps']:>8.0f} MB/s  baseline {base:>6} MB/s  ratio {ratio}")
        return row

    async def rounds(self, specs: list[_Pair], after_round: Callable[[int], Awaitable[None]] | None = None) -> None:
        """Every pair once per round, ``repeats`` rounds, then ``after_round(r)`` (a peer's pass): each path's
        i-th run sits next to every other path's i-th run, so load drift on a shared machine hits all alike."""
        kv: list[list[CpuMeter]] = [[] for _ in specs]
        bl: list[list[CpuMeter]] = [[] for _ in specs]
        for r in range(self.opts.repeats):
            for i, sp in enumerate(specs):
                pid = self.server_pid if sp.s3 else None
                if sp.kvbm_setup is not None:
                    await sp.kvbm_setup()
                with CpuMeter(pid) as m:
                    await sp.kvbm_run()
                kv[i].append(m)
                if sp.after is not None:
                    await sp.after()
                if sp.base_run is not None:
                    if sp.base_setup is not None:
                        await asyncio.to_thread(sp.base_setup)
                    with CpuMeter(pid) as b:
                        await asyncio.to_thread(sp.base_run)
                    bl[i].append(b)
            if after_round is not None:
                await after_round(r)
        for i, sp in enumerate(specs):
            row = self._row(sp.path, sp.impl, kv[i], sp.baseline, bl[i], sp.s3)
            row.update(sp.extra)
            self.rows.append(row)
            base = f"{row['baseline_MBps']:.0f}" if row["baseline_MBps"] else "-"
            ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
            self.echo(f"  {sp.path:<18} {sp.impl:<22} {row['MBps']:>8.0f} MB/s  baseline {base:>6} MB/s  ratio {ratio}")

    async def baseline_only(self, path: str, baseline: str, base_run: Callable[[], Any]) -> dict[str, Any]:
        """A reference row with no kvbm counterpart (e.g. torch's own copy next to numpy's)."""
        bl: list[CpuMeter] = []
        for _ in range(self.opts.repeats):
            with CpuMeter() as b:
                await asyncio.to_thread(base_run)
            bl.append(b)
        row = self._row(path, "-", [], baseline, bl, False)
        self.rows.append(row)
        self.echo(f"  {path:<18} {'-':<22} {'-':>8}       baseline {row['baseline_MBps']:>6.0f} MB/s  ({baseline})")
        return row

    def _row(self, path: str, impl: str, kv: list[CpuMeter], baseline: str, bl: list[CpuMeter],
             s3: bool) -> dict[str, Any]:
        gb = self.nbytes / 1e9
        mbps = [self.nbytes / m.wall / MB for m in kv]
        bmbps = [self.nbytes / m.wall / MB for m in bl]
        row: dict[str, Any] = {
            "path": path,
            "kvbm": impl,
            "MBps": round(median(mbps), 1) if kv else None,
            "MBps_runs": [round(x, 1) for x in mbps],
            "cpu_s_per_GB": round(median([m.cpu / gb for m in kv]), 3) if kv else None,
            "baseline": baseline,
            "baseline_MBps": round(median(bmbps), 1) if bl else None,
            "baseline_MBps_runs": [round(x, 1) for x in bmbps],
            "baseline_cpu_s_per_GB": round(median([m.cpu / gb for m in bl]), 3) if bl else None,
            "ratio": round(median(mbps) / median(bmbps), 3) if kv and bl and median(bmbps) else None,
            "bytes": self.nbytes,
        }
        if s3 and self.server_pid:
            row["server_cpu_s_per_GB"] = round(median([(m.server_cpu or 0.0) / gb for m in kv]), 3) if kv else None
            row["baseline_server_cpu_s_per_GB"] = (
                round(median([(m.server_cpu or 0.0) / gb for m in bl]), 3) if bl else None)
        return row


async def _memory(opts: TiersOptions, r: _Runner, keys: list[BlockKey], data: list[np.ndarray], work: Path,
                  paths: dict[str, Any]) -> None:
    import torch

    from kvbm.stack import build_stack

    stack = await build_stack(_config(opts, work), tiers=("G1", "G2"), index=False)
    mgr = stack.manager
    paths["memory_mover"] = getattr(mgr.mover, "name", "?")
    paths["G1_device"] = str(mgr.by_name["G1"].describe().get("device"))
    try:
        for k, a in zip(keys, data, strict=True):
            await mgr.put(k, memoryview(a), tier="G2", cascade=False)
        n = len(keys)
        src = np.stack(data)
        dst = np.empty_like(src)
        dst.fill(0)  # fault the pages in before timing

        def np_copy() -> None:
            for i in range(n):
                np.copyto(dst[i], src[i])

        tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)

        def torch_copy() -> None:
            for i in range(n):
                tdst[i].copy_(tsrc[i])

        async def drop_g1() -> None:
            await mgr.delete(keys, tiers=["G1"])

        async def drop_g2() -> None:
            await mgr.delete(keys, tiers=["G2"])

        async def up() -> None:
            got = await mgr.onboard(keys, to="G1")
            assert got == n, f"onboard G2->G1 moved {got}/{n}"

        async def down() -> None:
            await mgr.offload(keys, durable=True)
            assert all(mgr.registry.holds("G2", k) for k in keys), "offload G1->G2 incomplete"

        mover = paths["memory_mover"]
        await r.pair("G2->G1 copy", f"onboard ({mover})", up, drop_g1, "numpy copyto", np_copy)
        await r.pair("G1->G2 copy", f"offload ({mover})", down, drop_g2, "numpy copyto", np_copy)
        await r.baseline_only("host memcpy", "torch copy_ (reference)", torch_copy)
        # exactness check of what landed in G1
        g1 = mgr.by_name["G1"]
        for k, a in zip(keys[:4], data[:4], strict=False):
            assert (await g1.get(k)) == a.tobytes(), "G1 copy differs"
        await mgr.delete(keys)
    finally:
        await stack.close()


def _file_baseline(bdir: Path, data: list[np.ndarray]) -> tuple[Callable[[], None], Callable[[bool], None],
                                                                 Callable[[], None], np.ndarray]:
    bdir.mkdir(parents=True, exist_ok=True)
    files = [str(bdir / f"b{i:05d}.bin") for i in range(len(data))]
    out = np.empty((len(data), data[0].size), dtype=np.uint8)
    out.fill(0)

    def write() -> None:
        for f, a in zip(files, data, strict=True):
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                mv = memoryview(a)
                off = 0
                while off < len(mv):
                    off += os.pwrite(fd, mv[off:], off)
                os.fdatasync(fd)
            finally:
                os.close(fd)

    def drop(cold: bool) -> None:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                if cold:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                else:
                    while os.read(fd, 1 << 22):  # warm it
                        pass
            finally:
                os.close(fd)

    def read() -> None:
        for i, f in enumerate(files):
            fd = os.open(f, os.O_RDONLY)
            try:
                mv = memoryview(out[i])
                got = 0
                while got < len(mv):
                    k = os.preadv(fd, [mv[got:]], got)
                    if k == 0:
                        raise OSError("short read")
                    got += k
            finally:
                os.close(fd)

    return write, drop, read, out


async def _disk(opts: TiersOptions, r: _Runner, keys: list[BlockKey], data: list[np.ndarray], work: Path,
                paths: dict[str, Any]) -> None:
    from kvbm.stack import build_stack

    write, drop, read, _ = _file_baseline(work / "raw-files", data)
    n = len(keys)
    for backend in opts.file_io:
        for mode in opts.disk_modes:
            direct = mode == "direct"
            stack = await build_stack(_config(opts, work, backend=backend, o_direct=direct), tiers=("G2", "G3"),
                                      index=False)
            mgr = stack.manager
            g3 = mgr.by_name["G3"]
            fio = g3.file_io.name  # type: ignore[attr-defined]
            impl = f"{fio}{'+O_DIRECT' if direct else ''}"
            paths.setdefault("file_io", []).append(impl)
            try:
                for k, a in zip(keys, data, strict=True):
                    await mgr.put(k, memoryview(a), tier="G2", cascade=False)

                async def drop_g3(mgr: Any = mgr) -> None:
                    await mgr.delete(keys, tiers=["G3"])

                async def write_g3(mgr: Any = mgr) -> None:
                    got = await mgr.offload(keys, durable=True)
                    assert got == n, f"offload G2->G3 durable {got}/{n}"

                await r.pair("G2->G3 write", f"offload ({impl})", write_g3, drop_g3, "pwrite+fdatasync", write)

                for cold in (True, False):
                    async def prep(mgr: Any = mgr, g3: Any = g3, cold: bool = cold) -> None:
                        await mgr.delete(keys, tiers=["G2"])

                        def pages() -> None:
                            for k in keys:
                                if cold:
                                    g3.drop_page_cache(k)
                                else:
                                    with open(g3.path_for(k), "rb") as f:
                                        while f.read(1 << 22):
                                            pass

                        await asyncio.to_thread(pages)

                    async def read_g3(mgr: Any = mgr) -> None:
                        got = await mgr.onboard(keys, to="G2")
                        assert got == n, f"onboard G3->G2 moved {got}/{n}"

                    label = "cold" if cold else "warm"
                    await r.pair(f"G3->G2 read {label}", f"onboard ({impl})", read_g3, prep, f"pread ({label})",
                                 read, lambda cold=cold: drop(cold))
                g2 = mgr.by_name["G2"]
                for k, a in zip(keys[:4], data[:4], strict=False):
                    assert (await g2.get(k)) == a.tobytes(), "G3 round trip differs"
                r.rows[-1]["io_modes"] = dict(g3.file_io.modes)  # type: ignore[attr-defined]
                await mgr.delete(keys)
            finally:
                await stack.close()


async def _s3(opts: TiersOptions, r: _Runner, keys: list[BlockKey], data: list[np.ndarray], work: Path,
              srv: dict[str, Any], paths: dict[str, Any],
              after_round: Callable[[int], Awaitable[None]] | None = None) -> None:
    """kvbm's S3 rows, each S3Tier client and the aiobotocore reference run once per round (with their boto3
    baselines); ``after_round(r)`` runs after each round (the peer's pass). Every block each kvbm GET brought
    into G2 is compared with what was written, after the timed part, every round."""
    from kvbm.stack import build_stack

    n = len(keys)
    bodies = [a.tobytes() for a in data]
    raw_prefix = f"{srv['prefix']}/raw"
    cli = boto3_client(srv, pool=max(16, opts.boto3_threads * 2))
    pool = ThreadPoolExecutor(opts.boto3_threads, thread_name_prefix="bench-boto3")
    sink: list[bytes | None] = [None] * n
    thr = opts.boto3_threads

    def put_all() -> None:
        list(pool.map(lambda i: cli.put_object(Bucket=srv["bucket"], Key=f"{raw_prefix}/{i}", Body=bodies[i]),
                      range(n)))

    def get_one(i: int) -> None:
        sink[i] = cli.get_object(Bucket=srv["bucket"], Key=f"{raw_prefix}/{i}")["Body"].read()

    def get_all() -> None:
        list(pool.map(get_one, range(n)))

    def del_all() -> None:
        cli.delete_objects(Bucket=srv["bucket"], Delete={"Objects": [{"Key": f"{raw_prefix}/{i}"} for i in range(n)],
                                                         "Quiet": True})

    async def aio_reference(es: contextlib.AsyncExitStack) -> list[_Pair]:
        """The S3Tier's own library without kvbm: aiobotocore put/get, same config, same concurrency."""
        import aiobotocore.session
        from aiobotocore.config import AioConfig

        cfg = AioConfig(max_pool_connections=max(10, opts.s3_concurrency * 2), s3={"addressing_style": "path"},
                        request_checksum_calculation="when_required", response_checksum_validation="when_required")
        sem = asyncio.Semaphore(opts.s3_concurrency)
        sess = aiobotocore.session.get_session()
        c = await es.enter_async_context(sess.create_client(
            "s3", endpoint_url=srv["endpoint"], region_name="us-east-1", config=cfg,
            aws_access_key_id=srv["access_key"], aws_secret_access_key=srv["secret_key"]))

        async def put(i: int) -> None:
            async with sem:
                await c.put_object(Bucket=srv["bucket"], Key=f"{srv['prefix']}/aio/{i}", Body=bodies[i])

        async def get(i: int) -> None:
            async with sem:
                resp = await c.get_object(Bucket=srv["bucket"], Key=f"{srv['prefix']}/aio/{i}")
                async with resp["Body"] as stream:
                    sink[i] = await stream.read()

        async def put_all_aio() -> None:
            await asyncio.gather(*(put(i) for i in range(n)))

        async def get_all_aio() -> None:
            await asyncio.gather(*(get(i) for i in range(n)))

        c_ = opts.s3_concurrency
        return [
            _Pair("G2->G4 PUT", f"aiobotocore put_object x{c_} (no kvbm)", put_all_aio, None,
                  f"boto3 put_object x{thr}", put_all, del_all),
            _Pair("G4->G2 GET", f"aiobotocore get_object x{c_} (no kvbm)", get_all_aio, None,
                  f"boto3 get_object x{thr}", get_all),
        ]

    async def tier_pairs(mgr: Any, client: str) -> list[_Pair]:
        for k, a in zip(keys, data, strict=True):
            await mgr.put(k, memoryview(a), tier="G2", cascade=False)

        async def drop_g4() -> None:
            await mgr.delete(keys, tiers=["G4"])

        async def put_g4() -> None:
            got = await mgr.offload(keys, durable=True)
            assert got == n, f"offload G2->G4 durable {got}/{n} (see the S3 tier's stats: shed/errors)"

        async def drop_g2() -> None:
            await mgr.delete(keys, tiers=["G2"])

        async def get_g4() -> None:
            got = await mgr.onboard(keys, to="G2")
            assert got == n, f"onboard G4->G2 moved {got}/{n}"

        async def compare() -> None:
            g2 = mgr.by_name["G2"]

            def same() -> list[int]:
                bad = []
                for i, (k, a) in enumerate(zip(keys, data, strict=True)):
                    with g2.hold(k) as t:
                        if t is None or not np.array_equal(t.numpy(), a):
                            bad.append(i)
                return bad

            bad = await asyncio.to_thread(same)
            assert not bad, f"G4 {client}: {len(bad)} of {n} blocks read back different (first: {bad[0]})"

        depth = {"s3_in_flight": opts.s3_concurrency}
        return [
            _Pair("G2->G4 PUT", f"offload (S3Tier {client})", put_g4, drop_g4, f"boto3 put_object x{thr}", put_all,
                  del_all, extra=depth),
            _Pair("G4->G2 GET", f"onboard (S3Tier {client})", get_g4, drop_g2, f"boto3 get_object x{thr}", get_all,
                  after=compare, extra=depth),
        ]

    try:
        put_all()  # warm the connections and the bucket's volumes once (not timed)
        async with contextlib.AsyncExitStack() as es:
            specs: list[_Pair] = await aio_reference(es) if opts.s3_reference else []
            stacks: list[tuple[str, Any]] = []
            for client in opts.s3_clients:
                prefix = f"{srv['prefix']}/{client}"
                try:
                    stack = await build_stack(_config(opts, work, s3=srv, client=client, prefix=prefix),
                                              tiers=("G2", "G4"), index=False)
                except Exception as e:  # e.g. NIXL OBJ unavailable here
                    r.echo(f"  G4 {client}: skipped ({type(e).__name__}: {e})")
                    paths.setdefault("skipped", []).append(f"G4 {client}: {type(e).__name__}: {e}")
                    continue
                es.push_async_callback(stack.close)
                paths.setdefault("s3_clients", []).append(client)
                stacks.append((client, stack.manager))
                specs += await tier_pairs(stack.manager, client)
            await r.rounds(specs, after_round)
            for client, mgr in stacks:
                row = next(x for x in reversed(r.rows) if x["kvbm"] == f"onboard (S3Tier {client})")
                row["tier_stats"] = mgr.by_name["G4"].describe()["stats"]
                await mgr.delete(keys)
    finally:
        with contextlib.suppress(Exception):
            del_all()
        pool.shutdown(wait=True)
        cli.close()


def _peer_rows(r: _Runner, peer: dict[str, Any]) -> list[dict[str, Any]]:
    """LMCache's medians next to each kvbm S3Tier row of the same path; ratio = kvbm / LMCache."""
    gb = r.nbytes / 1e9
    conns = max((p.get("conns") or 0) for p in peer["passes"]) if peer["passes"] else 0
    # LMCache puts/gets every block at once (asyncio.gather); awscrt caps the connections it opens.
    name = f"LMCache {peer['version']} {peer['client']}, {peer['io_threads']} io threads, <= {conns} conns"
    out: list[dict[str, Any]] = []
    for path, op in (("G2->G4 PUT", "put"), ("G4->G2 GET", "get")):
        runs = [p[op] for p in peer["passes"]]
        mbps = median([r.nbytes / x["wall"] / MB for x in runs])
        cpu = median([x["cpu"] / gb for x in runs])
        srv = [x["server_cpu"] / gb for x in runs if x.get("server_cpu") is not None]
        mine = [row for row in r.rows if row["path"] == path and "S3Tier" in row["kvbm"] and not row.get("peer")]
        for row in mine or [None]:
            out.append({
                "path": path, "kvbm": row["kvbm"] if row else "-", "MBps": row["MBps"] if row else None,
                "MBps_runs": row["MBps_runs"] if row else [], "cpu_s_per_GB": row["cpu_s_per_GB"] if row else None,
                "baseline": name, "baseline_MBps": round(mbps, 1),
                "baseline_MBps_runs": [round(r.nbytes / x["wall"] / MB, 1) for x in runs],
                "baseline_cpu_s_per_GB": round(cpu, 3),
                "ratio": round(row["MBps"] / mbps, 3) if row and row["MBps"] and mbps else None,
                # Round i's kvbm run and LMCache pass ran back to back: their ratio pairs like with like.
                "ratio_rounds": [round(a / (r.nbytes / x["wall"] / MB), 3)
                                 for a, x in zip(row["MBps_runs"], runs, strict=False)] if row else [],
                "bytes": r.nbytes, "peer": "lmcache", "peer_in_flight": conns,
                "s3_in_flight": row.get("s3_in_flight") if row else None,
                "server_cpu_s_per_GB": row.get("server_cpu_s_per_GB") if row else None,
                "baseline_server_cpu_s_per_GB": round(median(srv), 3) if srv else None,
            })
    return out


class _Peer:
    """The LMCache peer: one pass after each round of kvbm's S3 rows (:meth:`_Runner.rounds`), so load drift on
    a shared machine hits both alike."""

    def __init__(self, opts: TiersOptions, srv: dict[str, Any], report: dict[str, Any],
                 echo: Callable[[str], None]) -> None:
        self.opts, self.srv, self.report, self.echo = opts, srv, report, echo
        self.proc: Any = None

    def _fail(self, e: Exception) -> None:
        self.report["peer_error"] = str(e)  # the kvbm rows stand; the CLI reports this and exits non-zero
        self.echo(f"  peer failed: {e}")
        self.close()

    async def start(self) -> None:
        from kvbm.bench.peer import PeerError, PeerProcess

        assert self.opts.peer_python
        self.echo(f"  peer: starting LMCache's S3 connector under {self.opts.peer_python} ...")
        proc = PeerProcess(self.opts.peer_python, srv=self.srv, domain=self.opts.peer_domain,
                           blocks=self.opts.blocks, block_bytes=self.opts.block_bytes,
                           io_threads=self.opts.peer_io_threads)
        try:
            self.proc = await asyncio.to_thread(proc.start)
        except PeerError as e:
            proc.close()
            self._fail(e)

    async def after_round(self, r: int) -> None:
        from kvbm.bench.peer import PeerError

        if self.proc is None:
            return
        try:
            got = await asyncio.to_thread(self.proc.run_pass)
        except PeerError as e:
            self._fail(e)
            return
        nb = self.opts.blocks * self.opts.block_bytes
        self.echo(f"  peer pass {r + 1}: LMCache PUT {nb / got['put']['wall'] / MB:.0f} MB/s, "
                  f"GET {nb / got['get']['wall'] / MB:.0f} MB/s ({got['conns']} connections at most)")

    def rows(self, r: _Runner, paths: dict[str, Any]) -> None:
        if self.proc is None or len(self.proc.passes) < self.opts.repeats:
            return
        peer = {**self.proc.meta, "passes": self.proc.passes}
        paths["peer"] = peer
        for row in _peer_rows(r, peer):
            r.rows.append(row)
            ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
            rounds = " / ".join(f"{x:.2f}" for x in row["ratio_rounds"])
            self.echo(f"  {row['path']:<18} {row['kvbm']:<22} vs {row['baseline']}: {row['baseline_MBps']:.0f} MB/s,"
                      f" {row['baseline_cpu_s_per_GB']:.2f} CPU-s/GB; kvbm/LMCache {ratio} (rounds: {rounds})")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc = None


async def run_tiers(opts: TiersOptions, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the tier benchmark; returns the report (machine, options, rows)."""
    t_start = time.perf_counter()
    n, size = opts.blocks, opts.block_bytes
    ns = _namespace()
    keys = [BlockKey(ns, secrets.token_bytes(16)) for _ in range(n)]
    data = [rnd_bytes(size, i) for i in range(n)]
    nbytes = n * size
    paths: dict[str, Any] = {}
    report: dict[str, Any] = {"bench": "tiers", "machine": machine(), "options": asdict(opts), "paths": paths}
    echo(f"kvbm bench tiers: {n} x {size / MiB:g} MiB blocks ({nbytes / MB:.0f} MB), median of {opts.repeats}")
    with temp_dir("kvbm-bench-", opts.workdir) as work:
        server_pid: int | None = None
        with contextlib.ExitStack() as es:
            srv = None
            if "s3" in opts.groups:
                echo("  starting S3 endpoint ..." if not opts.s3_endpoint else f"  S3 endpoint {opts.s3_endpoint}")
                srv = es.enter_context(s3_server(work, endpoint=opts.s3_endpoint, access_key=opts.s3_access_key,
                                                 secret_key=opts.s3_secret_key, bucket=opts.s3_bucket,
                                                 domain=opts.peer_domain if opts.peer_python else None))
                server_pid = srv["pid"]
                paths["s3_endpoint"] = {"endpoint": srv["endpoint"], "embedded": srv["embedded"],
                                        "bucket": srv["bucket"], "prefix": srv["prefix"],
                                        "server_cpu_measured": bool(server_pid)}
            r = _Runner(opts, nbytes, server_pid, echo)
            try:
                if "memory" in opts.groups:
                    await _memory(opts, r, keys, data, work, paths)
                if "disk" in opts.groups:
                    await _disk(opts, r, keys, data, work, paths)
                if srv is not None:
                    peer = _Peer(opts, srv, report, echo) if opts.peer_python else None
                    try:
                        if peer is not None:
                            await peer.start()
                        await _s3(opts, r, keys, data, work, srv, paths, peer.after_round if peer else None)
                        if peer is not None:
                            peer.rows(r, paths)
                    finally:
                        if peer is not None:
                            peer.close()
            finally:
                if srv is not None:
                    with contextlib.suppress(Exception):
                        delete_prefix(srv, srv["prefix"])
        report["rows"] = r.rows
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    report["load_avg_end"] = load_avg()
    return report
