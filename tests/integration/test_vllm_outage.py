"""The connector never holds vLLM up, whatever the daemon does: a real daemon (``kvbm serve`` in a subprocess)
that is SIGKILLed, restarted or full, driven through the connector's real scheduler and worker sides.

What is checked is the contract, with deadlines an order of magnitude above what a healthy run takes and
below the request timeout (``timeout_s`` = 10 s here): a hook that waited on the daemon's silence would
take that long; one that saw the socket drop returns at once."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
from needs import needs
from serve_proc import ServeProc, wait_until

pytestmark = needs("vllm", importlib.util.find_spec("vllm") is not None,
                   "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
MiB = 1 << 20
TIMEOUT_S = 10.0  # the links' request timeout: what a hook waiting on a dead daemon would cost
HOOK_S = 1.0  # far above a hook's healthy cost (a millisecond or two), far below TIMEOUT_S
_HASH_SEEDED: list[bool] = []


def daemon_cfg(tmp: Path, port: int) -> dict:
    return {"block_bytes": "1MiB", "device": {"enabled": False}, "host": {"capacity": "4MiB"},
            "disk": {"enabled": False}, "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": f"tcp://127.0.0.1:{port}", "events_endpoint": f"ipc://{tmp}/events.sock",
                       "metrics_port": -1}}


@pytest.fixture
def daemon(tmp_path):
    from test_vllm_e2e import free_port

    d = ServeProc(tmp_path, daemon_cfg(tmp_path, free_port())).start()
    yield d
    d.stop()


def scheduler_connector(model: str, extra: dict):
    from test_vllm_connector import scheduler_connector as make

    return make(model, {"vllm_blocks_per_kvbm_block": 1, "timeout_s": TIMEOUT_S, **extra})[0]


def stored_request(conn, daemon, rid: str, n_blocks: int, first_token: int):
    """:func:`_request` whose kvbm blocks the daemon holds under the scheduler's layout."""
    from kvbm.blocks import BlockKey

    req = _request(rid, n_blocks, first_token)
    (lay,) = conn.layouts()
    keys = [BlockKey(lay.namespace, bytes(h)) for h in req.block_hashes]
    with daemon.client() as c:
        c.register(lay, worker_id=f"filler-{rid}")
        assert c.store(keys, [np.zeros(lay.block_nbytes, np.uint8)] * len(keys)).stored == len(keys)
    return req


def step_until_known(conn, req, steps: int = 200) -> tuple[tuple, float]:
    """Call ``get_num_new_matched_tokens`` once per scheduler step, as vLLM does while it answers None; the
    answer and the longest single call."""
    from test_vllm_connector import _empty_scheduler_output

    longest = 0.0
    for _ in range(steps):
        t0 = time.monotonic()
        got = conn.get_num_new_matched_tokens(req, 0)
        longest = max(longest, time.monotonic() - t0)
        if got[0] is not None:
            return got, longest
        conn.build_connector_meta(_empty_scheduler_output())
        time.sleep(0.01)  # the step's forward
    raise AssertionError(f"no answer in {steps} steps")


def test_a_killed_daemon_never_holds_the_scheduler_and_hits_resume_when_it_is_back(tiny_model, daemon):
    conn = scheduler_connector(tiny_model, {"daemon": daemon.endpoint})
    try:
        req = stored_request(conn, daemon, "before", 3, 100)
        assert step_until_known(conn, req)[0] == (48, False)

        daemon.kill9()
        # New requests while the daemon is dead: each hook call returns at once, and within a step or two the
        # answer is 0 (computed cold), not a timeout later.
        for i in range(3):
            req = _request(f"during-{i}", 3, 1000 + 100 * i)
            t0 = time.monotonic()
            got, longest = step_until_known(conn, req)
            assert got == (0, False)
            assert longest < HOOK_S, f"a get_num_new_matched_tokens call took {longest:.3f}s"
            assert time.monotonic() - t0 < HOOK_S, f"the answer took {time.monotonic() - t0:.3f}s"
            conn.request_finished(req, [])
        degraded = conn.request_finished(req, [])[1]["kvbm"]
        assert degraded["degraded"] is True and "misconfigured" in degraded and not degraded["misconfigured"]

        # The daemon is back (an empty one): the link reconnects on its own, and a stored prefix hits again.
        daemon.start()
        wait_until(lambda: conn.layouts() and _registered(daemon), timeout=30)
        req = stored_request(conn, daemon, "after", 2, 5000)
        got = wait_until(lambda: step_until_known(conn, req)[0] == (32, False), timeout=30)
        assert got, "no hit after the daemon came back"
        assert conn.request_finished(req, [])[1]["kvbm"]["degraded"] is False
    finally:
        conn.shutdown()


def _registered(daemon) -> bool:
    with daemon.client(timeout_s=5) as c:
        return c.stats()["daemon"]["registered"] >= 1


def _request(rid: str, n_blocks: int, first_token: int):
    """A real vLLM Request of ``n_blocks`` full 16-token blocks (+1 token)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    if not _HASH_SEEDED:
        # Once: without PYTHONHASHSEED every init draws a new seed, and later requests would miss.
        kcu.init_none_hash(fn)
        _HASH_SEEDED.append(True)
    return Request(rid, list(range(first_token, first_token + 16 * n_blocks + 1)), SamplingParams(max_tokens=1),
                   None, block_hasher=kcu.get_request_block_hasher(16, fn))


def _layout(rank: int, k: int):
    """The KV layout :func:`_worker`'s rank ``rank`` stores kvbm blocks of ``k`` vLLM blocks under."""
    from kvbm.blocks.layout import KVLayout

    return KVLayout(model="outage", num_layers=2, num_kv_heads=1, head_size=32, dtype="float16", tp_rank=rank,
                    tokens_per_block=16 * k, block_bytes=MiB)


