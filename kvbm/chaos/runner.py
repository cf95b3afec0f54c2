"""Run one schedule (:mod:`kvbm.chaos.schedule`) against a real ``kvbm serve`` and check the invariants
(:mod:`kvbm.chaos.invariants`); :func:`campaign` runs many seeds and sums them up.

The daemon (G2 shared memory, G3 on a size-limited tmpfs where this machine lets root mount one, G4 through
:class:`~kvbm.chaos.proxy.FaultProxy` to a SeaweedFS) serves three tenants (:func:`tenants_config`). Each step
runs one op; faults last for some steps (S3 fault rates, a full or read-only disk) or some seconds (an S3
outage). After every step the daemon must be alive and answer a Ping; at the end every fault is healed and the
bucket is read directly (not through the proxy) for the blocks acked durable and those purged.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbm import protocol as p
from kvbm.bench.common import delete_prefix
from kvbm.blocks import BlockKey
from kvbm.chaos import fuzz
from kvbm.chaos.daemon import DaemonProc
from kvbm.chaos.invariants import INVARIANTS, Model
from kvbm.chaos.proxy import FaultProxy, FaultRates
from kvbm.chaos.schedule import SLOT_BYTES, TENANTS, Op, Schedule, block_hash, content, layout_of, plan, tenants_config
from kvbm.client import DaemonError, DaemonUnavailable, WorkerClient
from kvbm.config import S3Config
from kvbm.tiers.s3 import make_s3_tier

JOURNAL = ".kvbm-owed.journal"
DISK_FS_BYTES = 6 * 1024 * 1024  # the tmpfs under G3 (the tier is told 4 MiB: a filler file makes it ENOSPC)
DURABLE_WAIT_S = 30.0  # how long the end check waits for acked blocks to reach the bucket once S3 is back


@dataclass
class S3Target:
    """The real S3 endpoint (SeaweedFS) the proxy forwards to, and its bucket and credentials."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str

    def hostport(self) -> tuple[str, int]:
        host, port = self.endpoint.split("//", 1)[1].rsplit(":", 1)
        return host, int(port)


@dataclass
class ScheduleResult:
    seed: int
    index_bucket: str
    seconds: float = 0.0
    ops: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    unavailable: int = 0  # requests that got no answer in time (expected while the daemon is stopped or killed)
    violations: list[dict[str, Any]] = field(default_factory=list)
    harness_errors: list[str] = field(default_factory=list)
    trace: list[dict[str, Any]] = field(default_factory=list)  # the ops run (the replay check compares them)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _bump(d: dict[str, int], k: str, n: int = 1) -> None:
    d[k] = d.get(k, 0) + n


def _sh(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


def tmpfs_available() -> tuple[bool, str]:
    """Whether this process may mount a size-limited tmpfs (the disk faults need one), and why not."""
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True, text=True)
        if r.returncode:
            return False, f"cannot mount a tmpfs here: {r.stderr.strip()}"
        _sh("umount", d)
    return True, ""


