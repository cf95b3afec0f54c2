"""``EmbeddedS3``: one SeaweedFS server with an S3 gateway on 127.0.0.1 for a data dir, started or reused
under the dir's lock, adopted when an orphan already serves the dir, and stopped again."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.s3server import state as st
from kvbm.s3server.ports import PORT_NAMES, check_port, choose_ports
from kvbm.s3server.probe import probe_put, s3_client
from kvbm.s3server.procs import pid_alive, pid_is_weed, terminate, weeds_serving
from kvbm.s3server.weed import MIN_FREE_SPACE, START_MARK, disk_refusal, find_weed, log_tail, weed_command, weed_runs


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
        min_free_space: str = MIN_FREE_SPACE,
        reuse: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if len(bucket) < 3:
            raise ConfigError(f"bucket {bucket!r} is shorter than 3 characters")
        check_port(port)
        self.dir = Path(dir).absolute()
        self.port = port
        self.access_key = access_key
        self.secret_key = secret_key
        self.bucket = bucket
        self.weed = weed
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.volume_size_limit_mb = volume_size_limit_mb
        self.min_free_space = min_free_space  # "256MiB", or a percentage of the disk as "1"
        self.reuse = reuse
        self.extra_args = tuple(extra_args)  # more `weed server` flags (e.g. -s3.domainName=... for a bench peer)
        self.ports: dict[str, int] = {}
        self.pid: int | None = None
        self.reused = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._detached = False
        self._log_from = 0  # where the latest start's part of the log begins

    # -- public surface --------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.dir / st.LOG_FILE

    @property
    def running(self) -> bool:
        return self.pid is not None and pid_alive(self.pid)

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
        with st.dir_lock(self.dir, self.startup_timeout_s + 30.0):
            if not self.secret_key:
                self.secret_key = st.stored_secret(self.dir, self.access_key) or secrets.token_urlsafe(32)
            state = st.read_state(self.dir)
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

    def attach(self) -> bool:
        """Reuse the server already running from this dir; never launch or adopt one (inspection commands
        start nothing). False when none runs there."""
        if self.running:
            return True
        if st.read_state(self.dir) is None:  # never started here: touch nothing, not even the lock file
            return False
        with st.dir_lock(self.dir, self.startup_timeout_s + 30.0):
            if not self.secret_key:
                self.secret_key = st.stored_secret(self.dir, self.access_key) or ""
            state = st.read_state(self.dir)
            return bool(state and self.secret_key and self._try_reuse(state))

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
        terminate(pid, wait, self._proc)
        self.pid = None
        self._proc = None
        with contextlib.suppress(OSError):
            (self.dir / st.PID_FILE).unlink()
        state = st.read_state(self.dir) or {}
        state["pid"] = None
        st.write_state(self.dir, state)

    def detach(self) -> None:
        """Leave the server running after this object (and process) goes away."""
        self._detached = True
        self._proc = None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until an authenticated PUT into the bucket succeeds (creating the bucket)."""
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        client = s3_client(self.endpoint, self.access_key, self.secret_key, timeout=3.0)
        last = "no answer yet"
        # Launched here: this start's part of the log; reused or adopted: from now (not a refusal logged days ago).
        log_from = self._log_from if self._proc is not None else _size(self.log_path)
        try:
            while True:
                if self._proc is not None and self._proc.poll() is not None:
                    raise TierUnavailableError(
                        f"SeaweedFS exited with code {self._proc.returncode} during startup "
                        f"(log {self.log_path}):\n{log_tail(self.log_path)}"
                    )
                ok, last = probe_put(client, self.bucket)
                if ok:
                    return
                refusal = disk_refusal(self.log_path, log_from)
                if refusal:  # it would refuse until the deadline: say why now
                    raise TierUnavailableError(f"{refusal} (log {self.log_path})")
                if time.monotonic() > deadline:
                    raise TierUnavailableError(
                        f"SeaweedFS at {self.endpoint} not ready after {timeout_s:.0f}s ({last}); "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                time.sleep(0.25)
        finally:
            client.close()

    def status(self) -> dict[str, Any]:
        state = st.read_state(self.dir) or {}
        pid = state.get("pid")
        alive = bool(pid) and pid_alive(pid) and pid_is_weed(pid)
        return {
            "running": alive,
            "pid": pid if alive else None,
            "endpoint": f"http://127.0.0.1:{state['ports']['s3']}" if state.get("ports") else None,
            "dir": str(self.dir),
            "log": str(self.log_path),
        }

    # -- internals -------------------------------------------------------------------------------
    def _try_reuse(self, state: dict[str, Any]) -> bool:
        pid = state.get("pid")
        ports = state.get("ports") or {}
        if not pid or not pid_alive(pid) or not pid_is_weed(pid) or "s3" not in ports:
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
        if set(ports) != set(PORT_NAMES):
            terminate(pid, self.stop_timeout_s, None)
            return False
        adopted = {**(state or {}), "pid": pid, "ports": ports, "access_key": self.access_key,
                   "bucket": self.bucket}
        try:
            self._try_reuse(adopted)
        except (TierUnavailableError, ConfigError):
            terminate(pid, self.stop_timeout_s, None)
            return False
        (self.dir / st.PID_FILE).write_text(f"{pid}\n")
        st.write_state(self.dir, adopted)
        return True

    def _launch(self, state: dict[str, Any] | None) -> None:
        weed = self.weed or find_weed()
        if not weed:
            raise TierUnavailableError(weed_runs(None)[1])
        self.reused = False
        ident = st.write_identity(self.dir, self.access_key, self.secret_key)
        fixed = bool(self.port)
        for attempt in range(3):
            old = ((state or {}).get("ports") or {}) if attempt == 0 else {}
            self.ports = choose_ports(old, self.port)
            self.port = self.ports["s3"]
            argv = weed_command(weed, self.dir, self.ports, ident, self.volume_size_limit_mb, self.extra_args,
                                self.min_free_space)
            with open(self.log_path, "ab") as log:
                self._log_from = log.tell()  # this start's part of the log begins here
                log.write(f"\n{START_MARK} starting weed at {time.ctime()} on port {self.port} ===\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.dir,
                    start_new_session=True,
                )
            self.pid = self._proc.pid
            (self.dir / st.PID_FILE).write_text(f"{self.pid}\n")
            st.write_state(self.dir, {"pid": self.pid, "ports": self.ports, "access_key": self.access_key,
                                      "bucket": self.bucket})
            try:
                self.wait_ready()
                return
            except TierUnavailableError:
                tail = log_tail(self.log_path, 60)
                self.stop(force=True)
                # Lost a race for a port with another process: try fresh ports unless the port was fixed.
                if fixed or "address already in use" not in tail or attempt == 2:
                    raise
                if not fixed:
                    self.port = 0

    def __del__(self) -> None:
        # Never leak a child we own; a detached or reused server is left alone (and an object whose __init__
        # refused its arguments has no child).
        proc = getattr(self, "_proc", None)
        if proc is not None and not self._detached and proc.poll() is None:
            with contextlib.suppress(Exception):
                terminate(proc.pid, 0.0, proc)



def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