def _worker(endpoint: str, k: int | None, epoch=None, **cfg):
    """The connector's worker side of TP rank 0 over a 2-layer paged cache of 8 blocks (4 KiB each), k = 1; its
    links share ``epoch`` (a ``WeightsEpoch``, as the connector gives every engine) when one is given."""
    import torch

    from kvbm.integrations.vllm import ConnectorConfig, Geometry, Links, WorkerSide

    geometry = Geometry(16, 2 * 2048, k)  # k None: unknown until a link reaches the daemon
    links = Links(endpoint, geometry, "outage-engine", TIMEOUT_S, _layout, epoch=epoch)
    w = WorkerSide(ConnectorConfig.parse(cfg), links, 0, 8)
    w.register_kv_caches({f"layer.{i}": torch.zeros(8, 2048, dtype=torch.uint8) for i in range(2)})
    w.saver._pool.submit(lambda: None).result(timeout=60)  # the saver's session, opened on its thread, is open
    return w


def test_a_worker_that_never_reached_the_daemon_still_reports_every_planned_transfer(tmp_path):
    """On an accelerator loads are async: vLLM keeps a request in WAITING_FOR_REMOTE_KVS until its load is reported
    finished. A worker whose link is down (so it never learned k) used to return early and report none. (A save
    holds no blocks since round 12, so it is never reported.)"""
    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    w = _worker(f"ipc://{tmp_path}/nobody.sock", None, async_load=True, async_save=True)
    try:
        assert w.geometry.k is None
        meta = KvbmConnectorMetadata(k=1, loads=[BlockTransfer("load-1", [b"a" * 32, b"b" * 32], [[2], [3]])],
                                     saves=[BlockTransfer("save-1", [b"c" * 32], [[5]])])
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        sending, recving, failed = w.get_finished({"save-1"})  # vLLM finished save-1 and kept its blocks
        assert recving == {"load-1"} and failed == set()  # one KV-cache group: failures go as block ids
        assert w.get_block_ids_with_load_errors() == {2, 3}  # recomputed
        # A save never holds blocks (vLLM freed save-1's at its finish): reported, it would kill vLLM's scheduler
        assert sending == set()
    finally:
        w.shutdown()


def test_a_failed_link_unregisters_and_unmaps_and_a_full_daemon_is_not_a_failure(daemon):
    """A failed link gives its session back (the daemon releases the worker's pins; the G2 mapping goes), and a
    daemon answering ``full`` is load: the save is skipped, the link stays up."""
    from kvbm import protocol as p
    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    w = _worker(daemon.endpoint, 1, async_load=False, async_save=False)
    try:
        client = w._link.client
        assert client is not None and client.g2 is not None and w.geometry.k == 1
        # Fill G2 (4 slots of 1 MiB) with blocks this worker pins by onboarding them.
        ns = client.namespace
        hashes = [bytes([i]) * 32 for i in range(4)]
        with daemon.client() as c:
            c.register(w._link.layout, worker_id="filler")
            c.store(hashes, [np.zeros(4096, np.uint8)] * 4)
        assert client.request(p.Onboard(namespace=ns, hashes=hashes), p.Onboarded).count == 4

        # A save now finds no free slot: the daemon answers full. Load, not a link failure.
        w.wait_for_save(KvbmConnectorMetadata(k=1, saves=[BlockTransfer("s", [b"z" * 32], [[1]])]))
        assert w._link.client is client and not w._link.degraded, w._link.degraded_reason

        st = _stats(daemon)["daemon"]
        assert (st["workers"], st["pins"]) == (2, 4)  # the worker's session and the saver's (open from start-up)
        w._link.fail(RuntimeError("test: the link failed"))
        assert client.g2 is None, "the failed link's G2 mapping is still mapped"
        gone = wait_until(lambda: (_stats(daemon)["daemon"]["workers"], _stats(daemon)["daemon"]["pins"]) == (1, 0),
                          timeout=10)
        assert gone, f"the failed link's session is still held: {_stats(daemon)['daemon']}"
    finally:
        w.shutdown()


def _stats(daemon) -> dict:
    with daemon.client(timeout_s=5) as c:
        return c.stats()


def _scheduler(endpoint: str, engine: str, tp: int, **cfg):
    """The connector's scheduler side for ``tp`` ranks (k = 1, 4 KiB vLLM blocks) straight from its parts."""
    from kvbm.blocks.layout import KVLayout
    from kvbm.integrations.vllm import ConnectorConfig, Geometry, Links, SchedulerSide

    links = Links(endpoint, Geometry(16, 4096, 1), engine, TIMEOUT_S,
                  lambda rank, k: KVLayout(model="outage-tp", num_layers=2, num_kv_heads=tp, head_size=32,
                                           dtype="float16", tp_rank=rank, tp_size=tp, tokens_per_block=16 * k,
                                           block_bytes=MiB))
    return SchedulerSide(ConnectorConfig.parse({"timeout_s": TIMEOUT_S, **cfg}), links, list(range(tp)))


def _store(daemon, layout, req) -> None:
    from kvbm.blocks import BlockKey

    keys = [BlockKey(layout.namespace, bytes(h)) for h in req.block_hashes]
    with daemon.client() as c:
        c.register(layout, worker_id=f"filler-r{layout.tp_rank}")
        assert c.store(keys, [np.zeros(4096, np.uint8)] * len(keys)).stored == len(keys)


