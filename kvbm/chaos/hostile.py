"""A chaos schedule's hostile clients: malformed and forged frames (:mod:`kvbm.chaos.fuzz`), floods past a
session's cap of requests in flight, and register storms past a tenant's ``max_workers``. Each refusal must name
its cause."""

from __future__ import annotations

import random
from typing import Any

from kvbm import protocol as p
from kvbm.chaos import fuzz
from kvbm.chaos.invariants import Model
from kvbm.chaos.schedule import Op, layout_of
from kvbm.chaos.world import ScheduleResult, World, bump
from kvbm.client import WorkerClient


class Hostile:
    """Runs the hostile ops against ``world``'s daemon, counting in ``res``, violations in ``model``."""

    def __init__(self, world: World, model: Model, res: ScheduleResult) -> None:
        self.world, self.model, self.res = world, model, res

    def _hostile(self) -> tuple[WorkerClient, random.Random]:
        return self.world.client("a", 0), random.Random(f"{self.world.seed}:{self.model.step}")

    def _check_fuzz(self, r: fuzz.FuzzResult, what: str) -> None:
        for k, v in r.errors.items():
            bump(self.res.refusals, k, v)
        for why in r.unnamed[:5]:
            self.model.violate("unnamed_refusal", f"{what}: {why}")

    def op_fuzz(self, op: Op) -> None:
        c, rng = self._hostile()
        endpoint = self.world.endpoint
        frames = fuzz.hostile_frames(rng, op.count, token=c.token, generation=c.generation, namespace=c.namespace,
                                     layout=layout_of("a"), tenant_token=self.world.token_of("a"))
        r = fuzz.send_frames(endpoint, frames)
        for k, v in r.sent.items():
            bump(self.res.faults, f"fuzz_{k}", v)
        self._check_fuzz(r, "fuzz")
        bump(self.res.faults, "raw_stream", fuzz.poke_stream(endpoint, rng))
        assert self.world.daemon is not None
        if ev := self.world.daemon.info.get("events"):
            bump(self.res.faults, "events_subscriptions", fuzz.poke_events(str(ev), rng))

    def op_flood(self, op: Op) -> None:
        """Barriers that wait, and Lookups, beyond the session's cap of requests in flight."""
        c = self.world.client(op.tenant, op.session)
        batch = []
        for i in range(op.count):
            msg: Any = (p.Barrier(rid=i + 1, token=c.token, engine_id=f"{op.tenant}-e{op.session}", step=i, rank=0,
                                  world_size=2) if i % 2 else
                        p.Lookup(rid=i + 1, token=c.token, namespace=c.namespace, hashes=[b"f" * 16]))
            batch.append(fuzz.Frames("flood", [p.encode(msg)]))
        r = fuzz.send_frames(self.world.endpoint, batch, wait_s=6.0)
        bump(self.res.faults, "flood_requests", op.count)
        self._check_fuzz(r, "flood")

    def op_register_storm(self, op: Op) -> None:
        """Registers of fresh namespaces (tenant c's own models), beyond its max_workers; then they leave."""
        token = self.world.token_of(op.tenant)
        seed, step = self.world.seed, self.model.step
        batch = [fuzz.Frames("register", [p.encode(p.Register(
            rid=i + 1, worker_id=f"storm-{step}-{i}", engine_id=f"storm-{i}", tenant_token=token,
            layout=layout_of("c", f"team-c/s{seed}-{step}-{i}")))]) for i in range(op.count)]
        r = fuzz.send_frames(self.world.endpoint, batch, wait_s=15.0)
        bump(self.res.faults, "register_storm", op.count)
        self._check_fuzz(r, "register storm")
        bye = [fuzz.Frames("unregister", [p.encode(p.Unregister(rid=i + 1, token=t))]) for i, t in enumerate(r.tokens)]
        if bye:
            fuzz.send_frames(self.world.endpoint, bye, wait_s=5.0)
