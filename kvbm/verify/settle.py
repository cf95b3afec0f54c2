"""The harness's view of an engine's saves: a vLLM worker extension that tells whether the connector's saves are
done, and :func:`settle`, which steps an engine until they are and no request holds blocks."""

from __future__ import annotations

import time
from typing import Any


class VerifyWorker:
    """vLLM worker extension: whether every save the connector's worker side started has finished."""

    def kvbm_verify_saves_done(self) -> bool:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        saver = getattr(get_kv_transfer_group().worker, "saver", None)
        return saver is None or not saver.pending()


def settle(llm: Any, timeout_s: float = 60.0) -> bool:
    """Step until the saves are in the daemon and no request holds blocks; whether that happened."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(llm.collective_rpc("kvbm_verify_saves_done")) and not core.scheduler.has_requests():
            return True
        llm.llm_engine.step()
        time.sleep(0.02)
    return False
