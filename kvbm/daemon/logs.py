"""Structured logs: one JSON object per line, secret-named fields masked, and :func:`logj` to emit them."""

from __future__ import annotations

import json
import logging
from typing import Any

from kvbm.redact import redact

log = logging.getLogger("kvbm.daemon")  # the name operators filter on, kept from the single-module daemon


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and any ``kv`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "kv", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class RedactFields(logging.Filter):
    """Secret-named structured fields (kvbm.redact's one rule) are masked before any handler formats them."""

    def filter(self, record: logging.LogRecord) -> bool:
        kv = getattr(record, "kv", None)
        if kv:
            record.kv = redact(kv)
        return True


def configure_logging(fmt: str = "json", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RedactFields())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(kv)s", defaults={"kv": ""}))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def logj(event: str, level: int = logging.INFO, **kv: Any) -> None:
    """Log ``event`` with structured fields."""
    if log.isEnabledFor(level):
        log.log(level, event, extra={"kv": kv})
