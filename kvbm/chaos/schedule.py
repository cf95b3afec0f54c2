"""Seeded schedules: what each tenant's sessions do, and which faults are injected between their steps.

A schedule is a pure function of its seed (:func:`plan`): the same seed is the same list of :class:`Op`, so a
failure found by a campaign replays with ``kvbm bench chaos --seed S``. Block contents are derived from the
key and the seed (:func:`content`), so any load can be checked without keeping what was stored.

Why a seeded ``random.Random`` and not hypothesis here: one schedule runs against a daemon subprocess, S3 and
a filesystem for seconds, and its outcome depends on timing (when an owed write is retried, when a kill lands),
so hypothesis's shrinking (hundreds of reruns, each expecting the same outcome for the same choices) would cost
minutes per failure and would not converge. The protocol fuzz of the decoder, which is deterministic and
cheap, is hypothesis's (tests/chaos/test_protocol_fuzz.py).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from kvbm.blocks.layout import KVLayout

TENANTS = ("a", "b", "c")
KEYS_PER_TENANT = 24
SLOT_BYTES = 64 * 1024
INDEX_MODES = ("start", "background", "lazy")


def layout_of(tenant: str, model: str = "") -> KVLayout:
    """The layout a tenant's engine registers (``model`` overrides its own model name)."""
    return KVLayout(model=model or MODELS[tenant], num_layers=1, num_kv_heads=1, head_size=64, dtype="float16",
                    tokens_per_block=64)


# a: its namespace listed exactly; b: its "shared/q*" models (a config whose glob reaches a's listed namespace is
# refused at start since issue 37 D1, so b tries a's namespace by Register: it must be refused); c: its own
# "team-c/*" models, the one that mints fresh namespaces.
MODELS = {"a": "shared/llama", "b": "shared/qwen", "c": "team-c/base"}


def tenants_config(tmp: str) -> list[dict[str, Any]]:
    return [
        {"name": "a", "token_file": f"{tmp}/a.token", "namespaces": [layout_of("a").namespace], "max_workers": 4},
        {"name": "b", "token_file": f"{tmp}/b.token", "models": ["shared/q*"], "max_workers": 4},
        {"name": "c", "token_file": f"{tmp}/c.token", "models": ["team-c/*"], "max_workers": 6, "max_inflight": 8},
    ]


def block_hash(seed: int, tenant: str, i: int) -> bytes:
    return hashlib.blake2b(f"{seed}:{tenant}:{i}".encode(), digest_size=16).digest()


def content(namespace: str, h: bytes, seed: int, nbytes: int) -> bytes:
    """The bytes of block (``namespace``, ``h``) in schedule ``seed``: a keyed stream, distinct per block."""
    seedb = hashlib.blake2b(namespace.encode() + h + seed.to_bytes(8, "big"), digest_size=32).digest()
    reps = nbytes // 32 + 1
    return (seedb * reps)[:nbytes]


@dataclass
class Op:
    """One step: ``kind`` and its arguments (tenant, session, key indices, ...)."""

    kind: str
    tenant: str = ""
    session: int = 0
    keys: list[int] = field(default_factory=list)
    durable: bool = False
    seconds: float = 0.0
    count: int = 0
    rates: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (0, 0.0, "", [], {}, False) or k == "kind"}


@dataclass
class Schedule:
    seed: int
    index_bucket: str
    ops: list[Op]
    final: str = ""  # after every fault is healed, before the end checks: "kill" (SIGKILL, start), "restart", ""

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "index_bucket": self.index_bucket, "ops": [o.as_dict() for o in self.ops],
                "final": self.final}


# Weights of each kind of step (workload steps, then faults).
WORK = {"store": 10, "load": 8, "lookup": 4, "purge": 2, "register": 2, "cross_access": 1, "cross_register": 1}
FAULTS = {"s3_faults": 3, "s3_outage": 2, "kill": 1.5, "restart": 0.5, "stop": 1, "disk_full": 1, "disk_ro": 1,
          "journal_delete": 1, "fuzz": 2, "flood": 1, "register_storm": 1}


def plan(seed: int, steps: int = 28, *, faults: bool = True) -> Schedule:
    """The schedule of ``seed``: ``steps`` steps, about one in three a fault when ``faults``."""
    rng = random.Random(seed)
    mode = rng.choice(INDEX_MODES)
    kinds = dict(WORK)
    if faults:
        w = sum(WORK.values()) / 2 / sum(FAULTS.values())
        kinds |= {k: v * w for k, v in FAULTS.items()}
    names, weights = list(kinds), list(kinds.values())
    ops: list[Op] = []
    for _ in range(steps):
        kind = rng.choices(names, weights)[0]
        tenant = rng.choice(TENANTS)
        session = rng.randrange(2)
        n = rng.randint(1, 4)
        start = rng.randrange(KEYS_PER_TENANT - n + 1)
        run = list(range(start, start + n))  # a prefix-like run of chained blocks
        if kind == "store":
            ops.append(Op(kind, tenant, session, run, durable=rng.random() < 0.6))
        elif kind in ("load", "lookup", "purge"):
            ops.append(Op(kind, tenant, session, run))
        elif kind == "register":
            ops.append(Op(kind, tenant, session))
        elif kind == "cross_access":  # a session of one tenant names another's namespace
            ops.append(Op(kind, tenant, session, run, count=rng.randrange(3)))
        elif kind == "cross_register":  # tenant b asks for a's model (and stores through it if let in)
            ops.append(Op(kind, "b", session, run))
        elif kind == "s3_faults":
            rates = {f: round(rng.uniform(0, 0.15), 3) for f in ("latency", "error500", "slowdown503", "reset",
                                                                  "truncate")}
            ops.append(Op(kind, count=rng.randint(2, 6), rates=rates))
        elif kind == "s3_outage":
            ops.append(Op(kind, seconds=round(rng.uniform(1.0, 5.0), 2)))
        elif kind == "stop":
            ops.append(Op(kind, seconds=round(rng.uniform(0.2, 1.5), 2)))
        elif kind in ("kill", "restart", "journal_delete"):
            ops.append(Op(kind))
        elif kind in ("disk_ro", "disk_full"):
            ops.append(Op(kind, count=rng.randint(1, 4)))
        elif kind == "fuzz":
            ops.append(Op(kind, count=rng.randint(20, 80)))
        elif kind == "flood":
            ops.append(Op(kind, tenant, session, count=rng.randint(40, 120)))
        elif kind == "register_storm":
            ops.append(Op(kind, "c", count=rng.randint(8, 24)))
    final = rng.choice(["", "kill", "restart"]) if faults else ""
    return Schedule(seed, mode, ops, final)
