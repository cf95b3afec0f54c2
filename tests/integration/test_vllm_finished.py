"""The connector's worker side reports each finished request vLLM kept blocks for exactly once, when nothing
of kvbm uses those blocks any more: vLLM frees the blocks on the report (``finished_sending`` or
``finished_recving``) and asserts the request is still known on each one, so a second report kills EngineCore
and an early one frees blocks a load is still writing. Real parts: the worker side against a real daemon."""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import numpy as np
import pytest
from needs import needs
from test_vllm_outage import _worker, daemon  # noqa: F401 (the daemon fixture)

from kvbm.blocks import BlockKey

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]


def test_a_request_aborted_while_its_async_load_runs_is_reported_once_after_the_load(daemon):  # noqa: F811
    """A request preempted with its saves, resumed through an async load and aborted while that load runs (a
    stopped daemon holds it): its saves are over, its load is not. It used to be reported finished sending at
    once (vLLM freed its blocks under the load) and finished receiving when the load ended (vLLM's
    ``assert req_id in self.requests``: EngineCore dead)."""
    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    w = _worker(daemon.endpoint, 1, async_load=True, async_save=True)
    loaded = b"l" * 32
    try:
        with daemon.client() as c:
            c.register(w._link.layout, worker_id="filler")
            assert c.store([BlockKey(w._link.layout.namespace, loaded)], [np.ones(4096, np.uint8)]).stored == 1
        w.wait_for_save(KvbmConnectorMetadata(k=1, saves=[BlockTransfer("r1", [b"s" * 32], [[1]])]))
        deadline = time.monotonic() + 30
        while w.saver.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not w.saver.pending()
        reports: list[tuple[str, set[str]]] = []
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            w.start_load_kv(KvbmConnectorMetadata(k=1, loads=[BlockTransfer("r1", [loaded], [[2]])]))
            sending, recving, _ = w.get_finished({"r1"})  # vLLM aborted r1 while it waited for its load
            reports += [("sending", sending), ("recving", recving)]
            assert "r1" not in sending | recving, "reported while its load may still write its blocks"
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("r1" in ids for _, ids in reports):
            sending, recving, _ = w.get_finished(set())
            reports += [("sending", sending), ("recving", recving)]
            time.sleep(0.01)
        for _ in range(20):  # and never again
            sending, recving, _ = w.get_finished(set())
            reports += [("sending", sending), ("recving", recving)]
            time.sleep(0.01)
        said = [kind for kind, ids in reports if "r1" in ids]
        assert len(said) == 1, f"r1 reported {len(said)} times: {said}"
    finally:
        w.shutdown()


def test_a_fence_waits_for_a_saves_copies_not_for_its_commit_round_trip(daemon):  # noqa: F811
    """A fence (before a forward that may reuse a preempted or aborted request's blocks) needs only the copies
    out of those blocks to be over. It waited for the whole save, CommitStore round trip included, and a save
    whose daemon stalled after the copy was then cancelled and counted so (its bytes were already in G2).
    Now the fence returns once the copy is over, the save's commit goes on, and the block is stored."""
    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    w = _worker(daemon.endpoint, 1, async_load=True, async_save=True)
    key = b"f" * 32
    copy = w.saver._copy

    def copy_then_stall(view, ids, stream):  # the daemon stops between the copy and the CommitStore
        copy(view, ids, stream)
        os.kill(daemon.proc.pid, signal.SIGSTOP)

    w.saver._copy = copy_then_stall
    stopped = True
    try:
        w.wait_for_save(KvbmConnectorMetadata(k=1, saves=[BlockTransfer("r1", [key], [[2]])]))
        (job,) = w.saver._jobs["r1"]
        assert job.copied.wait(30), "the save never copied"
        w.handle_preemptions(KvbmConnectorMetadata(k=1, released=["r1"]))  # r1 aborted: its blocks freed
        assert not job.future.done(), "the save ended while the daemon was stopped: the test took no stall"
        assert w.stats.get("saves_cancelled", 0) == 0, "a save whose copy was over was cancelled by the fence"
        os.kill(daemon.proc.pid, signal.SIGCONT)
        stopped = False
        assert job.future.result(timeout=30) is None
        with daemon.client() as c:
            c.register(w._link.layout, worker_id="reader")
            assert c.lookup([BlockKey(w._link.layout.namespace, key)]).matched == 1, "the copied block was not stored"
    finally:
        if stopped:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        w.shutdown()


