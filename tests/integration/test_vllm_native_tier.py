"""kvbm as a secondary tier of vLLM's native offloading, under vLLM's real ``TieringOffloadingSpec`` /
``TieringOffloadingManager`` (CPU primary tier in vLLM's own shared memory) and a real ``kvbm serve``.

vLLM's ``CPUOffloadingWorker`` copies only between CUDA tensors and the primary tier (it asserts
``gpu_tensor.is_cuda or gpu_tensor.is_xpu``), so the harness (:mod:`kvbm.bench.native`) writes and reads the
primary rows where that worker's DMA would; everything from the primary tier down is vLLM's and kvbm's code.

Deadlines are an order of magnitude above a healthy run and below the tier's request timeout
(``timeout_s`` = 10 s): a hook that waited on a silent daemon would take that long.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest
from needs import needs
from serve_proc import ServeProc, wait_until

pytestmark = needs("vllm", importlib.util.find_spec("vllm") is not None,
                   "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")
TIMEOUT_S = 10.0
HOOK_S = 1.0  # far above one scheduler hook's healthy cost, far below TIMEOUT_S
GIVE_UP_MS = 300.0
STORES = "vllm:kvbm_tier_stores_dropped"


def daemon_cfg(tmp: Path, port: int, block_bytes: str = "16KiB", disk: bool = False) -> dict:
    return {"block_bytes": block_bytes, "device": {"enabled": False}, "host": {"capacity": "1MiB"},
            "disk": {"enabled": disk, "dir": str(tmp / "disk"), "capacity": "8MiB", "o_direct": False},
            "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
            "daemon": {"endpoint": f"tcp://127.0.0.1:{port}", "events_endpoint": f"ipc://{tmp}/ev.sock",
                       "metrics_port": -1}}


@pytest.fixture
def daemon(tmp_path):
    from test_vllm_e2e import free_port

    d = ServeProc(tmp_path, daemon_cfg(tmp_path, free_port())).start()
    yield d
    if d.proc is not None and d.proc.poll() is None:
        os.kill(d.proc.pid, signal.SIGCONT)
    d.stop()


def tier(daemon: ServeProc, **kw) -> dict:
    from kvbm.bench.native import KVBM_TIER

    return {**KVBM_TIER, "daemon": daemon.endpoint, "timeout_s": TIMEOUT_S, "lookup_give_up_ms": GIVE_UP_MS,
            "enable_kv_events": True, **kw}


def engine(*tiers: dict, **kw):
    from kvbm.bench.native import NativeEngine, offloading_config

    return NativeEngine(offloading_config(list(tiers), **kw))


def exact(eng, keys) -> bool:
    from kvbm.bench.native import chunk_bytes_of

    return all((got == chunk_bytes_of(k, eng.row_bytes)).all() for got, k in zip(eng.read(keys), keys, strict=True))


def counter(stats: dict, name: str, label: str = "") -> float:
    return sum(v for k, v in stats.items() if k.startswith(name) and label in k)


def test_stored_chunks_survive_an_engine_restart_and_load_byte_exact(daemon):
    from kvbm.bench.native import chunk_keys

    keys = chunk_keys(6, "restart")
    a = engine(tier(daemon, stats_interval_s=0.2))
    try:
        assert a.store(keys) == 6
        a.settle()
        stats = a.stats()
        assert counter(stats, "vllm:kv_offload_tiering_write_bytes", "KvbmTier") == 6 * a.row_bytes
        assert stats["vllm:kvbm_tier_daemon_up"] == 1
        # kvbm's own per-tier figures, read from the daemon in the background.
        g2 = "vllm:kvbm_tier_daemon_blocks:('G2',)"
        assert wait_until(lambda: a.stats().get(g2, 0) >= 6, timeout=30)
        kvbm_events = [e for e in a.events() if e.ownership == "kvbm"]
        assert [k for e in kvbm_events for k in e.keys] == keys and not kvbm_events[0].removed
    finally:
        a.shutdown()

    # A new engine (vLLM's own CPU tier starts empty): every chunk is a kvbm hit, promoted and byte-exact.
    b = engine(tier(daemon))
    try:
        results, _, _ = b.lookup(keys)
        assert results == ["HIT"] * 6
        assert exact(b, keys)
        b.finish()
        stats = b.stats()
        assert counter(stats, "vllm:kv_offload_tiering_chunk_hits", "KvbmTier") == 6
        assert counter(stats, "vllm:kv_offload_tiering_read_bytes", "KvbmTier") == 6 * b.row_bytes
        # After vLLM's reset_cache (what reset_prefix_cache does to the CPU tier) they come from kvbm again.
        b.reset_primary()
        assert b.lookup(keys)[0] == ["HIT"] * 6 and exact(b, keys)
        b.finish()
    finally:
        b.shutdown()


def test_chunks_the_daemon_evicts_become_block_removed_events(daemon):
    from kvbm.bench.native import chunk_keys

    # G2 holds 64 chunks and there is no disk tier: storing 96 evicts the oldest from the daemon for good.
    a = engine(tier(daemon, events_endpoint=f"ipc://{daemon.tmp}/ev.sock"), cpu_bytes=2 << 20)
    try:
        time.sleep(0.5)  # the events subscription is up (a late one only misses removals)
        keys = chunk_keys(96, "evicted")
        for i in range(0, 96, 8):
            a.store(keys[i : i + 8])
            a.settle()
        stored, removed = [], []

        def removals() -> bool:
            for e in a.events():
                if e.ownership == "kvbm":
                    (removed if e.removed else stored).extend(e.keys)
            return len(removed) >= 32

        assert wait_until(removals, timeout=30), (len(stored), len(removed))
        assert set(removed) <= set(keys[:64]) and len(set(removed)) == len(removed), "removed what was not evicted"
        assert stored == keys
        a.reset_primary()  # vLLM's CPU tier forgets them too: a removed chunk is a miss, a kept one a hit
        assert a.lookup([removed[0]])[0] == ["MISS"]
        a.finish()
        assert a.lookup([keys[-1]])[0] == ["HIT"]
        a.finish()
    finally:
        a.shutdown()


def test_two_engines_on_one_node_share_chunks(daemon):
    from kvbm.bench.native import chunk_keys

    keys = chunk_keys(4, "shared")
    a, b = engine(tier(daemon)), engine(tier(daemon))
    try:
        a.store(keys)
        a.settle()
        assert b.lookup(keys)[0] == ["HIT"] * 4 and exact(b, keys)
        b.finish()
        # And a chunk b computed is a's hit.
        more = chunk_keys(2, "from-b")
        b.store(more)
        b.settle()
        assert a.lookup(more)[0] == ["HIT"] * 2 and exact(a, more)
        a.finish()
    finally:
        a.shutdown()
        b.shutdown()


def stores_and_hits(e, keys) -> bool:
    """Store ``keys`` through engine ``e`` and look them up with its primary tier emptied: whether both hit."""
    e.store(keys)
    e.settle()
    e.reset_primary()
    ok = e.lookup(keys)[0] == ["HIT"] * len(keys)
    e.finish()
    return ok


def stored_by_another_engine(daemon, keys) -> None:
    """``keys`` stored (and settled) by an engine of its own, shut down before the test's engine starts."""
    a = engine(tier(daemon))
    try:
        a.store(keys)
        a.settle()
    finally:
        a.shutdown()


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_a_killed_daemon_means_misses_dropped_stores_and_failed_loads_never_an_exception(daemon):
    from kvbm.bench.native import chunk_keys

    keys = chunk_keys(3, "killed")
    stored_by_another_engine(daemon, keys)
    b = engine(tier(daemon))
    try:
        # The tier answered HIT, the promotion is queued for the end of the step, and the daemon dies.
        ctx = b._ctx()
        b._open = ctx
        wait_until(lambda: b.manager.lookup(keys[0], ctx).name == "HIT_PENDING" or b.step(), timeout=30)
        daemon.kill9()
        # The load is reported failed (vLLM recomputes): the key is a miss, not a promotion again and again.
        got = wait_until(lambda: b.step() or b.manager.lookup(keys[0], ctx).name == "MISS", timeout=5 * HOOK_S)
        assert got, "a load from a dead daemon was not reported failed"
        b.finish()
        assert counter(b.stats(), "vllm:kv_offload_tiering_promotion_job_failures", "KvbmTier") == 1

        # Lookups of chunks the daemon held: misses, within a step or two, each hook at once.
        results, took = _timed(b.lookup, keys[1:])
        assert results[0] == ["MISS", "MISS"] and took < HOOK_S, (results, took)
        b.finish()
        # Stores: dropped and counted, each submit at once.
        new = chunk_keys(3, "while-dead")
        _, took = _timed(b.store, new)
        assert took < HOOK_S
        b.settle(timeout_s=TIMEOUT_S / 2)
        assert counter(b.stats(), STORES) >= 1

        # An engine started while the daemon is dead starts (vLLM never sees an exception) and misses.
        c, took = _timed(engine, tier(daemon))
        try:
            assert took < TIMEOUT_S
            assert c.lookup(keys)[0] == ["MISS"] * 3
            c.finish()
        finally:
            c.shutdown()

        # The daemon is back (empty): the tier reconnects on its own and stores and hits resume.
        daemon.start()
        after = chunk_keys(2, "after")

        assert wait_until(lambda: stores_and_hits(b, after), timeout=30, step=0.5), "no hit after the daemon came back"
    finally:
        b.shutdown()


