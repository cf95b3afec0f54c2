"""What must hold after (and during) every schedule, and the model of what was acknowledged that it is checked
against.

Invariants (the names a report counts violations under):

- ``daemon_alive``: the daemon never dies of its own accord, and answers a Ping after every step (after a kill,
  the restarted one does);
- ``wrong_bytes``: a load returns exactly the bytes stored under that key (:func:`kvbm.chaos.schedule.content`);
- ``acked_lost``: every block acknowledged durable (and not purged since, nor named by a purge that failed: that
  one's outcome is unknown to the client) is in the bucket, with its bytes, once S3 is back;
- ``purge_undone``: a block purged (Evict answered) and not stored again is not in the bucket at the end;
- ``cross_tenant``: no tenant registers, reads or writes another tenant's namespace;
- ``unnamed_refusal``: every refusal (an Error reply) carries a known code and a message;
- ``bad_reply``: a reply that contradicts its request (a Lookup matching more than asked, unknown tiers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbm.blocks import BlockKey
from kvbm.chaos.fuzz import KNOWN_CODES

INVARIANTS = ("daemon_alive", "wrong_bytes", "acked_lost", "purge_undone", "cross_tenant", "unnamed_refusal",
              "bad_reply")
TIER_NAMES = frozenset({"G1", "G2", "G3", "G4"})


@dataclass
class Violation:
    invariant: str
    seed: int
    step: int  # the op index (-1: the end-of-schedule checks)
    detail: str
    evidence: str = ""  # what the daemon knew (its counters, journal and log lines): for a one-off finding

    def as_dict(self) -> dict[str, Any]:
        d = {"invariant": self.invariant, "seed": self.seed, "step": self.step, "detail": self.detail[:500]}
        return d | ({"evidence": self.evidence[-4000:]} if self.evidence else {})


@dataclass
class Model:
    """What the daemon acknowledged in one schedule."""

    seed: int
    durable: set[BlockKey] = field(default_factory=set)  # acked durable, not purged since
    purged: set[BlockKey] = field(default_factory=set)  # purged (Evict answered), not stored again
    forged: set[BlockKey] = field(default_factory=set)  # keys another tenant wrote its own bytes under (let in)
    # A purge refused or partly skipped may have removed some of its blocks (an owed write dropped, a delete that
    # reached the bucket before the reply was lost): neither kept nor gone is owed for them until stored again.
    undetermined: set[BlockKey] = field(default_factory=set)
    acked_at: dict[BlockKey, int] = field(default_factory=dict)  # the step of each block's last durable ack
    violations: list[Violation] = field(default_factory=list)
    step: int = 0

    def violate(self, invariant: str, detail: str, step: int | None = None, evidence: str = "") -> None:
        assert invariant in INVARIANTS, invariant
        self.violations.append(Violation(invariant, self.seed, self.step if step is None else step, detail,
                                         evidence))

    def stored(self, keys: list[BlockKey], durable: bool) -> None:
        self.purged.difference_update(keys)
        self.undetermined.difference_update(keys)
        if durable:
            self.durable.update(keys)
            self.acked_at |= dict.fromkeys(keys, self.step)

    def purge(self, keys: list[BlockKey]) -> None:
        self.durable.difference_update(keys)
        self.purged.update(keys)

    def purge_undetermined(self, keys: list[BlockKey]) -> None:
        """A purge that failed or was not answered: its blocks may or may not be in the bucket now."""
        self.durable.difference_update(keys)
        self.purged.difference_update(keys)
        self.undetermined.update(keys)

    # -- checks ---------------------------------------------------------------------------------------------
    def check_refusal(self, code: str, message: str, what: str) -> None:
        if code not in KNOWN_CODES and code != "shed":
            self.violate("unnamed_refusal", f"{what}: unknown error code {code!r} ({message[:120]!r})")
        elif not message.strip():
            self.violate("unnamed_refusal", f"{what}: error {code!r} with no message")

    def check_load(self, keys: list[BlockKey], outs: list[bytes], expect: list[bytes], n: int) -> None:
        if not 0 <= n <= len(keys):
            self.violate("bad_reply", f"load of {len(keys)} blocks reported {n}")
            return
        for k, got, want in zip(keys[:n], outs[:n], expect[:n], strict=True):
            if got != want:
                why = " (a key another tenant forged through a cross-tenant Register)" if k in self.forged else ""
                self.violate("wrong_bytes", f"load of {k} returned bytes other than stored "
                                            f"(first differing byte at {_first_diff(got, want)}){why}")

    def check_lookup(self, keys: list[BlockKey], matched: int, tiers: list[str]) -> None:
        if not 0 <= matched <= len(keys) or len(tiers) != matched or not set(tiers) <= TIER_NAMES:
            self.violate("bad_reply", f"lookup of {len(keys)} blocks: matched {matched}, tiers {tiers}")


def _first_diff(a: bytes, b: bytes) -> int:
    if len(a) != len(b):
        return min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), -1)
