"""Credentials of the daemon link: the admin token file, CURVE key files, and which binds need CURVE.

* **Admin token**: a random token in a file only its owner can read (mode 0600), by default
  ``<cache dir>/admin.token`` (``daemon.admin_token_file``). ``kvbm serve`` creates it at first start and
  reuses it afterwards; the CLI and any client that can read the file present it in :class:`Register`,
  which makes that session an admin one (Evict, Reindex, any namespace, resident hashes).
* **CURVE key files**: ZeroMQ certificate files (the format of ``zmq.auth``): ``<name>.key`` holds the
  public key (copy it into the daemon's ``curve_clients_dir`` allow-list), ``<name>.key_secret`` both keys
  (mode 0600). ``kvbm keys generate`` writes a pair.
* **Binds**: the default endpoints are ipc:// sockets in ``<cache dir>/run``, a directory the daemon keeps
  0700 and owned by its user, so the kernel keeps every other local user out of both sockets (no key to hand
  out, no per-message cost). Loopback TCP and ipc:// need no CURVE; a TCP bind on any other address without
  CURVE is refused unless ``daemon.allow_insecure_tcp`` says so. Sockets other local users could reach
  (loopback TCP without CURVE, abstract or open-directory ipc://) are named in a warning at start.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hmac
import ipaddress
import os
import secrets
import socket
import stat
from pathlib import Path

from kvbm.config import DaemonConfig, default_cache_dir, default_run_dir
from kvbm.errors import ConfigError

ADMIN_TOKEN_NAME = "admin.token"


# -- admin token -------------------------------------------------------------------------------------------
def admin_token_path(dc: DaemonConfig) -> Path:
    return Path(dc.admin_token_file).expanduser() if dc.admin_token_file else default_cache_dir() / ADMIN_TOKEN_NAME


def _check_private(path: Path) -> None:
    st = path.stat()
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path}: a credential file must not be readable by group or others "
                          f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")


def ensure_admin_token(path: Path) -> str:
    """The token in ``path``, created (random, mode 0600) when missing; concurrent creators agree."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        try:
            os.link(tmp, path)  # atomic and never replaces: a token someone else created first wins
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    got = read_admin_token(path)
    if not got:
        raise ConfigError(f"{path}: the admin token file is empty")
    return got


def read_admin_token(path: Path) -> str:
    """The token in ``path``; empty when the file is missing or unreadable (the caller is no admin)."""
    try:
        _check_private(path)
        return path.read_text().strip()
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        return ""


def read_tenant_token(path: str, field: str) -> str:
    """The tenant token a client presents ("" when ``path`` is empty); a file it cannot read is an error
    naming ``field`` (registering without it would only be refused). The file must be private."""
    return read_token_file(path, field, private=True)


def read_token_file(path: str, field: str, *, private: bool = False) -> str:
    """The token in the file ``path`` names ("" when ``path`` is empty): an unreadable or empty file is a
    ConfigError naming ``field``; ``private``: one readable by group or others is too. Blocking file read."""
    if not path:
        return ""
    p = Path(path).expanduser()
    try:
        if private:
            _check_private(p)
        token = p.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {p}: {e.strerror or e}") from None
    if not token:
        raise ConfigError(f"{field}: {p} is empty")
    return token


def token_matches(given: str, expected: str) -> bool:
    return bool(given) and bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


# -- CURVE key files -------------------------------------------------------------------------------------
_BANNER = "#   kvbm CURVE {kind} certificate, {when}\n#   {note}\n\n"


def write_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``<name>.key`` (public) and ``<name>.key_secret`` (both keys, 0600); refuses to overwrite."""
    import zmq

    directory.mkdir(parents=True, exist_ok=True)
    pub, sec = zmq.curve_keypair()
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"{path} exists; not overwriting a key")
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    body = f'metadata\ncurve\n    public-key = "{pub.decode()}"\n'
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_BANNER.format(kind="secret", when=when, note="keep private: it authenticates its holder"))
        f.write(body + f'    secret-key = "{sec.decode()}"\n')
    fd = os.open(public, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(_BANNER.format(kind="public", when=when, note="copy into the daemon's curve_clients_dir"))
        f.write(body)
    return public, secret


def load_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``.key_secret`` file (which must be private)."""

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{p}: no such CURVE key file (kvbm keys generate writes one)")
    _check_private(p)
    pub, sec = _certificate(p)
    if not sec:
        raise ConfigError(f"{p} holds no secret key (give the .key_secret file)")
    return pub, sec


def load_public_key(path: str | os.PathLike[str]) -> bytes:

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{p}: no such CURVE key file")
    return _certificate(p)[0]


def _certificate(path: Path, field: str = "") -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a ZeroMQ certificate file; ConfigError (naming ``field``) for anything that is
    not one, or whose keys are not 32-byte Z85."""
    import zmq.auth
    from zmq.utils import z85

    at = f"{field}: " if field else ""
    try:
        pub, sec = zmq.auth.load_certificate(str(path))
        for key in (pub, sec):
            if key is not None and len(z85.decode(key)) != 32:
                raise ValueError("a key is not 40 Z85 characters (32 bytes)")
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"{at}{path} is not a CURVE certificate (kvbm keys generate writes them; move any other "
                          f"file out): {e}") from None
    return pub, sec


def read_public_keys(directory: str, field: str) -> set[bytes]:
    """The Z85 public keys of the ``<name>.key`` files in ``directory`` (a CURVE allow-list); ConfigError naming
    ``field`` and the file for a missing directory or a file that is not a certificate."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{field}: {directory}: no such directory of CURVE public keys")
    return {_certificate(f, field)[0] for f in sorted(path.glob("*.key")) if f.is_file()}


