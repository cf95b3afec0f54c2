"""Run one schedule (:mod:`kvbm.chaos.schedule`) against a real ``kvbm serve`` and check the invariants
(:mod:`kvbm.chaos.invariants`); :func:`campaign` runs many seeds and sums them up.

The schedule's world (:mod:`kvbm.chaos.world`: the daemon, its G3 tmpfs, the S3 fault proxy, three tenants'
clients) takes one op per step: workload ops here, faults (:mod:`kvbm.chaos.faults`: S3 fault rates, a full or
read-only disk, for some steps; an S3 outage for some seconds; signals) and hostile clients
(:mod:`kvbm.chaos.hostile`). After every step the daemon must be alive and answer a Ping; at the end every fault
is healed and the bucket is read directly (not through the proxy) for the blocks acked durable and those purged.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.chaos.faults import Faults
from kvbm.chaos.hostile import Hostile
from kvbm.chaos.invariants import INVARIANTS, Model
from kvbm.chaos.schedule import TENANTS, Op, Schedule, layout_of, plan
from kvbm.chaos.world import UNREADABLE, S3Target, ScheduleResult, World, bump, tmpfs_available
from kvbm.client import DaemonError, DaemonUnavailable, WorkerClient

__all__ = ["S3Target", "ScheduleResult", "campaign", "run_schedule", "tmpfs_available"]

DURABLE_WAIT_S = 30.0  # how long the end check waits for acked blocks to reach the bucket once S3 is back


class Harness:
    """One schedule: its world, the workload ops, the faults and hostile clients, the checks after each step
    and at the end."""

    def __init__(self, schedule: Schedule, s3: S3Target, root: Path) -> None:
        self.sched = schedule
        self.world = World(schedule, s3, root)
        self.model = Model(schedule.seed)
        self.res = ScheduleResult(schedule.seed, schedule.index_bucket)
        self.faults = Faults(self.world, self.model, self.res)
        self.hostile = Hostile(self.world, self.model, self.res)

    def _handler(self, kind: str) -> Callable[[Op], None]:
        for part in (self, self.faults, self.hostile):
            if (fn := getattr(part, f"op_{kind}", None)) is not None:
                return fn
        raise ValueError(f"no handler for op kind {kind!r}")

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or the refusal/outage it raised (counted; a refusal must name its cause)."""
        try:
            return fn()
        except DaemonError as e:
            bump(self.res.refusals, e.code)
            self.model.check_refusal(e.code, e.message, what)
            return e
        except DaemonUnavailable as e:
            self.res.unavailable += 1
            return e

    # -- the run ----------------------------------------------------------------------------------------------
    def run(self) -> ScheduleResult:
        t0 = time.monotonic()
        try:
            self.world.setup()
            for i, op in enumerate(self.sched.ops):
                self.model.step = i
                self.res.trace.append(op.as_dict())
                bump(self.res.ops, op.kind)
                try:
                    self._handler(op.kind)(op)
                except Exception as e:  # the harness's own failure: reported, the schedule goes on
                    self.res.harness_errors.append(f"step {i} {op.kind}: {type(e).__name__}: {e} "
                                                   f"{traceback.format_exc(limit=3)[-600:]}")
                self.faults.heal_due(i)
                self.check_alive()
            self.finish()
        except Exception as e:
            self.res.harness_errors.append(f"{type(e).__name__}: {e} {traceback.format_exc(limit=4)[-800:]}")
        finally:
            try:
                if not self.world.teardown():
                    self.model.violate("daemon_alive", "did not stop within 15 s of SIGTERM", step=-1)
            finally:
                self.res.seconds = round(time.monotonic() - t0, 2)
                self.res.violations = [v.as_dict() for v in self.model.violations]
                self.res.faults |= {f"s3_{k}": v for k, v in self.world.proxy.counts.injected.items()}
        return self.res

    def check_alive(self) -> None:
        d = self.world.daemon
        assert d is not None
        if not d.alive():
            self.model.violate("daemon_alive", f"the daemon exited (code {d.exit_code()}): {d.tail(600)}")
            self.faults.restart("its exit")
            return
        with WorkerClient(self.world.endpoint, timeout_s=5.0) as mon:
            try:
                mon.ping()
            except DaemonUnavailable:
                self.model.violate("daemon_alive", "no Pong within 5 s")

    # -- workload ops -----------------------------------------------------------------------------------------
    def op_store(self, op: Op) -> None:
        w = self.world
        ks = w.keys(op.tenant, op.keys)
        bufs = [np.frombuffer(w.content(k), np.uint8) for k in ks]
        self.model.purged.difference_update(ks)  # whatever the outcome, the blocks may be there again
        r = self.call("store", lambda: w.client(op.tenant, op.session).store(ks, bufs, durable=op.durable))
        if isinstance(r, p.Ack):
            self.model.stored(ks, durable=op.durable and r.durable == len(ks))

    def op_load(self, op: Op) -> None:
        w = self.world
        ks = w.keys(op.tenant, op.keys)
        outs = [np.zeros(w.nbytes, np.uint8) for _ in ks]
        n = self.call("load", lambda: w.client(op.tenant, op.session).load(ks, outs))
        if isinstance(n, int):
            self.model.check_load(ks, [o.tobytes() for o in outs], [w.content(k) for k in ks], n)

    def op_lookup(self, op: Op) -> None:
        ks = self.world.keys(op.tenant, op.keys)
        r = self.call("lookup", lambda: self.world.client(op.tenant, op.session).lookup(ks))
        if isinstance(r, p.LookupReply):
            self.model.check_lookup(ks, r.matched, r.tiers)

    def op_purge(self, op: Op) -> None:
        ks = self.world.keys(op.tenant, op.keys)
        r = self.call("purge", lambda: self.world.admin_client().evict(ks))
        if isinstance(r, p.Evicted) and not r.skipped:
            self.model.purge(ks)
        else:  # refused, unanswered or partly skipped (the reply names no keys): each block may be either way
            self.model.purge_undetermined(ks)

    def op_register(self, op: Op) -> None:
        """An engine restarts: it unregisters and registers again."""
        self.world.drop_client(op.tenant, op.session)
        self.call("register", lambda: self.world.client(op.tenant, op.session))

    def op_cross_access(self, op: Op) -> None:
        other = TENANTS[(TENANTS.index(op.tenant) + 1) % len(TENANTS)]
        ons = layout_of(other).namespace
        hs = [k.hash for k in self.world.keys(other, op.keys)]
        c = self.world.client(op.tenant, op.session)
        msg: Any
        if op.count == 0:
            msg, want = p.Lookup(namespace=ons, hashes=hs), p.LookupReply
        elif op.count == 1:
            msg, want = p.Onboard(namespace=ons, hashes=hs), p.Onboarded
        else:
            msg, want = p.PrepareStore(namespace=ons, hashes=hs, nbytes=self.world.nbytes), p.Slots
        r = self.call("cross_access", lambda: c.request(msg, want))
        if isinstance(r, want):
            self.model.violate("cross_tenant", f"tenant {op.tenant} was answered {type(r).__name__} to a "
                                               f"{type(msg).__name__} naming tenant {other}'s namespace {ons}")
            if isinstance(r, p.Slots):
                self.call("abort", lambda: c.request(p.CommitStore(namespace=ons, hashes=hs, ok=False), p.Ack))
            elif isinstance(r, p.Onboarded):
                self.call("release", lambda: c.request(p.Release(namespace=ons, hashes=hs), p.Released))
        elif isinstance(r, DaemonError) and r.code != p.E_FORBIDDEN:
            self.model.violate("cross_tenant", f"{type(msg).__name__} naming another tenant's namespace was "
                                               f"refused {r.code!r}, not forbidden: {r.message[:120]}")

    def op_cross_register(self, op: Op) -> None:
        """Tenant b (models ``shared/q*``) asks for tenant a's model and shape; if let in, it writes its own bytes
        under keys of a's that a may store or load later."""
        w = self.world
        c = WorkerClient(w.endpoint, timeout_s=4.0, tenant_token=w.token_of("b"))
        try:
            r = self.call("cross_register", lambda: c.register(layout_of("a"), worker_id=f"x-b{op.session}",
                                                               engine_id=f"x-b{op.session}"))
            if not isinstance(r, p.Registered):
                return
            self.model.violate("cross_tenant", f"tenant b registered tenant a's namespace {r.namespace} "
                                               f"(a lists it in namespaces)")
            ks = w.keys("a", op.keys)
            forged = [np.frombuffer(bytes(255 - x for x in w.content(k)[:64]) * (w.nbytes // 64), np.uint8)
                      for k in ks]
            self.model.forged.update(ks)
            self.call("forged store", lambda: c.store(ks, forged))
        finally:
            c.close()

    # -- the end --------------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Heal every fault, then: acked-durable blocks are in the bucket with their bytes, purged ones are not."""
        self.model.step = -1
        self.faults.heal_all()
        if self.sched.final == "kill":
            self.faults.op_kill(Op("kill"))
        elif self.sched.final == "restart":
            self.faults.op_restart(Op("restart"))
        self.check_alive()
        w = self.world
        want = sorted(self.model.durable, key=lambda k: (k.namespace, k.hash))
        gone = sorted(self.model.purged, key=lambda k: (k.namespace, k.hash))
        t_end = time.monotonic()
        deadline = t_end + DURABLE_WAIT_S
        missing: list[BlockKey] = want
        while True:
            got = w.in_bucket(missing)
            missing = [k for k in missing if got[k] != w.content(k)]
            # An object holding other bytes will not change (a key's bytes are written once): no need to wait.
            if all(isinstance(got[k], bytes) for k in missing) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        self.res.end_wait_s = round(time.monotonic() - t_end, 1)
        unreadable = [k for k in missing if got[k] is UNREADABLE]
        if unreadable:  # the bucket did not answer for them: not a loss the check can name, but the check failed
            self.res.harness_errors.append(f"the bucket could not be read for {len(unreadable)} acked blocks "
                                           f"(GET and HEAD failed for {DURABLE_WAIT_S:g} s): {unreadable[:3]}")
        lost = [k for k in missing if got[k] is not UNREADABLE]
        evidence = w.evidence(lost) if lost else ""
        for k in lost:
            what = "missing" if got[k] is None else "holding other bytes"
            if k in self.model.forged:
                what += " (a key tenant b forged through the cross-tenant Register)"
            self.model.violate("acked_lost", f"{k} acked durable at step {self.model.acked_at.get(k, '?')}, {what} "
                                             f"in the bucket once S3 was back (waited up to {DURABLE_WAIT_S:g} s; "
                                             f"index_bucket {self.sched.index_bucket})", evidence=evidence)
        back = w.in_bucket(gone)
        for k in gone:
            if isinstance(back[k], bytes):  # (one the bucket could not be asked about is not counted)
                self.model.violate("purge_undone", f"{k} purged (Evict answered) but in the bucket at the end")


def run_schedule(seed: int, s3: S3Target, root: Path, *, steps: int = 28) -> ScheduleResult:
    return Harness(plan(seed, steps), s3, root).run()


def campaign(seeds: list[int], s3: S3Target, root: Path, *, steps: int = 28,
             echo: Callable[[str], None] = lambda _s: None, max_seconds: float = 0.0,
             progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run each seed's schedule; the report: ops and faults by kind, violations by invariant with their seeds.
    With ``max_seconds`` no schedule starts after that long (the report says how many ran); ``progress`` gets
    the report so far after each schedule (a long campaign's JSON is kept up to date)."""
    t0 = time.monotonic()
    report: dict[str, Any] = {"schedules": 0, "steps_per_schedule": steps, "ops": {}, "faults": {}, "refusals": {},
                              "unavailable": 0, "violations": {inv: {"count": 0, "seeds": []} for inv in INVARIANTS},
                              "harness_errors": [], "runs": []}
    for seed in seeds:
        if max_seconds and time.monotonic() - t0 > max_seconds:
            echo(f"time budget ({max_seconds:g} s) spent: {report['schedules']} of {len(seeds)} schedules ran")
            break
        r = run_schedule(seed, s3, root, steps=steps)
        report["schedules"] += 1
        report["unavailable"] += r.unavailable
        for key in ("ops", "faults", "refusals"):
            for k, v in getattr(r, key).items():
                bump(report[key], k, v)
        for v in r.violations:
            slot = report["violations"][v["invariant"]]
            slot["count"] += 1
            if seed not in slot["seeds"]:
                slot["seeds"].append(seed)
        report["harness_errors"] += [f"seed {seed}: {e}" for e in r.harness_errors]
        report["runs"].append({"seed": seed, "index_bucket": r.index_bucket, "final": plan(seed, steps).final,
                               "seconds": r.seconds, "end_wait_s": r.end_wait_s, "ops": r.ops, "faults": r.faults,
                               "refusals": r.refusals,
                               "violations": r.violations, "harness_errors": len(r.harness_errors),
                               "trace": r.trace})
        bad = sorted({v["invariant"] for v in r.violations})
        echo(f"seed {seed:5d} {r.index_bucket:10} {r.seconds:6.1f}s  "
             f"{'violations: ' + ', '.join(bad) if bad else 'ok'}"
             f"{'  harness errors: ' + str(len(r.harness_errors)) if r.harness_errors else ''}")
        _totals(report, t0)
        if progress is not None:
            progress(report)
    return _totals(report, t0)


def _totals(report: dict[str, Any], t0: float) -> dict[str, Any]:
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["violating_seeds"] = sorted({s for v in report["violations"].values() for s in v["seeds"]})
    return report