def _window_worker(endpoint: str, **cfg):
    """The worker side of a sliding-window model (two KV-cache groups) over paged caches filled with 1s."""
    import torch

    from kvbm.blocks.layout import KVLayout
    from kvbm.integrations.vllm import ConnectorConfig, Geometry, Links, WorkerSide
    from kvbm.integrations.vllm.groups import KVGroups

    groups = KVGroups({"layer.0": 0, "layer.1": 1}, (0, 64))  # full attention + a 64-token window
    links = Links(endpoint, Geometry(16, 2 * 2048, 1), "window-engine", 5.0,
                  lambda rank, k: KVLayout(model="window", num_layers=2, num_kv_heads=1, head_size=32,
                                           dtype="float16", tp_rank=rank, tokens_per_block=16 * k,
                                           block_bytes=1 << 20))
    w = WorkerSide(ConnectorConfig.parse({"async_save": True, "async_load": True, **cfg}), links, 0, 8,
                   groups=groups)
    caches = {f"layer.{i}": torch.full((8, 2048), 1, dtype=torch.uint8) for i in range(2)}
    w.register_kv_caches(caches)
    return w, caches


def test_a_save_queued_behind_a_stalled_daemon_is_staged_by_the_fence_not_waited_for(daemon):  # noqa: F811
    """A sliding-window group frees blocks mid-request and the next forward may write another request's KV into
    them, so a sliding-window model fences every save before every forward, in ``handle_preemptions`` (in
    ``start_load_kv``, which vLLM calls after the forward for async loads, a save queued behind a slow daemon
    copied the next request's KV under this one's hash). A save still waiting for its PrepareStore (a stopped or
    slow daemon) was then waited for up to ``fence_wait_ms`` on the engine's thread, every step, and dropped: the
    engine stalled on the daemon and the block was lost. The fence now copies its blocks to host buffers (as a
    finished request's) and returns: the save goes on from them once the daemon answers, with the bytes the
    blocks held before the forward."""
    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata

    wait_ms = 3000.0  # long enough to see a wait, shorter than the links' 5 s silence limit
    w, caches = _window_worker(daemon.endpoint, fence_wait_ms=wait_ms)
    victim = b"q" * 32
    try:
        os.kill(daemon.proc.pid, signal.SIGSTOP)  # the save waits for its PrepareStore: queued, not copying
        try:
            w.wait_for_save(KvbmConnectorMetadata(k=1, saves=[BlockTransfer("r1", [victim], [[3, 4]])]))
            time.sleep(0.1)
            started = time.monotonic()
            w.handle_preemptions(KvbmConnectorMetadata(k=1))  # the next step, before its forward
            fenced_s = time.monotonic() - started
            for cache in caches.values():  # the forward: another request's KV in the window's freed blocks
                cache[3:5].fill_(9)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while w.saver.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.stats.get("saves_cancelled", 0) == 0, f"the fence dropped the save: {w.stats}"
        with daemon.client() as c:
            c.register(w._link.layout, worker_id="reader")
            buf = np.zeros(c.registered.slot_bytes, np.uint8)
            got = c.load([BlockKey(w._link.layout.namespace, victim)], [buf])
        assert got == 1, f"the save queued behind the stalled daemon was not stored: {w.stats}"
        assert (buf[:4096] == 1).all(), "the save stored other bytes than its blocks' before the forward"
        assert fenced_s < wait_ms / 2000, f"the fence waited {fenced_s:.2f} s on the stopped daemon"
    finally:
        w.shutdown()
