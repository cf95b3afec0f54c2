"""The daemon context's one ZAP handler: who passes the handshake of each socket.

libzmq asks one handler (per context) about every CURVE or PLAIN handshake, naming the socket's ZAP
domain. The request socket uses the default domain; the events socket its own (:data:`EVENTS_DOMAIN`), so
the two admit different clients: on a daemon with tenants the block events (namespaces, hashes: functions of
the prompts served) go to the operator only, CURVE or not. pyzmq's authenticator consults either key
directories or callbacks, never both, so every CURVE domain here is a callback over a key set.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kvbm.errors import ConfigError

EVENTS_DOMAIN = "kvbm-events"  # the events socket's ZAP domain (pyzmq's "*" covers only requests naming none)
EVENTS_USER = "admin"  # the PLAIN user name of an events subscriber on a daemon with tenants (no CURVE)


def public_keys(directory: str) -> set[bytes]:
    """The Z85 public keys of the ``<name>.key`` files in ``directory`` (a CURVE allow-list)."""
    import zmq.auth

    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{directory}: no such directory of CURVE public keys")
    return {zmq.auth.load_certificate(str(f))[0] for f in sorted(path.glob("*.key")) if f.is_file()}


class _Keys:
    """A pyzmq credentials provider: a client passes when its key is in the set (any key when ``None``)."""

    def __init__(self, keys: Collection[bytes] | None) -> None:
        self.keys = None if keys is None else frozenset(keys)

    def callback(self, _domain: str, key: bytes) -> bool:
        return self.keys is None or key in self.keys


class Zap:
    """Starts the authenticator on first use; ``curve``/``plain`` set one domain's rule."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._ctx = ctx
        self._auth: Any = None

    def _started(self) -> Any:
        if self._auth is None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
        return self._auth

    @property
    def running(self) -> bool:
        return self._auth is not None

    def curve(self, domain: str, keys: Collection[bytes] | None) -> None:
        """CURVE clients of ``domain`` pass when their public key is in ``keys`` (``None``: any key)."""
        self._started().configure_curve_callback(domain, _Keys(keys))

    def plain(self, domain: str, passwords: dict[str, str]) -> None:
        self._started().configure_plain(domain=domain, passwords=passwords)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
