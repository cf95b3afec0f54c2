"""Who may make which request: the one place access is decided, before any handler runs.

A worker's token is bound to its layout's namespace; requests naming another namespace or another engine's
barrier are refused ``E_FORBIDDEN``. Evict, Reindex and Stats with resident hashes need an admin session: a
Register that carried the admin token (:mod:`kvbm.security`, created at first start).
"""

from __future__ import annotations

from typing import Any

from kvbm import protocol as p
from kvbm.daemon.transport import Handled
from kvbm.keys import is_namespace
from kvbm.security import token_matches
from kvbm.sessions import WorkerSession

NEEDS_ADMIN = "needs an admin session (Register with the token of daemon.admin_token_file)"


def authorize(msg: Any, w: WorkerSession | None, admin_token: str) -> str:
    """Why this session may not make this request ("" when it may)."""
    if isinstance(msg, p.Register):
        if msg.admin_token and not token_matches(msg.admin_token, admin_token):
            return "wrong admin token"
        return ""
    if w is not None and w.admin:
        return _check_names(msg)
    if isinstance(msg, (p.Evict, p.Reindex)):
        return f"{type(msg).__name__} {NEEDS_ADMIN}"
    if isinstance(msg, p.Stats) and msg.resident:
        return f"Stats with resident block hashes {NEEDS_ADMIN}"
    if w is None:
        return ""  # an unregistered monitor's Stats or Ping
    if isinstance(msg, p._Blocks) and msg.namespace != w.namespace:
        return (f"namespace {msg.namespace!r} is not this worker's: a token serves its own layout's namespace "
                f"(other namespaces need an admin session, the token of daemon.admin_token_file)")
    if isinstance(msg, p.Barrier) and msg.engine_id != w.engine_id:
        return f"engine {msg.engine_id!r} is not this worker's"
    return ""


def _check_names(msg: Any) -> str:
    """An admin may name any namespace, but only a well-formed one (it becomes file and object names)."""
    ns = getattr(msg, "namespace", "")
    if ns and not is_namespace(ns):
        raise Handled(p.E_BAD_REQUEST, f"{ns!r} is not a kvbm namespace")
    return ""


def check_store(msg: p.PrepareStore | p.CommitStore, w: WorkerSession) -> None:
    """Even an admin session stores only its own layout's blocks: the slot size is the layout's."""
    if msg.namespace != w.namespace:
        raise Handled(p.E_FORBIDDEN, f"namespace {msg.namespace!r} is not this worker's ({w.namespace!r})")
