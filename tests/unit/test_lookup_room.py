"""How long a sync hit refused room for its pins waits for it (``lookup_rounds.RoomWait``): counted in the engine's
steps that ran tokens, and bounded in time for an engine whose steps are empty."""

from __future__ import annotations

import time

from kvbm.integrations.vllm import lookup_rounds
from kvbm.integrations.vllm.lookup_rounds import Job, RoomWait


def test_a_refused_job_waits_for_busy_steps_up_to_the_bound_then_takes_what_it_pinned() -> None:
    room, job = RoomWait(), Job("r", [b"h"])
    for _ in range(lookup_rounds.ROOM_STEPS):
        assert room.waits(job)
        room.step()
    assert not room.waits(job)


def test_on_an_engine_with_empty_steps_the_wait_ends_after_its_time_bound(monkeypatch) -> None:
    monkeypatch.setattr(lookup_rounds, "ROOM_MAX_S", 0.05)
    room, job = RoomWait(), Job("r", [b"h"])
    assert room.waits(job)
    asked = job.asked
    time.sleep(0.06)
    assert not room.waits(job)
    assert job.asked == asked  # not moved on: the scheduler's give-up counts from the last round that waited
