"""Shared benchmark plumbing: machine description, CPU meters, timing helpers, temp S3 server."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbm.daemon.launch import STARTED, DaemonLauncher

MB = 1_000_000  # throughput is reported in MB/s (10^6 bytes), as in the notes


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
                break
    d: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "memory_bytes": mem,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        # `uptime`'s load averages when the run started: other work on the machine skews every figure.
        "load_avg_1_5_15": load_avg(),
    }
    try:
        import torch

        d["torch"] = torch.__version__
        d["cuda"] = bool(torch.cuda.is_available())
    except ImportError:
        d["torch"] = None
    try:
        import numpy

        d["numpy"] = numpy.__version__
    except ImportError:
        pass
    for mod in ("nixl_cu12", "nixl_cu13", "aiobotocore", "boto3"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            d[mod] = version(mod.replace("_", "-"))
    return d


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages (as `uptime` prints them)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _clk_tck() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return 100


def proc_cpu_seconds(pid: int) -> float:
    """user+sys CPU seconds of ``pid`` and every process in its process group (0.0 if gone)."""
    tck = _clk_tck()
    total = 0.0
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = None
    pids = {pid}
    if pgid is not None and pgid != os.getpgrp():  # a child in our own group: the group is us too, not its own
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if int(fields[2]) == pgid:  # field 5 (pgrp) counted from the state field (3)
                pids.add(int(d))
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / tck  # utime, stime (fields 14, 15)
    return total


@dataclass
class BenchTarget:
    """Where a bench runs: its temp dirs (a real disk; default $TMPDIR) and its S3 server (an existing
    loopback endpoint instead of a fresh SeaweedFS). Every bench's options extend it."""

    workdir: str | None = None
    s3_endpoint: str | None = None
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_bucket: str = "kvbm-bench"