def test_a_stalled_daemon_means_misses_within_the_bound_and_dropped_stores(daemon):
    from kvbm.bench.native import chunk_keys

    keys = chunk_keys(3, "stalled")
    a = engine(tier(daemon, max_queued_stores=2))
    try:
        a.store(keys)
        a.settle()
        a.reset_primary()
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        # Chunks the daemon holds, asked while it answers nothing: misses once lookup_give_up_ms has passed.
        results, took = _timed(a.lookup, keys)
        a.finish()
        assert results[0] == ["MISS"] * 3, results
        assert took < GIVE_UP_MS / 1000 + HOOK_S, f"the lookups resolved after {took:.3f}s"
        # Stores while it is stopped: every submit returns at once; beyond the queue they are dropped.
        longest = 0.0
        for i in range(6):
            _, took = _timed(a.store, chunk_keys(2, f"stalled-{i}"))
            longest = max(longest, took)
        assert longest < HOOK_S, f"a store took {longest:.3f}s"
        a.settle(timeout_s=TIMEOUT_S)
        stats = a.stats()
        assert counter(stats, "vllm:kvbm_tier_lookups_gave_up") >= 1
        assert counter(stats, STORES) >= 1, stats
        # Shutdown (drain_jobs included) while it is still stopped: clean, and vLLM's shared memory unmapped.
        region = a.spec._scheduler_mmap
        mm = region.mmap_obj
        _, took = _timed(a.shutdown)
        assert took < TIMEOUT_S
        assert mm.closed, "vLLM's primary-tier mmap is still exported after shutdown"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        if hasattr(a, "rows"):
            a.shutdown()