class Harness:
    """One schedule's daemon, proxy, disk and clients."""

    def __init__(self, schedule: Schedule, s3: S3Target, root: Path) -> None:
        self.sched = schedule
        self.seed = schedule.seed
        self.s3 = s3
        self.tmp = Path(tempfile.mkdtemp(prefix=f"s{schedule.seed}-", dir=root))
        self.disk = self.tmp / "g3"
        self.disk.mkdir()
        self.prefix = f"chaos-{schedule.seed}-{self.tmp.name[-6:].lower().replace('_', 'x')}"
        self.model = Model(schedule.seed)
        self.res = ScheduleResult(schedule.seed, schedule.index_bucket)
        self.proxy = FaultProxy(s3.hostport(), seed=schedule.seed)
        self.tmpfs = False
        self.clients: dict[tuple[str, int], WorkerClient] = {}
        self.admin: WorkerClient | None = None
        self.pending: list[tuple[int, str, Callable[[], None]]] = []  # (step due, what, heal)
        self.daemon: DaemonProc | None = None
        self.nbytes = layout_of("a").block_nbytes

    # -- set-up -----------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {
            "block_bytes": SLOT_BYTES, "device": {"enabled": False}, "host": {"capacity": "2MiB", "pin": False},
            "disk": {"dir": str(self.disk), "capacity": "4MiB", "fsync": False, "o_direct": False},
            "s3": {"endpoint": self.proxy.endpoint, "bucket": self.s3.bucket, "prefix": self.prefix,
                   "access_key": self.s3.access_key, "secret_key": self.s3.secret_key, "max_retries": 1,
                   "connect_timeout_s": 0.5, "read_timeout_s": 3.0, "breaker_failures": 3, "breaker_reset_s": 1.0},
            "embedded_s3": {"enabled": False}, "transfer": {"backend": "plain"},
            "daemon": {"endpoint": f"ipc://{self.tmp}/d.sock", "events_endpoint": f"ipc://{self.tmp}/ev.sock",
                       "metrics_port": 0, "admin_token_file": str(self.tmp / "admin.token"),
                       "index_bucket": self.sched.index_bucket, "barrier_timeout_s": 1.0,
                       "worker_timeout_s": 30.0, "tenants": tenants_config(str(self.tmp))},
        }

    def setup(self) -> None:
        # A size-limited filesystem under G3 and the owed journal, where root may mount one.
        self.tmpfs = _sh("mount", "-t", "tmpfs", "-o", f"size={DISK_FS_BYTES}", "tmpfs", str(self.disk))
        self.proxy.start()
        self.daemon = DaemonProc(self.tmp, self.config())
        self.daemon.start()

    def teardown(self) -> None:
        for c in [*self.clients.values(), *([self.admin] if self.admin else [])]:
            with contextlib.suppress(Exception):
                c.close()
        self.clients.clear()
        if self.daemon is not None and not self.daemon.stop():
            self.model.violate("daemon_alive", "did not stop within 15 s of SIGTERM", step=-1)
        self.proxy.stop()
        with contextlib.suppress(Exception):  # the schedule's objects leave the bucket (a shared one, in the suite)
            delete_prefix({"endpoint": self.s3.endpoint, "bucket": self.s3.bucket, "access_key": self.s3.access_key,
                           "secret_key": self.s3.secret_key}, self.prefix + "/")
        if self.tmpfs:
            _sh("chattr", "-R", "-f", "-i", str(self.disk))
            _sh("umount", "-l", str(self.disk))
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- clients --------------------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        assert self.daemon is not None
        return str(self.daemon.info.get("endpoint") or f"ipc://{self.tmp}/d.sock")

    def token_of(self, tenant: str) -> str:
        return (self.tmp / f"{tenant}.token").read_text().strip()

    def client(self, tenant: str, session: int) -> WorkerClient:
        c = self.clients.get((tenant, session))
        if c is None or not c.token:
            c = c or WorkerClient(self.endpoint, timeout_s=4.0, tenant_token=self.token_of(tenant))
            self.clients[(tenant, session)] = c
            c.register(layout_of(tenant), worker_id=f"{tenant}{session}", engine_id=f"{tenant}-e{session}")
        return c

    def admin_client(self) -> WorkerClient:
        if self.admin is None or not self.admin.token:
            token = (self.tmp / "admin.token").read_text().strip()
            self.admin = self.admin or WorkerClient(self.endpoint, timeout_s=4.0, admin_token=token)
            self.admin.register(layout_of("c"), worker_id="admin", engine_id="admin")
        return self.admin

    def keys(self, tenant: str, idx: list[int]) -> list[BlockKey]:
        ns = layout_of(tenant).namespace
        return [BlockKey(ns, block_hash(self.seed, tenant, i)) for i in idx]

    def content(self, k: BlockKey) -> bytes:
        return content(k.namespace, k.hash, self.seed, self.nbytes)

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or the refusal/outage it raised (counted; a refusal must name its cause)."""
        try:
            return fn()
        except DaemonError as e:
            _bump(self.res.refusals, e.code)
            self.model.check_refusal(e.code, e.message, what)
            return e
        except DaemonUnavailable as e:
            self.res.unavailable += 1
            return e

    # -- the run ----------------------------------------------------------------------------------------------
    def run(self) -> ScheduleResult:
        t0 = time.monotonic()
        try:
            self.setup()
            for i, op in enumerate(self.sched.ops):
                self.model.step = i
                self.res.trace.append(op.as_dict())
                _bump(self.res.ops, op.kind)
                try:
                    getattr(self, f"op_{op.kind}")(op)
                except Exception as e:  # the harness's own failure: reported, the schedule goes on
                    self.res.harness_errors.append(f"step {i} {op.kind}: {type(e).__name__}: {e} "
                                                   f"{traceback.format_exc(limit=3)[-600:]}")
                self.heal_due(i)
                self.check_alive()
            self.finish()
        except Exception as e:
            self.res.harness_errors.append(f"{type(e).__name__}: {e} {traceback.format_exc(limit=4)[-800:]}")
        finally:
            try:
                self.teardown()
            finally:
                self.res.seconds = round(time.monotonic() - t0, 2)
                self.res.violations = [v.as_dict() for v in self.model.violations]
                self.res.faults |= {f"s3_{k}": v for k, v in self.proxy.counts.injected.items()}
        return self.res

    def later(self, steps: int, what: str, heal: Callable[[], None]) -> None:
        self.pending.append((self.model.step + steps, what, heal))

    def heal_due(self, step: int, *, all_: bool = False) -> None:
        for _ in range(2 if all_ else 1):  # a heal may have to wait for another (a filler in an immutable dir)
            due = sorted((x for x in self.pending if all_ or x[0] <= step), key=lambda x: x[1] != "disk_immutable")
            self.pending = [x for x in self.pending if x not in due]
            for _, _what, heal in due:
                heal()

    def check_alive(self) -> None:
        d = self.daemon
        assert d is not None
        if not d.alive():
            self.model.violate("daemon_alive", f"the daemon exited (code {d.exit_code()}): {d.tail(600)}")
            self.restart("its exit")
            return
        with WorkerClient(self.endpoint, timeout_s=5.0) as mon:
            try:
                mon.ping()
            except DaemonUnavailable:
                self.model.violate("daemon_alive", "no Pong within 5 s")

    # -- workload ops -----------------------------------------------------------------------------------------
    def op_store(self, op: Op) -> None:
        ks = self.keys(op.tenant, op.keys)
        bufs = [np.frombuffer(self.content(k), np.uint8) for k in ks]
        self.model.purged.difference_update(ks)  # whatever the outcome, the blocks may be there again
        r = self.call("store", lambda: self.client(op.tenant, op.session).store(ks, bufs, durable=op.durable))
        if isinstance(r, p.Ack):
            self.model.stored(ks, durable=op.durable and r.durable == len(ks))

    def op_load(self, op: Op) -> None:
        ks = self.keys(op.tenant, op.keys)
        outs = [np.zeros(self.nbytes, np.uint8) for _ in ks]
        n = self.call("load", lambda: self.client(op.tenant, op.session).load(ks, outs))
        if isinstance(n, int):
            self.model.check_load(ks, [o.tobytes() for o in outs], [self.content(k) for k in ks], n)

    def op_lookup(self, op: Op) -> None:
        ks = self.keys(op.tenant, op.keys)
        r = self.call("lookup", lambda: self.client(op.tenant, op.session).lookup(ks))
        if isinstance(r, p.LookupReply):
            self.model.check_lookup(ks, r.matched, r.tiers)

    def op_purge(self, op: Op) -> None:
        ks = self.keys(op.tenant, op.keys)
        r = self.call("purge", lambda: self.admin_client().evict(ks))
        if isinstance(r, p.Evicted) and not r.skipped:
            self.model.purge(ks)

    def op_register(self, op: Op) -> None:
        """An engine restarts: it unregisters and registers again."""
        c = self.clients.pop((op.tenant, op.session), None)
        if c is not None:
            c.close()
        self.call("register", lambda: self.client(op.tenant, op.session))

    def op_cross_access(self, op: Op) -> None:
        other = TENANTS[(TENANTS.index(op.tenant) + 1) % len(TENANTS)]
        ons = layout_of(other).namespace
        hs = [k.hash for k in self.keys(other, op.keys)]
        c = self.client(op.tenant, op.session)
        msg: Any
        if op.count == 0:
            msg, want = p.Lookup(namespace=ons, hashes=hs), p.LookupReply
        elif op.count == 1:
            msg, want = p.Onboard(namespace=ons, hashes=hs), p.Onboarded
        else:
            msg, want = p.PrepareStore(namespace=ons, hashes=hs, nbytes=self.nbytes), p.Slots
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
        c = WorkerClient(self.endpoint, timeout_s=4.0, tenant_token=self.token_of("b"))
        try:
            r = self.call("cross_register", lambda: c.register(layout_of("a"), worker_id=f"x-b{op.session}",
                                                               engine_id=f"x-b{op.session}"))
            if not isinstance(r, p.Registered):
                return
            self.model.violate("cross_tenant", f"tenant b registered tenant a's namespace {r.namespace} "
                                               f"(a lists it in namespaces)")
            ks = self.keys("a", op.keys)
            forged = [np.frombuffer(bytes(255 - x for x in self.content(k)[:64]) * (self.nbytes // 64), np.uint8)
                      for k in ks]
            self.model.forged.update(ks)
            self.call("forged store", lambda: c.store(ks, forged))
        finally:
            c.close()

    # -- faults -----------------------------------------------------------------------------------------------
    def op_s3_faults(self, op: Op) -> None:
        self.proxy.rates = FaultRates(**op.rates)
        self.later(op.count, "s3_faults", self.proxy.heal)

    def op_s3_outage(self, op: Op) -> None:
        self.proxy.outage(op.seconds)

    def op_kill(self, _op: Op) -> None:
        assert self.daemon is not None
        _bump(self.res.faults, "sigkill")
        self.daemon.kill9()
        self.restart("SIGKILL")

    def op_restart(self, _op: Op) -> None:
        assert self.daemon is not None
        _bump(self.res.faults, "restart")
        if not self.daemon.stop():
            self.model.violate("daemon_alive", "did not stop within 15 s of SIGTERM")
        self.restart("SIGTERM")

    def restart(self, after: str) -> None:
        """Start the daemon again; one that cannot start under the faults now injected is a violation, and it is
        started again once they are healed."""
        assert self.daemon is not None
        try:
            self.daemon.start()
        except RuntimeError as e:
            self.model.violate("daemon_alive", f"no start after {after} (faults: "
                                               f"{[w for _, w, _ in self.pending]}): {str(e)[-400:]}")
            self.heal_due(0, all_=True)
            self.daemon.start()

    def op_stop(self, op: Op) -> None:
        assert self.daemon is not None
        _bump(self.res.faults, "sigstop")
        self.daemon.signal(signal.SIGSTOP)
        try:
            time.sleep(op.seconds)
        finally:
            self.daemon.signal(signal.SIGCONT)

    def op_disk_full(self, op: Op) -> None:
        if not self.tmpfs:
            _bump(self.res.faults, "disk_full_skipped")
            return
        filler = self.disk / ".chaos-filler"
        with contextlib.suppress(OSError), open(filler, "ab") as f:
            while True:
                f.write(b"\0" * (256 * 1024))
                f.flush()
        _bump(self.res.faults, "disk_full")
        self.later(op.count, "disk_full", lambda: self._unfill(filler))

    def _unfill(self, filler: Path) -> None:
        try:
            filler.unlink(missing_ok=True)
        except PermissionError:  # the directory is immutable now (disk_ro): once that is healed
            self.later(1, "disk_full", lambda: self._unfill(filler))

    def op_disk_ro(self, op: Op) -> None:
        """G3 read-only (EROFS) for some steps; a tmpfs with files open for writing cannot be remounted so
        (EBUSY), and root ignores permission bits, so then every entry is made immutable (EPERM) instead."""
        if not self.tmpfs:
            _bump(self.res.faults, "disk_ro_skipped")
            return
        if _sh("mount", "-o", "remount,ro", str(self.disk)):
            _bump(self.res.faults, "disk_ro")
            self.later(op.count, "disk_ro", lambda: _sh("mount", "-o", "remount,rw", str(self.disk)) or None)
        elif _sh("chattr", "-R", "-f", "+i", str(self.disk)):
            _bump(self.res.faults, "disk_immutable")
            self.later(op.count, "disk_immutable", lambda: _sh("chattr", "-R", "-f", "-i", str(self.disk)) or None)
        else:
            _bump(self.res.faults, "disk_ro_skipped")

    def op_journal_delete(self, _op: Op) -> None:
        j = self.disk / JOURNAL
        try:
            j.unlink()
            _bump(self.res.faults, "journal_delete")
        except FileNotFoundError:
            _bump(self.res.faults, "journal_absent")
        except OSError:  # a read-only disk
            _bump(self.res.faults, "journal_delete_failed")

    def _hostile(self) -> tuple[WorkerClient, random.Random]:
        return self.client("a", 0), random.Random(f"{self.seed}:{self.model.step}")

    def _check_fuzz(self, r: fuzz.FuzzResult, what: str) -> None:
        for k, v in r.errors.items():
            _bump(self.res.refusals, k, v)
        for why in r.unnamed[:5]:
            self.model.violate("unnamed_refusal", f"{what}: {why}")

    def op_fuzz(self, op: Op) -> None:
        c, rng = self._hostile()
        frames = fuzz.hostile_frames(rng, op.count, token=c.token, generation=c.generation, namespace=c.namespace,
                                     layout=layout_of("a"), tenant_token=self.token_of("a"))
        r = fuzz.send_frames(self.endpoint, frames)
        for k, v in r.sent.items():
            _bump(self.res.faults, f"fuzz_{k}", v)
        self._check_fuzz(r, "fuzz")
        _bump(self.res.faults, "raw_stream", fuzz.poke_stream(self.endpoint, rng))
        assert self.daemon is not None
        if ev := self.daemon.info.get("events"):
            _bump(self.res.faults, "events_subscriptions", fuzz.poke_events(str(ev), rng))

    def op_flood(self, op: Op) -> None:
        """Barriers that wait, and Lookups, beyond the session's cap of requests in flight."""
        c = self.client(op.tenant, op.session)
        batch = []
        for i in range(op.count):
            msg: Any = (p.Barrier(rid=i + 1, token=c.token, engine_id=f"{op.tenant}-e{op.session}", step=i, rank=0,
                                  world_size=2) if i % 2 else
                        p.Lookup(rid=i + 1, token=c.token, namespace=c.namespace, hashes=[b"f" * 16]))
            batch.append(fuzz.Frames("flood", [p.encode(msg)]))
        r = fuzz.send_frames(self.endpoint, batch, wait_s=6.0)
        _bump(self.res.faults, "flood_requests", op.count)
        self._check_fuzz(r, "flood")

    def op_register_storm(self, op: Op) -> None:
        """Registers of fresh namespaces (tenant c's own models), beyond its max_workers; then they leave."""
        token = self.token_of(op.tenant)
        batch = [fuzz.Frames("register", [p.encode(p.Register(
            rid=i + 1, worker_id=f"storm-{self.model.step}-{i}", engine_id=f"storm-{i}", tenant_token=token,
            layout=layout_of("c", f"team-c/s{self.seed}-{self.model.step}-{i}")))]) for i in range(op.count)]
        r = fuzz.send_frames(self.endpoint, batch, wait_s=15.0)
        _bump(self.res.faults, "register_storm", op.count)
        self._check_fuzz(r, "register storm")
        bye = [fuzz.Frames("unregister", [p.encode(p.Unregister(rid=i + 1, token=t))]) for i, t in enumerate(r.tokens)]
        if bye:
            fuzz.send_frames(self.endpoint, bye, wait_s=5.0)

    # -- the end --------------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Heal every fault, then: acked-durable blocks are in the bucket with their bytes, purged ones are not."""
        self.model.step = -1
        self.proxy.heal()
        self.heal_due(0, all_=True)
        if self.sched.final == "kill":
            self.op_kill(Op("kill"))
        elif self.sched.final == "restart":
            self.op_restart(Op("restart"))
        self.check_alive()
        want = sorted(self.model.durable, key=lambda k: (k.namespace, k.hash))
        gone = sorted(self.model.purged, key=lambda k: (k.namespace, k.hash))
        deadline = time.monotonic() + DURABLE_WAIT_S
        missing = want
        while True:
            got = self.in_bucket(missing)
            missing = [k for k in missing if got[k] != self.content(k)]
            # An object holding other bytes will not change (a key's bytes are written once): no need to wait.
            if all(got[k] is not None for k in missing) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        for k in missing:
            what = "missing" if got[k] is None else "holding other bytes"
            if k in self.model.forged:
                what += " (a key tenant b forged through the cross-tenant Register)"
            self.model.violate("acked_lost", f"{k} acked durable, {what} in the bucket once S3 was back (waited "
                                             f"up to {DURABLE_WAIT_S:g} s; index_bucket {self.sched.index_bucket})")
        back = self.in_bucket(gone)
        for k in gone:
            if back[k] is not None:
                self.model.violate("purge_undone", f"{k} purged (Evict answered) but in the bucket at the end")

    def in_bucket(self, ks: list[BlockKey]) -> dict[BlockKey, bytes | None]:
        """Each block as a fresh S3 client reads it straight from SeaweedFS (no proxy, no daemon)."""

        async def go() -> dict[BlockKey, bytes | None]:
            cfg = S3Config(bucket=self.s3.bucket, prefix=self.prefix, max_retries=2, breaker_failures=1000)
            t = make_s3_tier(cfg, self.s3.endpoint, (self.s3.access_key, self.s3.secret_key))
            await t.start()
            try:
                out: dict[BlockKey, bytes | None] = {}
                for k in ks:
                    buf = bytearray(self.nbytes)
                    n = await t.get_into(k, memoryview(buf))
                    out[k] = None if n is None else bytes(buf[:n])
                return out
            finally:
                await t.close()

        return asyncio.run(go()) if ks else {}


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
                _bump(report[key], k, v)
        for v in r.violations:
            slot = report["violations"][v["invariant"]]
            slot["count"] += 1
            if seed not in slot["seeds"]:
                slot["seeds"].append(seed)
        report["harness_errors"] += [f"seed {seed}: {e}" for e in r.harness_errors]
        report["runs"].append({"seed": seed, "index_bucket": r.index_bucket, "final": plan(seed, steps).final,
                               "seconds": r.seconds, "ops": r.ops, "faults": r.faults, "refusals": r.refusals,
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