class CpuMeter:
    """Wall time, this process's CPU (RUSAGE_SELF user+sys, all threads) and a server's CPU over a block."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self.wall = self.cpu = 0.0
        self.server_cpu: float | None = None

    @staticmethod
    def _self_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def __enter__(self) -> CpuMeter:
        self._s0 = proc_cpu_seconds(self.server_pid) if self.server_pid else None
        self._c0 = self._self_cpu()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self.cpu = self._self_cpu() - self._c0
        if self._s0 is not None and self.server_pid:
            self.server_cpu = proc_cpu_seconds(self.server_pid) - self._s0


def writes_settled(stats: dict[str, Any]) -> bool:
    """Whether a daemon's stats show no write-through pending (background S3 PUTs would compete with a timed
    request, and a block owed to the bucket is not there yet)."""
    return not stats["manager"].get("pending_cascades") and not stats["daemon"].get("queue_depth")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (q in 0..100)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "mean": float(statistics.fmean(xs)) if xs else 0.0,
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "min": float(min(xs)) if xs else 0.0,
        "max": float(max(xs)) if xs else 0.0,
    }


@contextlib.contextmanager
def temp_dir(prefix: str, base: str | None = None) -> Iterator[Path]:
    """A temp dir removed afterwards (``base``: where to create it, e.g. a real disk rather than tmpfs; made if
    missing, as ``mkdir -p``)."""
    if base is not None:
        Path(base).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=base) as d:
        yield Path(d)


@contextlib.contextmanager
def s3_server(base: Path, *, endpoint: str | None = None, access_key: str = "", secret_key: str = "",
              bucket: str = "kvbm-bench", domain: str | None = None) -> Iterator[dict[str, Any]]:
    """A loopback S3 endpoint: ``endpoint`` if given (never started or stopped here), else a fresh embedded
    SeaweedFS in ``base`` (stopped afterwards; with ``domain`` it also answers virtual-hosted requests for
    ``<bucket>.<domain>``). Yields {endpoint, access_key, secret_key, bucket, pid, prefix}."""
    prefix = f"kvbm-bench-{uuid.uuid4().hex[:10]}"
    if endpoint:
        yield {"endpoint": endpoint, "access_key": access_key, "secret_key": secret_key, "bucket": bucket,
               "pid": None, "prefix": prefix, "embedded": False}
        return
    from kvbm.s3server import EmbeddedS3

    srv = EmbeddedS3(base / "seaweedfs", bucket=bucket, access_key="kvbm-bench",
                     secret_key=uuid.uuid4().hex, reuse=False, stop_timeout_s=5.0,
                     extra_args=(f"-s3.domainName={domain}",) if domain else ())
    srv.start()
    try:
        yield {"endpoint": srv.endpoint, "access_key": srv.access_key, "secret_key": srv.secret_key,
               "bucket": bucket, "pid": srv.pid, "prefix": prefix, "embedded": True}
    finally:
        srv.stop(force=False)


def boto3_client(srv: dict[str, Any], pool: int = 16) -> Any:
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.client(
        "s3", endpoint_url=srv["endpoint"], aws_access_key_id=srv["access_key"],
        aws_secret_access_key=srv["secret_key"], region_name="us-east-1",
        config=BotoConfig(max_pool_connections=pool, s3={"addressing_style": "path"},
                          retries={"max_attempts": 3, "mode": "standard"},
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"),
    )


def key_pages(cli: Any, bucket: str, prefix: str) -> Iterator[list[str]]:
    """The keys under ``prefix``, one list per LIST page (boto3 client)."""
    token = None
    while True:
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": 1000}
        if token:
            kw["ContinuationToken"] = token
        resp = cli.list_objects_v2(**kw)
        yield [o["Key"] for o in resp.get("Contents", ()) or ()]
        if not resp.get("IsTruncated"):
            return
        token = resp.get("NextContinuationToken")


def delete_prefix(srv: dict[str, Any], prefix: str) -> int:
    """Delete every object under ``prefix`` in the bench bucket (cleanup); returns how many."""
    cli = boto3_client(srv)
    n = 0
    try:
        for keys in key_pages(cli, srv["bucket"], prefix):
            if keys:
                cli.delete_objects(Bucket=srv["bucket"], Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
                n += len(keys)
    finally:
        cli.close()
    return n


def write_json(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """Write ``report`` with every credential redacted (option values and any string containing one)."""
    from kvbm.redact import redact

    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(redact(report, values=_secret_values(report)), indent=2, default=str) + "\n")


def _secret_values(report: dict[str, Any]) -> tuple[str, ...]:
    """Secrets the report's options carry, plus those in the environment, so copies elsewhere are masked."""
    from kvbm.redact import is_secret_name

    opts = report.get("options") or {}
    found = [str(v) for k, v in opts.items() if is_secret_name(k) and v]
    found += [v for k, v in os.environ.items() if is_secret_name(k) and len(v) >= 8]
    return tuple(found)


def rnd_bytes(n: int, seed: int) -> Any:
    """``n`` incompressible bytes as a uint8 numpy array."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


class DaemonProc(DaemonLauncher):
    """``python -m kvbm.cli.serve`` in a subprocess for a bench (:class:`DaemonLauncher`): the KVBM_*/AWS_*
    variables of the bench do not reach it; its endpoint and CPU time at hand."""

    def __init__(self, root: Path, cfg: dict[str, Any], name: str = "daemon", args: Sequence[str] = ()) -> None:
        super().__init__(root, cfg, name=name, args=args, strip_env=("KVBM_", "AWS_"))
        self.endpoint: str = cfg["daemon"]["endpoint"]

    def start(self, timeout_s: float = 120.0, marks: Sequence[str] = (STARTED,),
              ready: Callable[[], bool] | None = None) -> dict[str, Any]:
        return super().start(timeout_s, marks, ready)  # a bench's daemon may start on a loaded machine

    def cpu(self) -> float:
        return proc_cpu_seconds(self.proc.pid) if self.proc else 0.0