def test_a_chunk_bigger_than_the_daemons_blocks_is_named_and_kvbm_stays_off(tmp_path, caplog):
    from test_vllm_e2e import free_port

    from kvbm.bench.native import chunk_keys

    d = ServeProc(tmp_path, daemon_cfg(tmp_path, free_port(), block_bytes="4KiB")).start()
    try:
        with caplog.at_level("WARNING", logger="kvbm.vllm"):
            a = engine(tier(d))
        try:
            assert "more than the daemon's block_bytes of 4096 B" in caplog.text, caplog.text
            a.store(chunk_keys(2, "big"))
            a.settle()
            assert counter(a.stats(), STORES, "down") >= 1
            assert a.lookup(chunk_keys(2, "big"))[0][0] == "HIT"  # vLLM's own CPU tier still has them
            a.finish()
        finally:
            a.shutdown()
    finally:
        d.stop()


def test_the_namespace_is_the_chunk_layout_and_never_the_connectors():
    from kvbm.bench.native import offloading_config
    from kvbm.integrations.vllm.native_keys import BACKEND_PREFIX, kvbm_hash, native_layout

    base = native_layout(offloading_config([]), 8192)
    assert base.backend.startswith(BACKEND_PREFIX) and base.block_nbytes <= 8192
    assert native_layout(offloading_config([]), 8192).namespace == base.namespace  # stable across engines
    for other in (native_layout(offloading_config([], model="other"), 8192),
                  native_layout(offloading_config([], tokens_per_block=32), 8192),
                  native_layout(offloading_config([]), 12288)):
        assert other.namespace != base.namespace
    key = bytes(range(32)) + (0).to_bytes(4, "big")
    assert kvbm_hash(key) == bytes(range(32))  # group 0: vLLM's block hash, as kvbm's connector keys blocks
    g1 = bytes(range(32)) + (1).to_bytes(4, "big")
    assert kvbm_hash(g1) != kvbm_hash(key) and len(kvbm_hash(g1)) == 32