def test_a_silent_daemon_never_holds_the_scheduler_and_every_rank_is_asked_at_once(daemon, caplog):
    """A daemon that stops answering (SIGSTOP: alive, silent; or a slow bucket probe) costs the scheduler
    nothing: the hook says "not known yet" at once, every TP rank's lookup is already on the wire (not one
    rank after another), and the answer comes when the daemon does, or is a miss after lookup_give_up_ms."""
    import signal

    sched = _scheduler(daemon.endpoint, "patient", 2, lookup_give_up_ms=60_000)
    quick = _scheduler(daemon.endpoint, "quick", 2, lookup_give_up_ms=300)
    try:
        # One block each: the daemon's G2 holds 4 (1 MiB slots) and has no lower tier.
        both, rank0_only = _request("both", 1, 100), _request("rank0", 1, 300)
        lay0, lay1 = sched.layouts()
        for lay in (lay0, lay1):
            _store(daemon, lay, both)
        _store(daemon, lay0, rank0_only)

        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert sched.get_num_new_matched_tokens(both, 0) == (None, False)
            assert time.monotonic() - t0 < HOOK_S
            # Rank 0's lookup is awaited, rank 1's was sent with it and waits for its reply.
            assert wait_until(lambda: sched._links[1].client is not None and sched._links[1].client._sent,
                              timeout=10), "rank 1's lookup was not sent while rank 0's reply was awaited"
            # A lookup nobody answers is a miss after lookup_give_up_ms: the request is computed.
            with caplog.at_level("WARNING", logger="kvbm.vllm"):
                got, longest = step_until_known(quick, _request("given-up", 1, 500))
            assert got == (0, False) and longest < HOOK_S
            # ... and said: an operator sees why a prompt kvbm holds was computed.
            assert "did not answer a lookup within 300 ms" in caplog.text
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        # Answered once the daemon runs again (or, silent past the heartbeat, the link went down and reconnects:
        # a later request of the same prompt hits).
        n = iter(range(1000))
        assert wait_until(lambda: step_until_known(sched, _request(f"both-{next(n)}", 1, 100))[0] == (16, False),
                          timeout=30)
        assert step_until_known(sched, rank0_only)[0] == (0, False)  # every rank must hold the prefix
    finally:
        sched.shutdown()
        quick.shutdown()


def test_pins_taken_before_a_daemon_restart_never_release_those_a_request_took_after_it(daemon):
    """A synchronous load's pins are released by the scheduler's session that took them. After the daemon was
    killed and restarted, that session registered again in place (the same client, a new token and pool): a
    request's Release of pins taken before the restart went out under the new registration and dropped the pins
    another request of the same prefix took after it, so the daemon could give those slots to other blocks before
    that request's step copied them (wrong KV). Pins are released only by the registration that took them."""
    sched = _scheduler(daemon.endpoint, "restart", 1, async_load=False)
    # No idle tick of the lookup thread between the kill and the next lookup (it would let the lost session go
    # and open a new one): the session registers again in place, as when the restart is quicker than that tick.
    sched._lookups.idle_s = 3600.0
    try:
        time.sleep(0.5)  # the thread's current idle wait (0.25 s) ends; it waits on the new one from then on
        (lay,) = sched.layouts()
        before = _request("before", 2, 700)
        _store(daemon, lay, before)
        sched.on_new_request(before)
        assert step_until_known(sched, before)[0] == (32, False)
        assert _stats(daemon)["daemon"]["pins"] == 2
        daemon.kill9()
        daemon.start()
        after = _request("after", 2, 700)  # the same prefix
        _store(daemon, lay, after)
        sched.on_new_request(after)
        assert step_until_known(sched, after)[0] == (32, False)
        assert _stats(daemon)["daemon"]["pins"] == 2
        sched.request_finished(before, [])  # its pins went with the daemon that held them
        time.sleep(1.0)  # the lookup thread's Releases are sent within a step or two
        assert _stats(daemon)["daemon"]["pins"] == 2, "a Release from before the restart dropped another's pins"
        sched.request_finished(after, [])
        assert wait_until(lambda: _stats(daemon)["daemon"]["pins"] == 0, timeout=10), "the pins were not released"
    finally:
        sched.shutdown()


def _mapped_deleted(shm_name: str) -> int:
    """This process's mappings of the pool ``shm_name`` once its file was removed (a dead daemon's pool)."""
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines()
               if shm_name in line and line.endswith("(deleted)"))


def test_an_idle_engines_sessions_unmap_a_dead_daemons_pool_so_its_memory_is_freed(daemon):
    """A killed daemon's G2 pool is removed by its restart, but its memory is freed only when nothing maps it. The
    worker's and the scheduler's sessions let go of it at their next request, and the engine's own session, which
    nothing uses after start-up under async loads, never did: every restart held a second pool for the engine's
    life (on a /dev/shm with room for one, the restart could never allocate its own). Now each session whose
    connection dropped lets it go within a step or an idle tick, with no request."""
    w = _worker(daemon.endpoint, 1, async_load=True, async_save=True)
    sched = _scheduler(daemon.endpoint, "idle", 1)
    try:
        w.loader._pool.submit(lambda: None).result(timeout=60)  # the loader's session (warm) is open
        assert step_until_known(sched, _request("warm", 1, 100))[0] == (0, False)  # the scheduler's link is up
        shm = w._link.client.registered.shm_name
        daemon.kill9()
        daemon.start()  # removes the dead daemon's pool file
        assert _mapped_deleted(shm) > 0  # the engine's session, at least, maps it still

        def freed() -> bool:
            w.handle_preemptions(None)  # the first hook of each engine step
            return _mapped_deleted(shm) == 0

        assert wait_until(freed, timeout=15), f"{_mapped_deleted(shm)} mappings of the dead daemon's pool left"
    finally:
        sched.shutdown()
        w.shutdown()


