"""The frame every benchmark runs in: a work directory, an S3 endpoint (embedded SeaweedFS or the one the options
name), the report's common fields (bench, machine, options, load, wall time) and the servers' logs kept. A bench
configures one :class:`BenchRun`, starts its own servers in ``run.work`` (daemons: :class:`kvbm.bench.common.
DaemonProc`), fills ``run.report`` and compares there; the CLI prints and plots the report."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

from kvbm.bench.common import BenchTarget, delete_prefix, load_avg, machine, s3_server, temp_dir


class BenchRun:
    """``with BenchRun("serve", o, echo, s3=True) as run:`` ... ``run.report``.

    ``s3``: start (or use ``o.s3_endpoint``) an S3 endpoint, ``run.srv``; the objects under its prefix are deleted
    at the end. ``packages``: versions recorded in the report's machine. ``fields``: more report fields, in order
    after bench, machine and options. At exit the report gets ``load_avg_end`` and ``seconds``."""

    def __init__(self, bench: str, o: BenchTarget, echo: Callable[[str], None] = print, *, s3: bool = True,
                 s3_domain: str | None = None, packages: Sequence[str] = (), logs: str | None = None,
                 **fields: Any) -> None:
        self.o, self.echo, self.logs = o, echo, logs
        self._s3, self._s3_domain = s3, s3_domain
        self.report: dict[str, Any] = {"bench": bench, "machine": machine(), "options": asdict(o), **fields}
        for pkg in packages:
            with contextlib.suppress(Exception):
                from importlib.metadata import version

                self.report["machine"][pkg] = version(pkg)
        self._prefix = f"kvbm-bench-{bench}-"
        self._stack = contextlib.ExitStack()
        self.work = Path()
        self.srv: dict[str, Any] | None = None
        self.t0 = 0.0

    def __enter__(self) -> BenchRun:
        self.t0 = time.perf_counter()
        with self._stack as es:  # a failed start unwinds what did start
            self.work = es.enter_context(temp_dir(self._prefix, self.o.workdir))
            if self._s3:
                o = self.o
                self.srv = es.enter_context(s3_server(self.work, endpoint=o.s3_endpoint, access_key=o.s3_access_key,
                                                      secret_key=o.s3_secret_key, bucket=o.s3_bucket,
                                                      domain=self._s3_domain))
                es.callback(self._clean_bucket)
            self._stack = es.pop_all()
        return self

    def _clean_bucket(self) -> None:
        assert self.srv is not None
        with contextlib.suppress(Exception):  # cleanup of a shared bucket: a failure must not hide the run's error
            delete_prefix(self.srv, self.srv["prefix"])

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stack.__exit__(et, e, tb)
        self.report["load_avg_end"] = load_avg()
        self.report["seconds"] = round(time.perf_counter() - self.t0, 1)

    def keep_log(self, path: Path, name: str) -> None:
        """Copy a server's log to the ``logs`` folder the options named (if any), as ``name``."""
        if self.logs and path.exists():
            Path(self.logs).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, Path(self.logs) / name)