def test_reset_cache_with_stores_in_flight_drains_every_job(daemon):
    from kvbm.bench.native import chunk_keys

    # vLLM's reset_cache calls drain_jobs, collects the finished jobs and asserts none is left in flight.
    a = engine(tier(daemon, max_queued_stores=1000), cpu_bytes=4 << 20)
    try:
        keys = chunk_keys(200, "drain")
        for i in range(0, 200, 2):
            a.store(keys[i : i + 2])  # 100 store jobs queued behind the store thread
        a.reset_primary()
        assert not a.manager._jobs and not a.manager.has_pending_work()
        stats = a.stats()
        done = counter(stats, "vllm:kv_offload_tiering_write_bytes", "KvbmTier") / a.row_bytes
        failed = counter(stats, "vllm:kv_offload_tiering_cascade_job_failures", "KvbmTier")
        assert done + 2 * failed == 200, (done, failed)  # each job stored, or reported failed (not run)
    finally:
        a.shutdown()


def test_vllms_backpressure_detector_sees_the_tiers_stores_and_drops_them(daemon):
    from kvbm.bench.native import chunk_keys

    # Water marks no store can meet: after the warm-up the detector is under pressure and vLLM's manager drops
    # stores to this tier (never a stalled step), counted by vLLM's own metric.
    bp = {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy", "high_water_s": 1e-12,
          "low_water_s": 1e-12, "warmup_completions": 2}
    a = engine(tier(daemon, backpressure=bp))
    try:
        for i in range(8):
            a.store(chunk_keys(1, f"bp-{i}"))
            a.settle()
        stats = a.stats()
        assert counter(stats, "vllm:kv_offload_tiering_backpressure_stores_dropped", "KvbmTier") >= 1, stats
        assert counter(stats, "vllm:kv_offload_tiering_write_bytes", "KvbmTier") >= 2 * a.row_bytes
    finally:
        a.shutdown()


def test_the_tier_reads_the_daemon_endpoint_from_a_kvbm_config(tmp_path):
    import json

    from kvbm.errors import ConfigError
    from kvbm.integrations.vllm.native_config import NativeTierConfig

    path = tmp_path / "kvbm.yaml"
    path.write_text(json.dumps({"daemon": {"endpoint": "tcp://127.0.0.1:5999"}}))
    assert NativeTierConfig.parse({"kvbm_config": str(path)}).client()[0] == "tcp://127.0.0.1:5999"
    with pytest.raises(ConfigError, match=r"secondary_tiers\[kvbm\]\.daemon and kvbm_config"):
        NativeTierConfig.parse({"kvbm_config": str(path), "daemon": "tcp://x:1"})


def test_the_documented_transfer_config_resolves_to_vllms_spec_and_kvbms_tier():
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvbm.integrations.vllm.native_config import kv_transfer_config
    from kvbm.integrations.vllm.native_tier import STORES_DROPPED, KvbmTier

    ktc = KVTransferConfig(**kv_transfer_config(1 << 30, daemon="tcp://127.0.0.1:5557"))
    extra = ktc.kv_connector_extra_config
    assert ktc.kv_connector == "OffloadingConnector"
    assert OffloadingSpecFactory.get_spec_cls(extra) is TieringOffloadingSpec
    assert SecondaryTierFactory.get_tier_class(extra["secondary_tiers"][0]) is KvbmTier
    # vLLM's Prometheus side asks the spec for every metric it may see, kvbm's tier's included.
    assert STORES_DROPPED in TieringOffloadingSpec.build_metric_definitions(extra)


def test_a_bad_tier_key_is_an_error_naming_it():
    from kvbm.errors import ConfigError
    from kvbm.integrations.vllm.native_config import NativeTierConfig

    with pytest.raises(ConfigError, match=r"secondary_tiers\[kvbm\]\.deamon: unknown key.*daemon"):
        NativeTierConfig.parse({"deamon": "tcp://x:1"})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[kvbm\]\.lookup_give_up_ms"):
        NativeTierConfig.parse({"lookup_give_up_ms": -1})


