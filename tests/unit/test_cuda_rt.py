"""cuda-python's cuda-bindings where kvbm calls CUDA that torch does not expose (kvbm.transfer.cuda_rt): the
import and the call shapes. Without a GPU every call answers a CUDA error name (cudaErrorInsufficientDriver)
instead of raising, and G2 stays pageable without a warning; on a GPU the host registration succeeds."""

from __future__ import annotations

import logging

import numpy as np
import torch
from needs import require

from kvbm.transfer import cuda_rt


def _require() -> None:
    require("cuda_bindings", cuda_rt.runtime() is not None, "cuda-bindings is not installed (the cu12/cu13 extra)")


def test_cuda_bindings_answer_error_names_never_raise():
    _require()
    assert cuda_rt.version().split(".")[0] in ("12", "13"), cuda_rt.version()
    err, n = cuda_rt.device_count()
    buf = np.zeros(1 << 20, np.uint8)
    ptr = buf.ctypes.data
    if n == 0:
        assert cuda_rt.no_gpu(err), err
        assert cuda_rt.no_gpu(cuda_rt.host_register(ptr, buf.nbytes, portable=True, mapped=True))
        assert cuda_rt.no_gpu(cuda_rt.host_unregister(ptr))
        for e, obj in (cuda_rt.stream_create(), cuda_rt.event_create(), cuda_rt.ipc_mem_handle(0)):
            assert cuda_rt.no_gpu(e) and not obj, (e, obj)
        return
    assert err == "" and n >= 1
    assert cuda_rt.host_register(ptr, buf.nbytes, portable=True) == ""
    assert cuda_rt.host_unregister(ptr) == ""
    e, stream = cuda_rt.stream_create()
    assert e == "" and stream is not None
    e, event = cuda_rt.event_create()
    assert e == "" and event is not None
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    e, handle = cuda_rt.ipc_mem_handle(dev.data_ptr())
    assert e == "" and len(handle) == 64


def test_the_g2_pool_is_pinned_through_cuda_bindings_where_there_is_a_gpu(caplog):
    _require()
    from kvbm.tiers.host import HostTier

    gpus = cuda_rt.device_count()[1]
    with caplog.at_level(logging.WARNING):
        g2 = HostTier(1 << 20, 1 << 16)
    try:
        assert g2.pinned is (gpus > 0 or torch.cuda.is_available())
        assert "cudaHostRegister failed" not in caplog.text  # no GPU is not a failure
    finally:
        g2.release()
