"""Who may make which request: the one place access is decided, before any handler runs.

A Register names its credential: the admin token, a tenant's token (``daemon.tenants``), or none (a daemon
without tenants: whoever reaches its socket). :class:`Credentials` turns it into a :class:`Principal`; a
tenant may only register the models/namespaces its config names, whatever layout the client sends. A
worker's token is bound to its layout's namespace; requests naming another namespace or another engine's
barrier are refused ``E_FORBIDDEN``. Evict, Reindex and Stats with resident hashes need an admin session: a
Register that carried the admin token (:mod:`kvbm.security`, created at first start).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from kvbm import protocol as p
from kvbm.blocks.keys import is_namespace
from kvbm.config import DaemonConfig, TenantConfig
from kvbm.daemon.sessions import WorkerSession
from kvbm.daemon.transport import Handled
from kvbm.errors import ConfigError
from kvbm.security import ensure_admin_token, token_matches

NEEDS_ADMIN = "needs an admin session (Register with the token of daemon.admin_token_file)"


@dataclass(frozen=True)
class Principal:
    """Whom a session acts for: its worker_ids, its limits and what it may register are this one's."""

    name: str  # "" (a daemon without tenants), "admin", or "tenant:<name>"
    tenant: TenantConfig | None = None
    admin: bool = False


NOBODY = Principal("")
ADMIN = Principal("admin", admin=True)


class Credentials:
    """The daemon's admin token and each tenant's (config, token), read at start."""

    def __init__(self, admin_token: str = "", tenants: list[tuple[TenantConfig, str]] | None = None) -> None:
        self.admin_token = admin_token
        self.tenants = tenants or []

    def principal(self, msg: p.Register) -> Principal:
        """Whom ``msg`` registers for; raises ``Handled(E_FORBIDDEN)`` for a wrong credential or a layout its
        tenant may not register."""
        if msg.admin_token:
            if not token_matches(msg.admin_token, self.admin_token):
                raise Handled(p.E_FORBIDDEN, "wrong admin token")
            return ADMIN
        if not self.tenants:
            if msg.tenant_token:
                raise Handled(p.E_FORBIDDEN, "this daemon has no tenants (daemon.tenants): register without a "
                                             "tenant token")
            return NOBODY
        if not msg.tenant_token:
            raise Handled(p.E_FORBIDDEN, "this daemon serves tenants: Register with a tenant's token "
                                         "(daemon.tenant_token_file, the connector's tenant_token_file)")
        tenant = next((t for t, tok in self.tenants if token_matches(msg.tenant_token, tok)), None)
        if tenant is None:
            raise Handled(p.E_FORBIDDEN, "unknown tenant token")
        layout = msg.layout
        ns = layout.namespace
        if ns not in tenant.namespaces and not any(fnmatchcase(layout.model, m) for m in tenant.models):
            raise Handled(p.E_FORBIDDEN, f"tenant {tenant.name!r} may not register model {layout.model!r} "
                                         f"(namespace {ns!r}): not in its models/namespaces")
        # A namespace another tenant lists is that tenant's alone, whatever model glob would also reach it.
        if owner := next((t for t, _tok in self.tenants if t is not tenant and ns in t.namespaces), None):
            raise Handled(p.E_FORBIDDEN, f"tenant {tenant.name!r} may not register model {layout.model!r}: its "
                                         f"namespace {ns!r} is tenant {owner.name!r}'s (daemon.tenants namespaces)")
        return Principal(f"tenant:{tenant.name}", tenant)


def load_credentials(dc: DaemonConfig, admin_path: Path) -> Credentials:
    """The admin token and every tenant's, each file created (random, 0600) when missing; two credentials
    sharing a token would be one, so that is refused."""
    admin = ensure_admin_token(admin_path)
    tenants = []
    for i, t in enumerate(dc.tenants):
        token = ensure_admin_token(Path(t.token_file).expanduser())
        if any(token_matches(token, other) for other in [admin, *(tok for _t, tok in tenants)]):
            raise ConfigError(f"daemon.tenants[{i}].token_file: {t.token_file} holds the token of another "
                              f"tenant or the admin")
        tenants.append((t, token))
    return Credentials(admin, tenants)


def authorize(msg: Any, w: WorkerSession | None, creds: Credentials) -> str:
    """Why this session may not make this request ("" when it may); a refused Register raises Handled."""
    if isinstance(msg, p.Register):
        creds.principal(msg)
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