def test_bench_native_compares_kvbm_and_fs_under_the_same_manager(tmp_path):
    import json

    from click.testing import CliRunner

    from kvbm.cli.bench import bench

    out = tmp_path / "native.json"
    res = CliRunner().invoke(bench, ["native", "--chunk-size", "64KiB", "--chunks", "8", "--repeats", "1",
                                     "--workdir", str(tmp_path), "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "hit: daemon restart" in res.output
    report = json.loads(out.read_text())
    rows = {r["tier"]: r for r in report["rows"]}
    assert set(rows) == {"kvbm", "fs"}
    for r in rows.values():
        assert r["engine_restart_hit"] == 1.0 and r["other_engine_hit"] == 1.0, r
        assert r["store_GBps"] > 0 and r["engine_restart_load_GBps"] > 0 and r["store_failures"] == 0, r
    assert rows["kvbm"]["daemon_restart_hit"] == 1.0 and rows["fs"].get("daemon_restart_hit") is None
    bad = CliRunner().invoke(bench, ["native", "--tiers", "kvbm,s3"])
    assert bad.exit_code != 0 and "--tiers" in bad.output


# -- vLLM's own offloading scheduler (OffloadingConnector, SCHEDULER role) over a hybrid model -----------------
def hybrid_connector(model: str, daemon: ServeProc, **tier_kw):
    """vLLM's ``OffloadingConnector`` as its EngineCore builds it, for a model with a full-attention group (0)
    and a sliding-window group (1, a one-chunk window): its scheduler orders the lookups, not this test."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvbm.integrations.vllm.native_config import kv_transfer_config

    keys = {"daemon": daemon.endpoint, "timeout_s": TIMEOUT_S, "lookup_give_up_ms": 5000.0, **tier_kw}
    ktc = KVTransferConfig(**kv_transfer_config(1 << 20, **keys))
    cfg = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=4096, block_size=16,
                     kv_transfer_config=ktc).create_engine_config()
    spec = {"block_size": 16, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**spec)),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], SlidingWindowSpec(**spec, sliding_window=16))])
    return OffloadingConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config=kv)


def _request(rid: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=kcu.get_request_block_hasher(16, fn))


def _matched(conn, req, timeout_s: float = 60.0) -> int:
    """vLLM's scheduler asking ``get_num_new_matched_tokens`` once a step until it answers (the step's end is
    the manager's ``on_schedule_end``, as ``build_connector_meta`` calls it)."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    deadline = time.monotonic() + timeout_s
    while True:
        got, _ = conn.get_num_new_matched_tokens(req, 0)
        if got is not None or time.monotonic() > deadline:
            return got
        conn.scheduler.manager.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.001)


def test_a_hybrid_models_window_hits_are_answered_in_vllms_own_lookup_order(daemon, tiny_model):
    """vLLM's scheduler asks the full-attention keys in prefix order, then the sliding-window keys from the
    end backwards, in one batch per request. A prompt that extends a stored one (a conversation's next turn):
    the sliding-window chunks the daemon holds come after the new, unheld ones in that batch."""
    from vllm.v1.kv_offload.base import make_offload_key

    from kvbm.bench.native import chunk_bytes_of

    conn = hybrid_connector(tiny_model, daemon)
    s = conn.scheduler
    eng = _engine_of(s.manager)
    tier_ = s.manager.secondary_tiers[0]
    asked: list[list[bytes]] = []
    batch_lookup = tier_._lookups.batch_lookup
    tier_._lookups.batch_lookup = lambda keys, ctx: (asked.append(list(keys)), batch_lookup(keys, ctx))[1]
    try:
        first = _request("turn-1", list(range(1000, 1065)))  # 4 chunks of 16 tokens (+1)
        held = [make_offload_key(h, g) for g in (0, 1) for h in first.block_hashes[:4]]
        assert eng.store(held) == 8
        eng.settle()
        s.manager.reset_cache()  # vLLM's CPU tier forgets them (reset_prefix_cache): only kvbm has them

        nxt = _request("turn-2", list(range(1000, 1065)) + list(range(3000, 3064)))  # 8 chunks (+1)
        conn.on_new_request(nxt)
        got = _matched(conn, nxt)
        fa = [make_offload_key(h, 0) for h in nxt.block_hashes[:8]]
        sw = [make_offload_key(h, 1) for h in nxt.block_hashes[:8]]
        assert asked and asked[0] == fa + sw[::-1], "not vLLM's lookup order (full attention, then windows back)"
        assert got == 64, f"vLLM matched {got} tokens of the 64 kvbm holds in both groups"
        # What vLLM loads (the full-attention prefix, the window at its end) was promoted byte-exact.
        loads, ctx = [*fa[:4], sw[3]], s._req_status["turn-2"].req_context
        assert [s.manager.primary_tier.lookup(k, ctx).name for k in loads] == ["HIT"] * 5
        cids = s.manager.prepare_load(loads, ctx).chunk_ids
        assert all((eng.rows[int(c)] == chunk_bytes_of(k, eng.row_bytes)).all()
                   for k, c in zip(loads, cids, strict=True))
        s.manager.complete_load(loads, ctx)
    finally:
        del eng.rows  # the harness's view of vLLM's primary memory, so vLLM can unmap it
        conn.shutdown()


def _engine_of(manager):
    """The harness's engine (what vLLM's GPU worker does for a store) over a manager vLLM's connector built."""
    import numpy as np

    from kvbm.bench.native import NativeEngine

    eng = NativeEngine.__new__(NativeEngine)
    eng.manager, eng._n = manager, 0
    eng.rows = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint8)
    eng.row_bytes = eng.rows.shape[1]
    return eng