def test_a_sync_engines_mapping_of_a_restarted_daemons_pool_goes_when_that_daemon_goes_too(daemon):
    """Under synchronous loads (the CPU default) the loader's thread maps a restarted daemon's pool for the engine's
    copies. When that daemon went in turn, the mapping stayed until a hit on a newer pool (for good, with none)."""
    from test_vllm_connector import _empty_scheduler_output
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput

    from kvbm.integrations.vllm import ConnectorConfig, Geometry, Links, SchedulerSide

    w = _worker(daemon.endpoint, 1, async_load=False, async_save=True)
    sched = SchedulerSide(ConnectorConfig.parse({"timeout_s": TIMEOUT_S, "async_load": False}),
                          Links(daemon.endpoint, Geometry(16, 4096, 1), "outage-engine", TIMEOUT_S, _layout), [0])
    tries = iter(range(1000))

    def loaded() -> bool:
        """One request of one stored block, looked up, pinned and loaded as vLLM steps it: whether it loaded."""
        req = _request(f"after-{next(tries)}", 1, 2000)  # the same block every time
        sched.on_new_request(req)
        ok = step_until_known(sched, req)[0] == (16, False)
        if ok:
            sched.update_state_after_alloc(req, KVCacheBlocks(((KVCacheBlock(3),),)), 16)
            meta = sched.build_connector_meta(_empty_scheduler_output())
            w.handle_preemptions(meta)
            w.start_load_kv(meta)
            ok = not w.get_block_ids_with_load_errors()
            sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=w.worker_meta()))
        sched.request_finished(req, [])
        return ok

    try:
        daemon.kill9()
        daemon.start()
        _store_filled(daemon, w, _request("stored", 1, 2000), fill=40)
        # The first hit on the new daemon has its pool mapped on the loader's thread (and is recomputed); a later
        # one copies out of that mapping.
        assert wait_until(loaded, timeout=30), "no load from the restarted daemon"
        _assert_loaded(w, (3,), fill=40)
        (pool,) = w.loader.pools.mapped()
        daemon.kill9()
        daemon.start()
        assert _mapped_deleted(pool.shm_name) > 0

        def freed() -> bool:
            w.handle_preemptions(None)
            return _mapped_deleted(pool.shm_name) == 0

        assert wait_until(freed, timeout=15), f"{_mapped_deleted(pool.shm_name)} mappings of the dead pool left"
    finally:
        sched.shutdown()
        w.shutdown()


def test_the_schedulers_sessions_pin_without_mapping_the_pool(daemon):
    """The scheduler's sessions only look up and pin (the worker copies out of its own mapping): each mapped the
    whole G2 pool all the same, one mapping per TP rank in the engine's process, each registered with the CUDA
    driver on a GPU host (page-locking the pool again per rank). They name the pool's generation, unmapped."""
    sched = _scheduler(daemon.endpoint, "unmapped", 2)
    try:
        req = _request("pinned", 2, 700)
        for lay in sched.layouts():
            _store(daemon, lay, req)
        sched.on_new_request(req)
        assert step_until_known(sched, req)[0] == (32, False)
        assert _stats(daemon)["daemon"]["pins"] == 4  # two blocks on each rank
        for link in sched._links:
            c = link.client
            assert c.g2 is None and c.generation == c.registered.generation, c.generation
            maps = Path("/proc/self/maps").read_text()
            assert c.registered.shm_name not in maps, "a scheduler's session maps the G2 pool"
        sched.request_finished(req, [])
        assert wait_until(lambda: _stats(daemon)["daemon"]["pins"] == 0, timeout=10), "the pins were not released"
    finally:
        sched.shutdown()


def test_a_next_turn_waits_for_saves_in_flight_only_while_the_daemon_answers(daemon):
    """A next turn whose lookup stops right before a block this engine is still saving is asked again for up to
    ``save_wait_ms`` (the save lands meanwhile). A stopped daemon stores nothing meanwhile, yet each such
    request was held the whole ``save_wait_ms``, every lookup given up and asked again. Now an answer kvbm could
    not give (a lookup given up, a link down) is final: the request is computed at once."""
    import signal

    from kvbm.integrations.vllm import BlockTransfer

    sched = _scheduler(daemon.endpoint, "turns", 1, lookup_give_up_ms=300, save_wait_ms=60_000)
    try:
        turn = _request("next-turn", 2, 700)
        assert step_until_known(sched, _request("warm", 1, 900))[0] == (0, False)  # the link is up
        # The last turn's saves, as build_connector_meta plans them: the next turn's first block is in flight.
        sched._inflight.planned([BlockTransfer("last-turn", [bytes(turn.block_hashes[0])], [[0]])])
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            got, _ = step_until_known(sched, turn, steps=150)  # 150 steps: 1.5 s of forwards and more
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert got == (0, False)
        params = sched.request_finished(turn, [])[1] or {}
        assert params.get("kvbm", {}).get("waited_for_saves", 0) == 0, params
    finally:
        sched.shutdown()


def _answered(lookups) -> bool:
    """Whether every lookup the scheduler side queued has its answer."""
    return all(job.done.is_set() for job in lookups._jobs.values())


def test_requests_that_arrive_together_are_all_answered_in_the_step_that_reaches_them(tiny_model, daemon):
    """A lookup goes to the daemon when vLLM adds the request, so a burst of requests is answered for the
    step that first reaches it, not one request per step."""
    from test_vllm_connector import _empty_scheduler_output

    # The default lookup_wait_ms (2): before, a step's asks shared one 2 ms budget, so the first request's
    # lookup used it and the others of the same burst were "not known yet", each waiting for a later step.
    conn = scheduler_connector(tiny_model, {"daemon": daemon.endpoint})
    try:
        reqs = [stored_request(conn, daemon, f"burst-{i}", 1, 100 + 100 * i) for i in range(4)]
        for r in reqs:
            conn.on_new_request(r)  # vLLM's add_request, while the engine runs a step
        assert wait_until(lambda: _answered(conn.scheduler._lookups), timeout=30)
        # The next step schedules them: every one is known.
        assert [conn.get_num_new_matched_tokens(r, 0) for r in reqs] == [(16, False)] * 4
        conn.build_connector_meta(_empty_scheduler_output())
    finally:
        conn.shutdown()


def test_an_old_answer_is_asked_again_and_stands_while_the_daemon_is_silent(daemon):
    """A request that waited in vLLM's queue has its lookup asked again; a daemon silent by then leaves the
    earlier answer standing (a hit now, not a skipped step). For an async load: a sync load's hit must be pinned
    first, which a silent daemon does not do (``test_a_sync_load_copies_what_the_lookup_pinned...``)."""
    import signal

    sched = _scheduler(daemon.endpoint, "fresh", 1, async_load=True)
    try:
        req = _request("queued", 1, 700)
        (lay,) = sched.layouts()
        _store(daemon, lay, req)
        sched.on_new_request(req)
        assert wait_until(lambda: _answered(sched._lookups), timeout=30)
        sched._lookups.fresh_s = 0.05
        time.sleep(0.1)  # the request waited in vLLM's queue longer than an answer stays fresh
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert sched.get_num_new_matched_tokens(req, 0) == (16, True)
            assert time.monotonic() - t0 < HOOK_S
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        sched.shutdown()


