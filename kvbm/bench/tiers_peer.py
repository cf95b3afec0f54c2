"""``kvbm bench tiers``'s LMCache peer: its S3 connector's pass after each round of kvbm's S3 rows, and its rows
next to kvbm's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvbm.bench.common import MB, median
from kvbm.bench.paired import PairRunner
from kvbm.bench.tiers_options import TiersOptions


def peer_rows(r: PairRunner, peer: dict[str, Any]) -> list[dict[str, Any]]:
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


class LmcachePeer:
    """The LMCache peer: one pass after each round of kvbm's S3 rows (:meth:`PairRunner.rounds`), so load drift on
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

    def rows(self, r: PairRunner, paths: dict[str, Any]) -> None:
        if self.proc is None or len(self.proc.passes) < self.opts.repeats:
            return
        peer = {**self.proc.meta, "passes": self.proc.passes}
        paths["peer"] = peer
        for row in peer_rows(r, peer):
            r.rows.append(row)
            ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
            rounds = " / ".join(f"{x:.2f}" for x in row["ratio_rounds"])
            self.echo(f"  {row['path']:<18} {row['kvbm']:<22} vs {row['baseline']}: {row['baseline_MBps']:.0f} MB/s,"
                      f" {row['baseline_cpu_s_per_GB']:.2f} CPU-s/GB; kvbm/LMCache {ratio} (rounds: {rounds})")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc = None
