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