def test_a_load_longer_than_the_session_budget_loads_every_chunk(tmp_path):
    from test_vllm_e2e import free_port

    from kvbm.bench.native import chunk_keys

    cfg = daemon_cfg(tmp_path, free_port())
    cfg["daemon"]["max_session_slots"] = 4  # G2 has 64 slots: half the pool (32) is more than this budget
    d = ServeProc(tmp_path, cfg).start()
    try:
        keys = chunk_keys(12, "budget")
        a = engine(tier(d))
        try:
            assert a.store(keys) == 12
            a.settle()
        finally:
            a.shutdown()
        b = engine(tier(d))
        try:
            results, _, _ = b.lookup(keys)
            assert results == ["HIT"] * 12, results
            assert exact(b, keys)
            b.finish()
            assert counter(b.stats(), "vllm:kvbm_tier_load_blocks_short") == 0
        finally:
            b.shutdown()
    finally:
        d.stop()


def test_a_daemon_restarted_with_smaller_blocks_that_still_fit_keeps_the_tier_on(tmp_path):
    from test_vllm_e2e import free_port

    from kvbm.bench.native import chunk_keys

    port = free_port()
    d = ServeProc(tmp_path, daemon_cfg(tmp_path, port, block_bytes="16KiB")).start()
    a = engine(tier(d))
    try:
        assert a.row_bytes == 8192
        keys = chunk_keys(2, "before")
        a.store(keys)
        a.settle()
        d.stop()
        # The same endpoint, blocks of exactly one chunk row: still fits, the tier reconnects and stores.
        d = ServeProc(tmp_path, daemon_cfg(tmp_path, port, block_bytes="8KiB")).start()
        after = chunk_keys(2, "after")

        assert wait_until(lambda: stores_and_hits(a, after), timeout=30, step=0.5), \
            "the tier stayed off after the restart"
        a.reset_primary()
        assert a.lookup(after)[0] == ["HIT", "HIT"] and exact(a, after)
        a.finish()
    finally:
        a.shutdown()
        d.stop()


def test_a_chunk_evicted_between_lookup_and_load_costs_that_chunk_only(daemon):
    from vllm.v1.kv_offload.base import LookupResult

    from kvbm.bench.native import chunk_keys
    from kvbm.blocks import BlockKey
    from kvbm.integrations.vllm.native_keys import kvbm_hash

    keys = chunk_keys(6, "evicted-mid")
    stored_by_another_engine(daemon, keys)
    b = engine(tier(daemon))
    try:
        lookups = b.tiers[0]._lookups
        ctx = b._ctx()
        b._open = ctx
        assert {b.manager.lookup(k, ctx) for k in keys} == {LookupResult.RETRY}
        b.step()  # the batch goes to the daemon; wait for its answer before the eviction
        assert wait_until(lambda: not lookups._pending_results.empty(), timeout=30)
        with daemon.client(admin=True) as c:
            c.register(b.tiers[0].layout, worker_id="evictor")
            assert c.evict([BlockKey(b.tiers[0].layout.namespace, kvbm_hash(keys[2]))]).removed == 1
        # The lookups said HIT for all six: the promotion (one load job) finds chunk 2 gone and loads the others.
        results = []
        for _ in range(2000):
            results = [b.manager.lookup(k, ctx).name for k in keys]
            if not {"RETRY", "HIT_PENDING"} & set(results):
                break
            b.step()
            time.sleep(0.005)
        assert results == ["HIT", "HIT", "MISS", "HIT", "HIT", "HIT"], results
        assert exact(b, [k for i, k in enumerate(keys) if i != 2])
        b.finish()
        assert counter(b.stats(), "vllm:kvbm_tier_load_blocks_short") == 1
    finally:
        b.shutdown()
