"""CUDA runtime calls torch does not expose, or that a process needs without torch's CUDA context (the daemon
has no model in it), through cuda-python's ``cuda-bindings`` (the ``cu12``/``cu13`` extras, matched to torch's
CUDA: 12.x / 13.x).

Every call answers a CUDA error name (``""`` on success) instead of raising: without a GPU, cuda-bindings
answers ``cudaErrorInsufficientDriver`` (or ``cudaErrorNoDevice``), which :func:`no_gpu` recognises, so
callers fall back quietly. Without cuda-bindings installed, :func:`runtime` is None and callers use torch.
"""

from __future__ import annotations

import functools
from typing import Any

# cudaHostRegister flags (cuda_runtime_api.h): stable across CUDA 12 and 13.
HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current one
HOST_REGISTER_MAPPED = 2  # also mapped into the device address space (zero-copy reads from a kernel)
HOST_REGISTER_READ_ONLY = 8  # the device only reads it
NO_GPU = frozenset({"cudaErrorInsufficientDriver", "cudaErrorNoDevice"})


@functools.cache
def runtime() -> Any:
    """``cuda.bindings.runtime``, or None when cuda-bindings is not installed."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    return rt


def version() -> str:
    """cuda-bindings' version ("" when not installed)."""
    if runtime() is None:
        return ""
    import cuda.bindings

    return str(cuda.bindings.__version__)


def _name(err: Any) -> str:
    """``""`` for cudaSuccess, else the error's name (``cudaErrorInsufficientDriver``)."""
    return "" if int(err) == 0 else str(getattr(err, "name", err))


def no_gpu(error: str) -> bool:
    """Whether ``error`` says there is no usable GPU here (not a failure worth a warning)."""
    return error in NO_GPU


def device_count() -> tuple[str, int]:
    """(error, devices): ``("", n)``, or the error and 0 (no driver: ``cudaErrorInsufficientDriver``)."""
    rt = runtime()
    if rt is None:
        return "cuda-bindings not installed", 0
    err, n = rt.cudaGetDeviceCount()
    return _name(err), int(n or 0)


def host_register(ptr: int, nbytes: int, *, portable: bool = True, mapped: bool = False,
                  read_only: bool = False) -> str:
    """Page-lock ``nbytes`` of host memory at ``ptr`` (cudaHostRegister) with the flags asked for."""
    rt = runtime()
    if rt is None:
        return "cuda-bindings not installed"
    flags = (HOST_REGISTER_PORTABLE if portable else 0) | (HOST_REGISTER_MAPPED if mapped else 0) | \
        (HOST_REGISTER_READ_ONLY if read_only else 0)
    (err,) = rt.cudaHostRegister(ptr, nbytes, flags)
    return _name(err)


def host_unregister(ptr: int) -> str:
    rt = runtime()
    if rt is None:
        return "cuda-bindings not installed"
    (err,) = rt.cudaHostUnregister(ptr)
    return _name(err)


def stream_create(non_blocking: bool = True) -> tuple[str, Any]:
    """A CUDA stream (``cudaStreamNonBlocking``: it does not synchronise with the legacy default stream)."""
    rt = runtime()
    if rt is None:
        return "cuda-bindings not installed", None
    err, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking if non_blocking else rt.cudaStreamDefault)
    return _name(err), stream


def event_create(timing: bool = False) -> tuple[str, Any]:
    """A CUDA event (without timing by default: cheaper to record and wait on)."""
    rt = runtime()
    if rt is None:
        return "cuda-bindings not installed", None
    err, event = rt.cudaEventCreateWithFlags(rt.cudaEventDefault if timing else rt.cudaEventDisableTiming)
    return _name(err), event


def ipc_mem_handle(dev_ptr: int) -> tuple[str, bytes]:
    """The CUDA IPC handle of device memory at ``dev_ptr`` (what another process opens to read a worker's
    G1 blocks), as bytes."""
    rt = runtime()
    if rt is None:
        return "cuda-bindings not installed", b""
    err, handle = rt.cudaIpcGetMemHandle(dev_ptr)
    if int(err) != 0:
        return _name(err), b""
    return "", bytes(handle.reserved)