def test_a_step_loading_more_blocks_than_g2_holds_loads_every_one(tmp_path):
    """A step's Onboards are pipelined, but the blocks they pin in G2 at once stay within the pool's room:
    three requests of two blocks each from G3 through a 4-slot G2 load whole (sent all at once, the third
    one's Onboard stopped short for want of unpinned slots and its blocks were recomputed)."""
    from test_vllm_e2e import free_port

    from kvbm.blocks import BlockKey
    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    cfg = daemon_cfg(tmp_path, free_port())
    cfg["disk"] = {"enabled": True, "dir": str(tmp_path / "g3"), "capacity": "64MiB"}
    daemon = ServeProc(tmp_path, cfg).start()
    w = _worker(daemon.endpoint, 1, async_load=False, async_save=False)
    try:
        lay = w._link.layout
        hashes = [bytes([i + 1]) * 32 for i in range(6)]
        blocks = [np.full(4096, i + 1, np.uint8) for i in range(6)]
        with daemon.client(admin=True) as c:
            c.register(lay, worker_id="filler")
            for i in range(0, 6, 2):  # two at a time: G2 holds four; each pair is written through to G3
                assert c.store([BlockKey(lay.namespace, h) for h in hashes[i : i + 2]], blocks[i : i + 2]).stored == 2
                assert wait_until(lambda n=i + 2: _tier_blocks(daemon, "G3") >= n, timeout=30)
            # Out of G2: every load comes up from the disk.
            c.evict(namespace=lay.namespace, tiers=["G2"])
            assert _tier_blocks(daemon, "G2") == 0
        loads = [BlockTransfer(f"r{i}", hashes[2 * i : 2 * i + 2], [[2 * i], [2 * i + 1]]) for i in range(3)]
        w.start_load_kv(KvbmConnectorMetadata(k=1, loads=loads))
        assert w.get_block_ids_with_load_errors() == set()
        for vb in range(6):  # every vLLM block holds its kvbm block's bytes
            assert all(int(t[vb][0]) == vb + 1 for _name, t, _dim, _group, _nbytes in w._cache.layers), vb
    finally:
        w.shutdown()
        daemon.stop()


def _tier_blocks(daemon, tier: str) -> int:
    return next(t["blocks"] for t in _stats(daemon)["tiers"] if t["tier"] == tier)


def test_a_load_that_raises_still_reports_every_request(tmp_path, monkeypatch):
    """Whatever goes wrong inside a step's loads, every request is reported (loaded or failed): an async load
    left unreported keeps its request in WAITING_FOR_REMOTE_KVS forever."""
    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata
    from kvbm.integrations.vllm.loads import Loader

    def boom(*_a, **_k):
        raise RuntimeError("test: an unexpected error in the loader")

    monkeypatch.setattr(Loader, "_pipeline", boom)
    w = _worker(f"ipc://{tmp_path}/nobody.sock", 1, async_load=True, async_save=True)
    try:
        meta = KvbmConnectorMetadata(k=1, loads=[BlockTransfer("a", [b"a" * 32], [[2]]),
                                                 BlockTransfer("b", [b"b" * 32], [[3]])])
        w.start_load_kv(meta)
        assert wait_until(lambda: w.get_finished(set())[1] >= {"a", "b"} or not w.loader._loading, timeout=10)
        assert not w.loader._loading
        assert w.get_block_ids_with_load_errors() == {2, 3}
    finally:
        w.shutdown()


def _connector_hook(w, hook: str, meta) -> float:
    """Seconds vLLM's call of the connector's ``hook`` holds the engine (through the real KvbmConnector method)."""
    from types import SimpleNamespace

    from kvbm.integrations.vllm import KvbmConnector

    t0 = time.monotonic()
    getattr(KvbmConnector, hook)(SimpleNamespace(worker=w, _get_connector_metadata=lambda: meta), meta)
    return time.monotonic() - t0


def test_a_stopped_daemon_never_holds_a_step_through_its_saves(daemon):
    """vLLM calls ``handle_preemptions`` before every forward. It used to wait for every save in flight, each a
    PrepareStore round trip: a SIGSTOPped daemon held each step until the request timed out. Now a step waits
    on nothing when nothing was preempted, and a preempted request's save whose copy had not started is staged
    (its blocks copied to host buffers before the forward reuses them), not waited for: it is stored once the
    daemon answers, with the bytes its blocks held, not the next forward's (it was dropped until round 14)."""
    import os
    import signal

    import torch

    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    w = _worker(daemon.endpoint, 1, async_load=False, async_save=True)
    caches = {f"layer.{i}": torch.full((8, 2048), 5, dtype=torch.uint8) for i in range(2)}
    w.register_kv_caches(caches)
    pid = daemon.proc.pid
    victim = b"v" * 32
    try:
        assert w._link.client is not None and w.geometry.k == 1
        os.kill(pid, signal.SIGSTOP)
        try:
            step = KvbmConnectorMetadata(k=1, saves=[BlockTransfer("r1", [b"s" * 32], [[1]]),
                                                     BlockTransfer("r2", [victim], [[2]])])
            w.wait_for_save(step)  # queued on the saver, whose PrepareStore the stopped daemon never answers
            time.sleep(0.2)
            quiet = KvbmConnectorMetadata(k=1)
            held_quiet = _connector_hook(w, "handle_preemptions", quiet)
            preempt = KvbmConnectorMetadata(k=1)
            preempt.preempted = ["r2"]  # set after construction: the same call shape for the old code
            held_preempt = _connector_hook(w, "handle_preemptions", preempt)
            for cache in caches.values():  # the forward: another request's KV in r2's freed block
                cache[2].fill_(9)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert held_quiet < HOOK_S / 2, f"a step with nothing preempted waited {held_quiet:.2f}s on a save"
        assert held_preempt < HOOK_S / 2, f"a step that preempted r2 waited {held_preempt:.2f}s on its save"
        _assert_saved(daemon, w, victim, 5, "the preempted request's save stored bytes the next forward wrote")
    finally:
        w.shutdown()


