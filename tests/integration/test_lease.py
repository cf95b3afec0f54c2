"""kvbm.client.lease against a real daemon: the worker side's one owner of G2 slot leases. A reservation is
committed when its body ends, given back (nothing stored, the slots free) when the body raises or says so; an
onboard's pins are released however its body ends; the pin window follows the budget the daemon states."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from serve_proc import ServeProc, wait_until
from test_sessions import LAYOUT, NB, daemon, keys

from kvbm.client import AsyncWorkerClient, WorkerClient
from kvbm.client.lease import aonboarded, areserving, onboarded, pin_window, reserving


def _pins(d: ServeProc) -> int:
    with d.client(timeout_s=5) as c:
        return c.stats()["daemon"]["pins"]


def test_a_reservation_commits_or_gives_back_and_an_onboard_always_releases(tmp_path):
    d = daemon(tmp_path, max_session_slots=4).start()
    try:
        with WorkerClient(d.endpoint, timeout_s=10) as c:
            c.register(LAYOUT, worker_id="lease")
            assert pin_window(c.registered) == 4  # the stated budget (8 slots: half of G2 would be 4 too)
            stored, dropped, refused = [b"s" * 32], [b"d" * 32], [b"r" * 32]
            with reserving(c, stored, NB) as res:
                res.view(0)[:] = 7
            assert res.ack is not None and res.ack.stored == 1
            with pytest.raises(RuntimeError, match="copy failed"), reserving(c, dropped, NB):
                raise RuntimeError("test: the copy failed")
            with reserving(c, refused, NB) as res:
                res.ok = False  # the caller gives the slots back without storing
            assert c.lookup(stored).matched == 1
            assert c.lookup(dropped).matched == 0 and c.lookup(refused).matched == 0
            with pytest.raises(RuntimeError, match="boom"), onboarded(c, stored) as got:
                assert got.count == 1 and int(got.view(0)[0]) == 7
                assert _pins(d) == 1
                raise RuntimeError("test: boom while reading")
            assert wait_until(lambda: _pins(d) == 0, timeout=10), "the onboard's pin was not released"
    finally:
        d.stop()


def test_the_asyncio_forms_do_the_same(tmp_path):
    d = daemon(tmp_path).start()

    async def go() -> tuple[int, int, int]:
        async with AsyncWorkerClient(d.endpoint, timeout_s=10) as c:
            await c.register(LAYOUT, worker_id="alease")
            async with areserving(c, [b"a" * 32], NB) as res:
                res.view(0)[:] = 3
            try:
                async with areserving(c, [b"b" * 32], NB):
                    raise RuntimeError("test: the copy failed")
            except RuntimeError:
                pass
            async with aonboarded(c, [b"a" * 32, b"b" * 32]) as got:
                first = int(got.view(0)[0])
                count = got.count
            out = np.zeros(NB, np.uint8)
            loaded = await c.load([b"a" * 32], [out])
            return count, first, loaded

    try:
        count, first, loaded = asyncio.run(go())
        assert (count, first, loaded) == (1, 3, 1)  # "b" was given back, not stored
        assert wait_until(lambda: _pins(d) == 0, timeout=10)
    finally:
        d.stop()


def test_one_sessions_stores_and_loads_in_flight_together_wait_for_its_budget(tmp_path):
    """An asyncio client's stores and loads in flight at once share one session's slot budget: together past it,
    they wait for each other's commits and releases (it used to answer ``full: session slot budget`` to the ones
    that came last: a bench replaying a trace saw half its stores refused and its hits come up short)."""
    d = daemon(tmp_path, max_session_slots=4).start()

    async def go() -> tuple[list, list]:
        async with AsyncWorkerClient(d.endpoint, timeout_s=30) as c:
            await c.register(LAYOUT, worker_id="budget")
            ks = [keys(3, b"st%d" % i) for i in range(6)]
            data = [np.full((3, NB), i + 1, np.uint8) for i in range(6)]
            acks = await asyncio.gather(*(c.store(k, list(v)) for k, v in zip(ks, data, strict=True)),
                                        return_exceptions=True)
            # Loads of the last store's blocks (G2 holds 8 and has no disk below it), 6 at once: 18 pins > 4.
            outs = [np.zeros((3, NB), np.uint8) for _ in range(6)]
            loads = await asyncio.gather(*(c.load(ks[-1], list(o)) for o in outs), return_exceptions=True)
            assert all(np.array_equal(o, data[-1]) for o, n in zip(outs, loads, strict=True) if n == 3)
            return acks, loads

    try:
        acks, loads = asyncio.run(go())
        assert [getattr(a, "stored", a) for a in acks] == [3] * 6
        assert loads == [3] * 6
        assert wait_until(lambda: _pins(d) == 0, timeout=10)
    finally:
        d.stop()
