"""A chaos schedule's faults: S3 fault rates and outages through the proxy, the daemon SIGKILLed, restarted or
SIGSTOPped, G3's disk full or read-only, the owed journal deleted. A fault lasts some steps (healed when due) or
some seconds; a daemon that cannot start again is a violation."""

from __future__ import annotations

import contextlib
import errno
import signal
import time
from collections.abc import Callable
from pathlib import Path

from kvbm.chaos.invariants import Model
from kvbm.chaos.proxy import FaultRates
from kvbm.chaos.schedule import Op
from kvbm.chaos.world import JOURNAL, ScheduleResult, World, bump, sh


class Faults:
    """Injects the fault ops into ``world``, counts them in ``res`` and heals them when due."""

    def __init__(self, world: World, model: Model, res: ScheduleResult) -> None:
        self.world, self.model, self.res = world, model, res
        self.pending: list[tuple[int, str, Callable[[], None]]] = []  # (step due, what, heal)

    def later(self, steps: int, what: str, heal: Callable[[], None]) -> None:
        self.pending.append((self.model.step + steps, what, heal))

    def heal_due(self, step: int, *, all_: bool = False) -> None:
        for _ in range(2 if all_ else 1):  # a heal may have to wait for another (a filler in an immutable dir)
            # The disk made writable again first: a filler's removal needs it (seed 15006: EROFS).
            due = sorted((x for x in self.pending if all_ or x[0] <= step),
                         key=lambda x: x[1] not in ("disk_immutable", "disk_ro"))
            self.pending = [x for x in self.pending if x not in due]
            for _, _what, heal in due:
                heal()

    def heal_all(self) -> None:
        self.world.proxy.heal()
        self.heal_due(0, all_=True)

    # -- S3 ---------------------------------------------------------------------------------------------------
    def op_s3_faults(self, op: Op) -> None:
        self.world.proxy.rates = FaultRates(**op.rates)
        self.later(op.count, "s3_faults", self.world.proxy.heal)

    def op_s3_outage(self, op: Op) -> None:
        self.world.proxy.outage(op.seconds)

    # -- the daemon -------------------------------------------------------------------------------------------
    def op_kill(self, _op: Op) -> None:
        assert self.world.daemon is not None
        bump(self.res.faults, "sigkill")
        self.world.daemon.kill9()
        self.restart("SIGKILL")

    def op_restart(self, _op: Op) -> None:
        assert self.world.daemon is not None
        bump(self.res.faults, "restart")
        if not self.world.daemon.stop():
            self.model.violate("daemon_alive", "did not stop within 15 s of SIGTERM")
        self.restart("SIGTERM")

    def restart(self, after: str) -> None:
        """Start the daemon again; one that cannot start under the faults now injected is a violation, and it is
        started again once they are healed."""
        assert self.world.daemon is not None
        try:
            self.world.daemon.start()
        except RuntimeError as e:
            self.model.violate("daemon_alive", f"no start after {after} (faults: "
                                               f"{[w for _, w, _ in self.pending]}): {str(e)[-400:]}")
            self.heal_due(0, all_=True)
            self.world.daemon.start()

    def op_stop(self, op: Op) -> None:
        assert self.world.daemon is not None
        bump(self.res.faults, "sigstop")
        self.world.daemon.signal(signal.SIGSTOP)
        try:
            time.sleep(op.seconds)
        finally:
            self.world.daemon.signal(signal.SIGCONT)

    # -- the disk ---------------------------------------------------------------------------------------------
    def op_disk_full(self, op: Op) -> None:
        if not self.world.tmpfs:
            bump(self.res.faults, "disk_full_skipped")
            return
        filler = self.world.disk / ".chaos-filler"
        with contextlib.suppress(OSError), open(filler, "ab") as f:
            while True:
                f.write(b"\0" * (256 * 1024))
                f.flush()
        bump(self.res.faults, "disk_full")
        self.later(op.count, "disk_full", lambda: self._unfill(filler))

    def _unfill(self, filler: Path) -> None:
        try:
            filler.unlink(missing_ok=True)
        except OSError as e:  # the directory is immutable or read-only now (disk_ro): once that is healed
            if e.errno not in (errno.EPERM, errno.EACCES, errno.EROFS):
                raise
            self.later(1, "disk_full", lambda: self._unfill(filler))

    def op_disk_ro(self, op: Op) -> None:
        """G3 read-only (EROFS) for some steps; a tmpfs with files open for writing cannot be remounted so
        (EBUSY), and root ignores permission bits, so then every entry is made immutable (EPERM) instead."""
        disk = str(self.world.disk)
        if not self.world.tmpfs:
            bump(self.res.faults, "disk_ro_skipped")
            return
        if sh("mount", "-o", "remount,ro", disk):
            bump(self.res.faults, "disk_ro")
            self.later(op.count, "disk_ro", lambda: sh("mount", "-o", "remount,rw", disk) or None)
        elif sh("chattr", "-R", "-f", "+i", disk):
            bump(self.res.faults, "disk_immutable")
            self.later(op.count, "disk_immutable", lambda: sh("chattr", "-R", "-f", "-i", disk) or None)
        else:
            bump(self.res.faults, "disk_ro_skipped")

    def op_journal_delete(self, _op: Op) -> None:
        j = self.world.disk / JOURNAL
        try:
            j.unlink()
            bump(self.res.faults, "journal_delete")
        except FileNotFoundError:
            bump(self.res.faults, "journal_absent")
        except OSError:  # a read-only disk
            bump(self.res.faults, "journal_delete_failed")