def _assert_saved(daemon, w, key: bytes, fill: int, why: str) -> None:
    """Once the worker's saves are over, the daemon holds ``key`` with its first vLLM block's bytes all ``fill``."""
    from kvbm.blocks import BlockKey

    assert wait_until(lambda: not w.saver.pending(), timeout=30)
    with daemon.client() as c:
        c.register(w._link.layout, worker_id="reader")
        buf = np.zeros(c.registered.slot_bytes, np.uint8)
        assert c.load([BlockKey(w._link.layout.namespace, key)], [buf]) == 1, f"not saved: {w.stats}"
    assert (buf[:4096] == fill).all(), why


def test_a_sync_save_copies_its_blocks_out_and_never_waits_on_a_stopped_daemon(daemon):
    """``async_save: false`` saved on the engine's thread, PrepareStore and CommitStore round trips included: a
    SIGSTOPped daemon held the step for the link's timeout (2 s in the verify harness, seed 5074). Now the step
    copies the saves' blocks out of vLLM's (staged) and the saver's thread writes them once the daemon answers:
    the step waits on nothing, and what is stored is what the blocks held then, not the next forward's bytes."""
    import os
    import signal

    import torch

    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    w = _worker(daemon.endpoint, 1, async_load=False, async_save=False)
    caches = {f"layer.{i}": torch.full((8, 2048), 5, dtype=torch.uint8) for i in range(2)}
    w.register_kv_caches(caches)
    w.saver._pool.submit(lambda: None).result(timeout=60)
    pid = daemon.proc.pid
    key = b"q" * 32
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            step = KvbmConnectorMetadata(k=1, saves=[BlockTransfer("r1", [key], [[3]])])
            t0 = time.monotonic()
            w.wait_for_save(step)
            held = time.monotonic() - t0
            for cache in caches.values():  # the next forward: another request's KV in that block
                cache[3].fill_(9)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert held < HOOK_S / 4, f"the step's sync save waited {held:.2f}s on the stopped daemon"
        _assert_saved(daemon, w, key, 5, "the sync save stored bytes the next forward wrote")
    finally:
        w.shutdown()


def test_a_sync_load_copies_what_the_lookup_pinned_and_never_waits_on_a_stopped_daemon(daemon):
    """A synchronous load (the CPU engine's default) runs on the engine's step, before the forward. It used to
    Onboard there: a daemon SIGSTOPped between the lookup and the step held that step for the link's timeout (10 s
    here, 2 s by default), and a hit from disk or S3 held it while the blocks came up. Now the scheduler's lookup
    thread pins the blocks before vLLM schedules the request (looked up at arrival, pinned when vLLM asks, at the
    default 2 ms wait), the load names their G2 slots, and the step only copies: the stored bytes, at memory speed,
    with the daemon stopped. The pins go once the worker says the step ran, or when the request goes unscheduled;
    a hit longer than the pin window (half of this 4-slot G2) pins its head and brings the rest up as before."""
    import os
    import signal

    from vllm.v1.outputs import KVConnectorOutput

    from kvbm.integrations.vllm import ConnectorConfig, Geometry, Links, SchedulerSide

    w = _worker(daemon.endpoint, 1, async_load=False, async_save=True)
    cfg = ConnectorConfig.parse({"timeout_s": TIMEOUT_S, "async_load": False})
    sched = SchedulerSide(cfg, Links(daemon.endpoint, Geometry(16, 4096, 1), "outage-engine", TIMEOUT_S, _layout),
                          [0])
    pid = daemon.proc.pid
    try:
        meta = _planned_load(daemon, w, sched, _request("pinned", 2, 700), (5, 6, 1), fill=10)
        (load,) = meta.loads
        assert len(load.pins[0][1]) == 2, f"the load names no pinned slots: {load}"
        assert _stats(daemon)["daemon"]["pins"] == 2
        os.kill(pid, signal.SIGSTOP)
        try:
            held = _connector_hook(w, "start_load_kv", meta)
            errors = w.get_block_ids_with_load_errors()
            done = w.worker_meta()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert held < HOOK_S / 4, f"the step's load waited {held:.2f}s on the stopped daemon"
        assert errors == set(), f"blocks {errors} did not load"
        _assert_loaded(w, (5, 6), fill=10)
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=done))
        assert wait_until(lambda: _stats(daemon)["daemon"]["pins"] == 0, timeout=10), "the pins were not released"

        gone = _request("gone", 2, 1300)
        _store_filled(daemon, w, gone, fill=30)
        sched.on_new_request(gone)
        assert step_until_known(sched, gone)[0] == (32, False)
        assert _stats(daemon)["daemon"]["pins"] == 2
        sched.request_finished(gone, [])  # it goes before vLLM scheduled it: its pins go too
        assert wait_until(lambda: _stats(daemon)["daemon"]["pins"] == 0, timeout=10), "the pins were not released"

        meta = _planned_load(daemon, w, sched, _request("longer", 3, 900), (2, 3, 4, 7), fill=20)
        assert len(meta.loads[0].pins[0][1]) == 2 and meta.loads[0].unpinned_rest  # the window's worth pinned
        w.start_load_kv(meta)
        assert w.get_block_ids_with_load_errors() == set()
        _assert_loaded(w, (2, 3, 4), fill=20)
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=w.worker_meta()))
        assert wait_until(lambda: _stats(daemon)["daemon"]["pins"] == 0, timeout=10), "the pins were not released"
    finally:
        sched.shutdown()
        w.shutdown()


