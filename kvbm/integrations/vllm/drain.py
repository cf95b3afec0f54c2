"""Wait, in vLLM's in-process engine (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), until kvbm's saves landed.

kvbm holds none of vLLM's blocks for its saves (a finished request's unread saves are staged at the engine's next
step, then written by a saver thread), so a prefix-cache reset is no barrier for them, and the in-process engine
does not step on its own after a generate. A benchmark or a test that must find a request's blocks in the daemon
before its next request calls :func:`drain` (the multi-process engine steps by itself: has_pending_push_work).
"""

from __future__ import annotations

import time
from typing import Any


def saves_pending(_worker: Any = None) -> bool:
    """Whether this worker process's kvbm connector has saves not written yet (``LLM.collective_rpc`` target)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return False
    saver = getattr(getattr(get_kv_transfer_group(), "worker", None), "saver", None)
    return saver is not None and saver.pending()


def drain(llm: Any, timeout_s: float = 60.0) -> bool:
    """Step ``llm`` until the connector staged its finished requests' saves and every worker wrote its saves;
    whether that happened within ``timeout_s``."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if scheduler.has_requests():
            llm.llm_engine.step()
        elif not any(llm.collective_rpc(saves_pending)):
            return True
        else:
            time.sleep(0.005)
    return False
