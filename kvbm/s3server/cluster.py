"""``SeaweedCluster``: a distributed SeaweedFS on loopback, for fleet tests and benches that need more than one
``weed server``: one master (``-defaultReplication``), ``volumes`` volume servers, a filer, and ``gateways``
S3 gateways, each its own process bound to 127.0.0.1, every port (and its gRPC port + 10000) chosen free.

Replication ``001`` keeps two copies of every volume on two servers of the one rack (``010``: two racks; the
servers are then spread over two racks), so one volume server can be killed (:meth:`kill`) without losing an
acknowledged object. Command line: ``python -m kvbm.s3server.cluster --dir D`` (``scripts/seaweedfs_cluster.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.s3server.ports import pick_ports
from kvbm.s3server.probe import probe_put, s3_client
from kvbm.s3server.procs import terminate
from kvbm.s3server.state import write_identity
from kvbm.s3server.weed import MIN_FREE_SPACE, START_MARK, disk_refusal, find_weed, log_tail, weed_runs

REPLICATIONS = ("000", "001", "010", "100", "002", "011", "020", "200")


def _copies(replication: str) -> int:
    return 1 + sum(int(c) for c in replication)


class SeaweedCluster:
    """Master, volume servers, filer and S3 gateways on 127.0.0.1 under ``dir`` (see the module docstring)."""

    def __init__(self, dir: str | os.PathLike[str], *, volumes: int = 3, gateways: int = 2, replication: str = "001",
                 access_key: str = "kvbm", secret_key: str = "", bucket: str = "kvbm", weed: str | None = None,
                 volume_size_limit_mb: int = 64, startup_timeout_s: float = 90.0, stop_timeout_s: float = 2.0,
                 min_free_space: str = MIN_FREE_SPACE) -> None:
        if replication not in REPLICATIONS:
            raise ConfigError(f"replication {replication!r}: one of {', '.join(REPLICATIONS)}")
        if _copies(replication) > volumes:
            raise ConfigError(f"replication {replication} keeps {_copies(replication)} copies: needs as many "
                              f"volume servers, not {volumes}")
        if replication[0] != "0":
            raise ConfigError("replication across data centers is not laid out on loopback: use 0xy")
        if gateways < 1:
            raise ConfigError("gateways: at least 1")
        self.dir = Path(dir).absolute()
        self.volumes = volumes
        self.gateways = gateways
        self.replication = replication
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_urlsafe(32)
        self.bucket = bucket
        self.weed = weed
        self.volume_size_limit_mb = volume_size_limit_mb
        self.min_free_space = min_free_space
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._log_from: dict[str, int] = {}  # a process's log -> where its latest start's part begins

    # -- surface ---------------------------------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        """The S3 gateways' URLs (point different nodes at different ones)."""
        return [f"http://127.0.0.1:{self.ports[f's3-{i}']}" for i in range(self.gateways)]

    @property
    def endpoint(self) -> str:
        return self.endpoints[0]

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.ports['master']}"

    def volume_names(self) -> list[str]:
        return [f"volume-{i}" for i in range(self.volumes)]

    def __enter__(self) -> SeaweedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:  # never shows the secret
        return f"SeaweedCluster(dir={str(self.dir)!r}, gateways={self.endpoints if self.ports else []})"

    def start(self) -> SeaweedCluster:
        weed = self.weed or find_weed()
        if not weed:
            raise TierUnavailableError(weed_runs(None)[1])
        self.weed = weed
        self.dir.mkdir(parents=True, exist_ok=True)
        names = ["master", *self.volume_names(), "filer", *(f"s3-{i}" for i in range(self.gateways))]
        self.ports = dict(zip(names, pick_ports(len(names)), strict=True))
        ident = write_identity(self.dir, self.access_key, self.secret_key)
        try:
            self._launch("master", [
                "master", f"-mdir={self._sub('master')}", f"-defaultReplication={self.replication}",
                f"-volumeSizeLimitMB={self.volume_size_limit_mb}", "-telemetry=false", "-electionTimeout=1s"])
            for i, name in enumerate(self.volume_names()):
                self._launch_volume(name, i)
            self._wait(self._volumes_up, "volume servers registered with the master")
            self._launch("filer", ["filer", f"-master={self.master}", f"-defaultStoreDir={self._sub('filer')}",
                                   f"-defaultReplicaPlacement={self.replication}"])
            for i in range(self.gateways):
                self._launch(f"s3-{i}", ["s3", f"-filer=127.0.0.1:{self.ports['filer']}", f"-config={ident}",
                                         "-port.iceberg=0", "-port.lance=0"])
            for ep in self.endpoints:
                self._wait(lambda ep=ep: self._put_ok(ep), f"an authenticated PUT through {ep}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Every process: SIGTERM to its group, SIGKILL after ``stop_timeout_s`` (gateways first, master last)."""
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                terminate(proc.pid, self.stop_timeout_s, proc)

    def kill(self, name: str) -> None:
        """SIGKILL one process (``volume-1``, ``s3-0``...): a crash, not a clean stop."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def restart(self, name: str) -> None:
        """Start a killed volume server again on its port and data dir."""
        if not name.startswith("volume-"):
            raise ValueError("only volume servers restart on their own")
        self._launch_volume(name, int(name.split("-")[1]))

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def topology(self) -> dict[str, Any]:
        """The master's ``/dir/status`` (data centers, racks, data nodes, volumes)."""
        with urllib.request.urlopen(f"http://{self.master}/dir/status", timeout=3) as r:
            return json.loads(r.read())

    def chunk_holders(self, key_prefix: str) -> dict[str, int]:
        """How many chunks of the objects under ``key_prefix`` (in the bucket) each volume server holds a copy
        of, by process name (``volume-0``...): which server a test must kill to hit the data."""
        by_port = {self.ports[n]: n for n in self.volume_names()}
        client = s3_client(self.endpoint, self.access_key, self.secret_key)
        counts = dict.fromkeys(self.volume_names(), 0)
        where: dict[int, list[str]] = {}
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=key_prefix):
                for obj in page.get("Contents") or []:
                    url = f"http://127.0.0.1:{self.ports['filer']}/buckets/{self.bucket}/{obj['Key']}?metadata=true"
                    req = urllib.request.Request(url, headers={"Accept": "application/json"})
                    with urllib.request.urlopen(req, timeout=5) as r:
                        meta = json.loads(r.read())
                    for chunk in meta.get("chunks") or []:
                        vid = int(chunk["fid"]["volume_id"])
                        if vid not in where:
                            with urllib.request.urlopen(f"http://{self.master}/dir/lookup?volumeId={vid}",
                                                        timeout=5) as r:
                                locs = json.loads(r.read()).get("locations") or []
                            where[vid] = [by_port.get(int(loc["url"].rsplit(":", 1)[1]), loc["url"]) for loc in locs]
                        for name in where[vid]:
                            counts[name] = counts.get(name, 0) + 1
        finally:
            client.close()
        return counts

    def describe(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "replication": self.replication, "master": self.master,
                "gateways": self.endpoints, "bucket": self.bucket, "access_key": self.access_key,
                "processes": {n: {"pid": p.pid, "alive": p.poll() is None,
                                  "port": self.ports.get(n)} for n, p in self.procs.items()}}

    # -- internals -------------------------------------------------------------------------------------
    def _sub(self, name: str) -> Path:
        d = self.dir / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _rack(self, i: int) -> str:
        # 010 needs two racks; else one rack holds every server (001: copies on two servers of one rack)
        return f"rack{i % 2}" if self.replication[1] != "0" else "rack0"

    def _launch_volume(self, name: str, i: int) -> None:
        self._launch(name, ["volume", f"-dir={self._sub(name)}", "-max=0", f"-master={self.master}",
                            f"-minFreeSpace={self.min_free_space}", "-preStopSeconds=0", "-dataCenter=dc0",
                            f"-rack={self._rack(i)}"])

    def _launch(self, name: str, args: list[str]) -> None:
        port = self.ports[name]
        assert self.weed is not None
        argv = [self.weed, args[0], "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={port}",
                f"-port.grpc={port + 10000}", *args[1:]]
        log = self.dir / f"{name}.log"
        with open(log, "ab") as f:
            self._log_from[name] = f.tell()
            f.write(f"\n{START_MARK} {' '.join(argv)} at {time.ctime()} ===\n".encode())
            f.flush()
            self.procs[name] = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                cwd=self._sub(name), start_new_session=True)

    def _volumes_up(self) -> bool:
        try:
            topo = self.topology()["Topology"]
        except (OSError, ValueError, KeyError):
            return False
        nodes = [n for dc in topo.get("DataCenters") or [] for r in dc.get("Racks") or []
                 for n in r.get("DataNodes") or []]
        return len(nodes) >= self.volumes

    def _put_ok(self, endpoint: str) -> bool:
        client = s3_client(endpoint, self.access_key, self.secret_key, timeout=3.0)
        try:
            return probe_put(client, self.bucket)[0]
        finally:
            client.close()

    def _wait(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise TierUnavailableError(f"SeaweedFS {name} exited with code {proc.returncode} while waiting "
                                               f"for {what}:\n{log_tail(self.dir / f'{name}.log')}")
            for name in self.volume_names():
                refusal = disk_refusal(self.dir / f"{name}.log", self._log_from.get(name, 0))
                if refusal:
                    raise TierUnavailableError(f"SeaweedFS {name}: {refusal}")
            if time.monotonic() > deadline:
                raise TierUnavailableError(f"SeaweedFS cluster: no {what} after {self.startup_timeout_s:.0f}s "
                                           f"(logs in {self.dir})")
            time.sleep(0.25)


def main(argv: list[str] | None = None) -> int:
    """Run a cluster in the foreground until SIGINT/SIGTERM; print its gateways and credentials as JSON."""
    ap = argparse.ArgumentParser(prog="seaweedfs_cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--volumes", type=int, default=3)
    ap.add_argument("--gateways", type=int, default=2)
    ap.add_argument("--replication", default="001")
    ap.add_argument("--bucket", default="kvbm")
    ap.add_argument("--access-key", default="kvbm")
    ap.add_argument("--secret-key", default=os.environ.get("KVBM_EMBEDDED_S3_SECRET_KEY", ""),
                    help="default: $KVBM_EMBEDDED_S3_SECRET_KEY, else a random one (printed once)")
    a = ap.parse_args(argv)
    try:
        cluster = SeaweedCluster(a.dir, volumes=a.volumes, gateways=a.gateways, replication=a.replication,
                                 bucket=a.bucket, access_key=a.access_key, secret_key=a.secret_key)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with cluster:
        print(json.dumps({**cluster.describe(), "secret_key": cluster.secret_key}), flush=True)
        while not stop:
            time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