def _store_filled(daemon, w, req, fill: int) -> None:
    """Store ``req``'s kvbm blocks (k = 1) under the worker's layout, block i filled with ``fill + i``."""
    from kvbm.blocks import BlockKey

    n = len(req.block_hashes)
    lay = w._link.layout
    with daemon.client() as c:
        c.register(lay, worker_id="filler")
        keys = [BlockKey(lay.namespace, bytes(h)) for h in req.block_hashes]
        assert c.store(keys, [np.full(4096, fill + i, np.uint8) for i in range(n)]).stored == n


def _planned_load(daemon, w, sched, req, block_ids: tuple[int, ...], fill: int):
    """Store ``req``'s blocks and plan its load onto ``block_ids`` through the scheduler side, as vLLM does (looked
    up at arrival, asked once per step until known, allocated): the step's metadata."""
    from test_vllm_connector import _empty_scheduler_output
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    _store_filled(daemon, w, req, fill)
    n = len(req.block_hashes)
    sched.on_new_request(req)
    assert step_until_known(sched, req)[0] == (16 * n, False)
    sched.update_state_after_alloc(req, KVCacheBlocks((tuple(KVCacheBlock(i) for i in block_ids),)), 16 * n)
    return sched.build_connector_meta(_empty_scheduler_output())


def _assert_loaded(w, block_ids: tuple[int, ...], fill: int) -> None:
    for i, vb in enumerate(block_ids):  # every vLLM block holds its kvbm block's bytes
        assert all(bool((t[vb] == fill + i).all()) for _name, t, _dim, _group, _nbytes in w._cache.layers), vb


