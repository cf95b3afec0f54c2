"""One rule for what counts as a secret, and redaction of secrets from anything written out.

Reports (bench JSON), logs and config dumps go through :func:`redact` so that credentials given on the
command line, in a config file or in the environment never reach disk.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

MASK = "***"
# Field names that hold credentials: S3 access and secret keys, session tokens, CURVE secret keys,
# passwords, admin tokens. Access key ids are masked too: with the endpoint they name an account.
_SECRET_NAME = re.compile(r"(secret|password|passwd|access_key|session_token|(^|_)token$|credential)",
                          re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact(obj: Any, *, values: tuple[str, ...] = ()) -> Any:
    """A copy of ``obj`` (dicts, lists, tuples, msgspec Structs, dataclasses as dicts) with every value
    under a secret-named key replaced by ``***``, and every string equal to one of ``values`` too."""
    vals = tuple(v for v in values if v)
    return _redact(obj, vals)


def _redact(obj: Any, vals: tuple[str, ...]) -> Any:
    if isinstance(obj, msgspec.Struct):
        obj = msgspec.structs.asdict(obj)
    if isinstance(obj, dict):
        return {k: (MASK if isinstance(k, str) and is_secret_name(k) and v not in ("", None) else _redact(v, vals))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_redact(v, vals) for v in obj)
    if isinstance(obj, str) and vals:
        for v in vals:
            if v in obj:
                obj = obj.replace(v, MASK)
        return obj
    return obj