def check_key_dirs(dc: DaemonConfig) -> None:
    """Read every allow-list now (``daemon.curve_clients_dir``, ``curve_admin_clients_dir``), so a bad file is a
    start-up error naming it, before any tier is indexed."""
    for field in ("curve_clients_dir", "curve_admin_clients_dir"):
        if directory := getattr(dc, field):
            read_public_keys(directory, f"daemon.{field}")


def server_keys(dc: DaemonConfig) -> tuple[str, str]:
    """The daemon's CURVE (public, secret) keys as Z85 text, from the config or its key file; ("", "")
    when the daemon runs without CURVE."""
    if dc.curve_server_key_file:
        pub, sec = load_keypair(dc.curve_server_key_file)
        return pub.decode(), sec.decode()
    if bool(dc.curve_secret_key) != bool(dc.curve_public_key):
        raise ConfigError("daemon.curve_secret_key and daemon.curve_public_key are set together (or neither)")
    return dc.curve_public_key, dc.curve_secret_key


def client_curve(dc: DaemonConfig) -> tuple[str, tuple[bytes, bytes] | None]:
    """What a client on this config uses to reach the daemon: the server's public key ("" without
    CURVE) and its own keypair (None: a throwaway one, which only a daemon that allows any client takes)."""
    server = dc.curve_public_key
    if not server and dc.curve_server_key_file:  # same host, same config: the daemon's own key file
        server = load_public_key(dc.curve_server_key_file).decode()
    if dc.curve_client_key_file and not server:
        raise ConfigError("daemon.curve_client_key_file is set but not the daemon's public key "
                          "(daemon.curve_public_key): CURVE needs both")
    keypair = load_keypair(dc.curve_client_key_file) if dc.curve_client_key_file else None
    return server, keypair


# -- binds -----------------------------------------------------------------------------------------------
def is_local_endpoint(endpoint: str) -> bool:
    """ipc://, inproc:// and TCP on a loopback address (only this host can connect)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a DNS name: may be reachable from elsewhere


def check_binds(dc: DaemonConfig, curve: bool) -> None:
    """Refuse a non-local bind without CURVE (unless explicitly allowed) and CURVE that authenticates nobody."""
    if curve and not dc.curve_clients_dir and not dc.curve_allow_any_client:
        raise ConfigError("daemon CURVE keys are set but daemon.curve_clients_dir is empty: any client would be "
                          "let in. Set curve_clients_dir (public keys of allowed clients) or, to only encrypt, "
                          "daemon.curve_allow_any_client: true")
    if curve and dc.curve_clients_dir and not Path(dc.curve_clients_dir).is_dir():
        raise ConfigError(f"daemon.curve_clients_dir {dc.curve_clients_dir}: no such directory")
    if curve and dc.curve_admin_clients_dir and not Path(dc.curve_admin_clients_dir).is_dir():
        raise ConfigError(f"daemon.curve_admin_clients_dir {dc.curve_admin_clients_dir}: no such directory")
    if curve or dc.allow_insecure_tcp:
        return
    for field, ep in (("endpoint", dc.endpoint), ("events_endpoint", dc.events_endpoint)):
        if ep and not is_local_endpoint(ep):
            raise ConfigError(f"daemon.{field} {ep} is reachable from other hosts but CURVE is off: anyone who can "
                              f"connect could read and evict the cache. Configure CURVE (daemon.curve_server_key_file, "
                              f"curve_clients_dir) or set daemon.allow_insecure_tcp: true")


UNIX_PATH_MAX = 107  # bytes of a unix socket path (sun_path, less its NUL)


def ipc_path(endpoint: str) -> str:
    """The file of an ipc:// endpoint ("" for other transports and abstract ``ipc://@name`` sockets)."""
    path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else ""
    return "" if path.startswith("@") else path


def prepare_ipc(endpoint: str, field: str) -> None:
    """Before binding ``endpoint`` (``daemon.<field>``): an ipc:// path fits a unix socket, its directory
    exists (created 0700), the default directory is this user's and 0700, and no other process listens on
    it (libzmq would silently take the path over from a running daemon)."""
    path = ipc_path(endpoint)
    if not path:
        return
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ConfigError(f"daemon.{field} {endpoint}: the path is longer than {UNIX_PATH_MAX} bytes, the limit "
                          f"of a unix socket; set daemon.{field} (or XDG_CACHE_HOME) to a shorter one")
    parent = Path(path).absolute().parent
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if parent == default_run_dir().absolute():
        st = parent.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(f"daemon.{field}: {parent} must be a directory of this user (uid {os.geteuid()}): "
                              f"it keeps other users off the daemon's sockets")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            os.chmod(parent, 0o700)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        return  # nothing there, or a stale socket of a killed daemon: libzmq replaces it
    finally:
        s.close()
    raise ConfigError(f"daemon.{field} {endpoint}: another process listens there (a daemon already running?)")


def exposure(dc: DaemonConfig, curve: bool) -> list[str]:
    """Why other local users could reach a bound daemon socket, one line per endpoint (logged at start)."""
    out = []
    for field, ep in (("endpoint", dc.endpoint), ("events_endpoint", dc.events_endpoint)):
        if not ep or curve:
            continue
        if ep.startswith("tcp://"):
            out.append(f"daemon.{field} {ep}: TCP without CURVE, every local user can connect")
        elif ep.startswith("ipc://@"):
            out.append(f"daemon.{field} {ep}: an abstract socket has no permissions, every local user can connect")
        elif path := ipc_path(ep):
            parent = Path(path).absolute().parent
            with contextlib.suppress(OSError):
                if parent.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                    out.append(f"daemon.{field} {ep}: its directory {parent} is open to group or others")
    return out

