"""A vLLM imported once, forked for each engine run: what the harness and the tests start dozens of times.

A fresh interpreter spends ~12 s of CPU importing vLLM, torch and transformers before a tiny CPU engine starts
in ~3 s. The zygote imports them once (no engine, no thread of its own), then forks one child per run, which
takes the run's environment and log and calls the run's ``module:function(spec, out)`` as a fresh process's
``__main__`` would: the same engine, connector and daemon, only not imported again (vLLM forks its own
workers the same way). A child's exit status is the run's, as :func:`subprocess.run` reports it.

Only single-process engines use it (a tensor- or pipeline-parallel engine starts workers with their own
thread binding). What vLLM and torch read while importing (``OMP_NUM_THREADS``, ``PYTHONHASHSEED``,
``VLLM_LOGGING_LEVEL``, ``PYTHONPATH``...) is the zygote's: a run whose environment differs from it outside
``KVBM_*`` (read when a run starts) and ``PYTEST_*`` gets a new zygote.

Protocol (the zygote's stdin/stdout, one JSON object per line): ``{"target", "args", "log", "env"}`` in;
``{"pid"}`` once the child runs, then ``{"rc"}`` once it ended. EOF on stdin ends the zygote.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PRELOAD = ("vllm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner", "kvbm.integrations.vllm.connector")


def _import_key(env: dict[str, str]) -> dict[str, str]:
    """What a run's environment must share with the zygote's (pytest names the current test in its own)."""
    return {k: v for k, v in env.items() if not k.startswith(("KVBM_", "PYTEST_"))}


class Zygote:
    """The parent's side of one zygote process."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...]) -> None:
        self.key, self.preload = _import_key(env), preload
        self.log = Path(tempfile.mkdtemp(prefix="kvbm-zygote-")) / "zygote.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvbm.verify.zygote", *preload],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         text=True, bufsize=1)
        # The replies are read from the pipe's fd into this buffer, never through a buffered reader: a reader
        # takes both of a quick run's lines ({"pid"} and {"rc"}) at once, and select() then waits on an empty
        # pipe for the line it already holds (a clean-clone run: the harness-error test hung 900 s).
        self._replies = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, target: str, args: list[str], log: Path, env: dict[str, str], timeout_s: float) -> int:
        """``target(*args)`` in a fork with ``env``, stdout and stderr to ``log``; its exit status. A run past
        ``timeout_s`` is killed and raises :class:`subprocess.TimeoutExpired`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        req = {"target": target, "args": args, "log": str(log), "env": env}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        pid = int(self._read(300)["pid"])  # the first run waits for the zygote's imports
        try:
            return int(self._read(timeout_s)["rc"])
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._read(30)
            raise subprocess.TimeoutExpired([target, *args], timeout_s) from None

    def _read(self, timeout_s: float) -> dict[str, Any]:
        """The zygote's next reply line."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._replies:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"the zygote said nothing in {timeout_s:.0f} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the zygote exited (status {self.proc.wait()}):\n"
                                   + self.log.read_text(errors="replace")[-4000:])
            self._replies += chunk
        line, self._replies = self._replies.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_current: Zygote | None = None


def run_forked(target: str, args: list[str], log: Path, env: dict[str, str], timeout_s: float,
               preload: tuple[str, ...] = ()) -> int:
    """Run ``target`` (``module:function``) in a fork of this process's zygote for ``env`` (started on first use,
    again when the import-time environment or ``preload`` differs); its exit status."""
    global _current
    wanted = PRELOAD + preload
    if _current is None or not _current.alive() or _current.key != _import_key(env) or _current.preload != wanted:
        if _current is not None:
            _current.close()
        _current = Zygote(env, wanted)
    return _current.run(target, args, log, env, timeout_s)


def _child(req: dict[str, Any]) -> None:
    """In the fork: the run's log as stdout and stderr, its environment, then its target."""
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ.clear()
    os.environ.update(req["env"])
    module, func = req["target"].split(":")
    getattr(importlib.import_module(module), func)(*req["args"])


def _fork(req: dict[str, Any]) -> int:
    pid = os.fork()
    if pid:
        return pid
    rc = 0
    try:
        _child(req)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # as a fresh process ends: its traceback in the log, status 1
        import traceback

        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def serve(preload: list[str]) -> None:
    """The zygote: import ``preload``, then fork one child per request, one at a time."""
    for name in preload:
        importlib.import_module(name)
    reply = sys.stdout
    for line in sys.stdin:
        reply.flush()
        pid = _fork(json.loads(line))
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve(sys.argv[1:])
