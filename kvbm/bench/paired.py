"""A kvbm path timed next to its baseline (the same bytes moved by the plainest code that does the job): repeats
interleaved, or whole rounds of every path, so load drift on a shared machine hits both alike; one row per path
with median MB/s, CPU-s/GB (and the S3 server's) and the ratio."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvbm.bench.common import MB, CpuMeter, median


@dataclass
class Pair:
    """One kvbm path and its baseline, for :meth:`PairRunner.rounds`; ``after`` runs untimed after each kvbm run
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


class PairRunner:
    """Runs kvbm/baseline pairs and collects rows."""

    def __init__(self, repeats: int, nbytes: int, server_pid: int | None, echo: Callable[[str], None]):
        self.repeats = repeats
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
        for _ in range(self.repeats):
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

    async def rounds(self, specs: list[Pair], after_round: Callable[[int], Awaitable[None]] | None = None) -> None:
        """Every pair once per round, ``repeats`` rounds, then ``after_round(r)`` (a peer's pass): each path's
        i-th run sits next to every other path's i-th run, so load drift on a shared machine hits all alike."""
        kv: list[list[CpuMeter]] = [[] for _ in specs]
        bl: list[list[CpuMeter]] = [[] for _ in specs]
        for r in range(self.repeats):
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
        for _ in range(self.repeats):
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