def test_a_burst_of_lookups_beyond_the_daemons_in_flight_cap_is_answered_not_a_broken_link(tmp_path, s3_server):
    """320 requests sharing a system prompt arrive while the lookup thread waits on a reply: the next batch
    held them all. Sent at once, they passed the daemon's cap on one session's requests in flight (256); its
    refusals were taken for a broken link, so every answer was a miss and the link was dropped. Batches are
    now sent in rounds below the cap: every request hits and the link stays up. S3 on: a lookup then asks
    the bucket about blocks no local tier holds, so lookups are in flight in the daemon, not answered inline."""
    import signal
    import uuid

    from test_vllm_e2e import Daemon

    daemon = Daemon(tmp_path, s3_server, f"kvbm-burst-{uuid.uuid4().hex[:8]}", block_bytes="1MiB").start()
    sched = _scheduler(daemon.endpoint, "burst", 1, lookup_give_up_ms=60_000)
    try:
        (lay,) = sched.layouts()
        _store(daemon, lay, _request("system", 1, 900))
        # A system prompt block every request shares, then a block of its own that no tier holds.
        reqs = [_request(f"burst-{i}", 2, 900) for i in range(320)]
        for i, r in enumerate(reqs):
            r.block_hashes[1] = bytes([i % 256, i // 256]) * 16
        daemon.proc.send_signal(signal.SIGSTOP)  # the thread's first lookup waits, the others queue up
        try:
            sched.on_new_request(reqs[0])
            time.sleep(0.05)
            for r in reqs[1:]:
                sched.on_new_request(r)
            time.sleep(0.2)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: _answered(sched._lookups), timeout=60)
        got = [sched._lookups._jobs[r.request_id].matched for r in reqs]
        assert got == [1] * len(reqs), f"{got.count(0)} of {len(reqs)} lookups were answered as misses"
        assert not sched._links[0].degraded, sched._links[0].degraded_reason
    finally:
        sched.shutdown()
        daemon.stop()


def test_lookups_refused_busy_are_asked_again_not_answered_as_misses(tmp_path, s3_server):
    """40 requests arrive together against a daemon that lets one client have 8 requests in flight (a tenant's
    cap that its sessions share, a burst): the lookups past the cap were refused ``busy``, and each refusal was a
    final miss, so those requests recomputed what kvbm held. They are asked again after a short backoff within
    the lookup's budget: every request hits. S3 on, so lookups are in flight in the daemon (a bucket probe)."""
    import uuid

    from test_vllm_e2e import Daemon

    daemon = Daemon(tmp_path, s3_server, f"kvbm-busy-{uuid.uuid4().hex[:8]}", block_bytes="1MiB",
                    max_inflight_per_client=8).start()
    sched = _scheduler(daemon.endpoint, "busy", 1, lookup_give_up_ms=60_000)
    try:
        (lay,) = sched.layouts()
        _store(daemon, lay, _request("system", 1, 700))
        reqs = [_request(f"busy-{i}", 2, 700) for i in range(40)]
        for i, r in enumerate(reqs):
            r.block_hashes[1] = bytes([i, 7]) * 16  # a block no tier holds: the daemon probes the bucket for it
        for r in reqs:
            sched.on_new_request(r)
        assert wait_until(lambda: _answered(sched._lookups), timeout=60)
        got = [sched._lookups._jobs[r.request_id].matched for r in reqs]
        assert got == [1] * len(reqs), f"{got.count(0)} of {len(reqs)} lookups were answered as misses"
        assert not sched._links[0].degraded, sched._links[0].degraded_reason
    finally:
        sched.shutdown()
        daemon.stop()


def test_an_unexpected_error_while_connecting_is_a_miss_and_the_lookup_thread_lives(daemon, monkeypatch):
    """Anything a connection attempt raises besides the daemon's own errors (a ZeroMQ EMFILE, a KeyError in
    the geometry, a G2 attach error) used to escape ``Link.get`` and end the lookup thread without a word:
    every later request then waited out lookup_give_up_ms and missed, forever. It is a miss now, the link
    retries, and hits come back once the fault is gone."""
    from kvbm.integrations.vllm import link as link_mod

    sched = _scheduler(daemon.endpoint, "faulty", 1, lookup_give_up_ms=60_000)
    try:
        (lay,) = sched.layouts()
        _store(daemon, lay, _request("stored", 1, 1100))
        sched._links[0].fail(RuntimeError("test: reconnect"))  # the next lookup connects again
        sched._links[0].down_until = 0.0
        real = link_mod.daemon_block_bytes

        def broken(_client):
            raise KeyError("test: a geometry bug")

        monkeypatch.setattr(link_mod, "daemon_block_bytes", broken)
        first = _request("while-broken", 1, 1100)
        sched.on_new_request(first)
        assert wait_until(lambda: _answered(sched._lookups), timeout=30), "the lookup thread died"
        assert sched._lookups._jobs[first.request_id].matched == 0
        monkeypatch.setattr(link_mod, "daemon_block_bytes", real)
        n = iter(range(1000))
        assert wait_until(lambda: step_until_known(sched, _request(f"after-{next(n)}", 1, 1100))[0] == (16, False),
                          timeout=30)
    finally:
        sched.shutdown()


def test_a_save_bigger_than_the_sessions_slot_budget_goes_in_reservations_that_fit(tmp_path):
    """The daemon states each session's slot budget (``Registered.session_slots``) and refuses a PrepareStore
    beyond it (``full``). A long prompt's save (more kvbm blocks than the budget) was one PrepareStore, refused
    whole: nothing of it was stored. It goes in reservations of at most the budget now, and every block lands."""
    from test_vllm_e2e import free_port

    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    cfg = daemon_cfg(tmp_path, free_port())
    cfg["host"]["capacity"] = "8MiB"
    cfg["daemon"]["max_session_slots"] = 3
    daemon = ServeProc(tmp_path, cfg).start()
    w = _worker(daemon.endpoint, 1, async_load=False, async_save=False)
    try:
        assert w._link.client.registered.session_slots == 3
        hashes = [bytes([0x40 + i]) * 32 for i in range(7)]
        w.wait_for_save(KvbmConnectorMetadata(k=1, saves=[BlockTransfer("long", hashes, [[i] for i in range(7)])]))
        assert wait_until(lambda: not w.saver.pending(), timeout=30)  # staged in the step, written by the saver
        with daemon.client() as c:
            c.register(w._link.layout, worker_id="reader")
            assert c.lookup(hashes).matched == 7, "the save was refused whole"
    finally:
        w.shutdown()
        daemon.stop()


def test_sync_hits_beyond_g2s_pin_room_wait_for_it_and_load_whole_on_a_slow_engine(tmp_path):
    """Three requests of two blocks each from G3 arrive together at a 4-slot G2 that another engine pins a slot of:
    the first is pinned, the second pins one block of two (the pool is full), the third is refused (the session's
    budget is), until the steps that copy the ones before them have run. With steps longer than half the
    lookup's give-up (a CPU engine's 0.4 s forward), the third was answered with what it had pinned (nothing) and
    its whole prompt computed (issue 40's long-doc-qa: 512 of 3,968 tokens cached, TTFT 4.5 s). It now waits for
    the room, counted in the engine's steps, and loads whole."""
    from dataclasses import replace

    from test_vllm_connector import _empty_scheduler_output
    from test_vllm_e2e import free_port
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput

    from kvbm import protocol as p
    from kvbm.integrations.vllm import ConnectorConfig, Geometry, Links, SchedulerSide

    cfg = daemon_cfg(tmp_path, free_port())
    cfg["disk"] = {"enabled": True, "dir": str(tmp_path / "g3"), "capacity": "64MiB"}
    daemon = ServeProc(tmp_path, cfg).start()
    w = _worker(daemon.endpoint, 1, async_load=False, async_save=True)
    sched = SchedulerSide(ConnectorConfig.parse({"timeout_s": TIMEOUT_S, "async_load": False}),
                          Links(daemon.endpoint, Geometry(16, 4096, 1), "outage-engine", TIMEOUT_S, _layout), [0])
    try:
        reqs = [_request(f"doc{i}", 2, 3000 + 100 * i) for i in range(3)]
        for i, req in enumerate(reqs):
            _store_filled(daemon, w, req, fill=10 * (i + 1))
            assert wait_until(lambda n=2 * i + 2: _tier_blocks(daemon, "G3") >= n, timeout=30)
        holder = _request("holder", 1, 5000)
        _store_filled(daemon, w, holder, fill=90)
        with daemon.client(admin=True) as c:
            c.register(w._link.layout, worker_id="evictor")
            c.evict(namespace=w._link.layout.namespace, tiers=["G2"])  # every hit comes up from the disk
        assert _tier_blocks(daemon, "G2") == 0
        other = daemon.client()  # another engine pins one slot throughout: the pool, not the budget, runs short
        other.register(w._link.layout, worker_id="other-engine")
        assert other.request(p.Onboard(namespace=other.namespace, hashes=[bytes(holder.block_hashes[0])]),
                             p.Onboarded).count == 1
        for req in reqs:
            sched.on_new_request(req)
        answers: dict[str, tuple] = {}
        for _step in range(40):
            scheduled = []
            for i, req in enumerate(reqs):
                if req.request_id in answers:
                    continue
                got = sched.get_num_new_matched_tokens(req, 0)
                if got[0] is None:
                    continue  # skipped this step, as vLLM does
                answers[req.request_id] = got
                ids = (2 * i, 2 * i + 1)
                sched.update_state_after_alloc(req, KVCacheBlocks((tuple(KVCacheBlock(b) for b in ids),)), got[0])
                scheduled.append((i, ids))
            # A step that runs tokens (the ones before it: copying their pins is what frees room).
            meta = sched.build_connector_meta(replace(_empty_scheduler_output(), total_num_scheduled_tokens=1))
            w.start_load_kv(meta)
            assert w.get_block_ids_with_load_errors() == set()
            for i, ids in scheduled:  # what each hit said is loaded, with the stored bytes
                _assert_loaded(w, ids[: answers[reqs[i].request_id][0] // 16], fill=10 * (i + 1))
            time.sleep(0.4)  # the step's forward on a slow CPU
            sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=w.worker_meta()))
            if len(answers) == len(reqs):
                break
        assert answers == {r.request_id: (32, False) for r in reqs}, f"a hit was answered short: {answers}"
        assert wait_until(lambda: _stats(daemon)["daemon"]["pins"] == 1, timeout=10), "the pins were not released"
        other.close()
    finally:
        sched.shutdown()
        w.shutdown()
        daemon.stop()
