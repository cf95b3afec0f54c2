"""A fleet on a distributed SeaweedFS (master, three volume servers with replication 001, a filer, two S3
gateways): nodes on different gateways discover each other and share blocks; a volume server killed under
them loses no acknowledged block, serves no wrong byte, and reads (then writes) go on."""

from __future__ import annotations

import uuid

import pytest
from needs import require
from serve_proc import wait_until
from test_discovery import FAST, connected_to
from test_fleet import Node, loads_exact, payload, prompt

from kvbm.s3server import weed_runs
from kvbm.s3server.cluster import SeaweedCluster

BLOCKS = 24  # 64 KiB each: B's G2 (1 MiB) holds 16, so B reads them in batches
WAIT_S = 90.0  # SeaweedFS notices a dead volume server within its heartbeat timeouts (tens of seconds)


class Gateway:
    """What :class:`Node` reads of an S3 server (endpoint and credentials), for one gateway of the cluster."""

    def __init__(self, cluster: SeaweedCluster, i: int) -> None:
        self.endpoint = cluster.endpoints[i]
        self.bucket = cluster.bucket
        self.access_key = cluster.access_key
        self.secret_key = cluster.secret_key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    ok, why = weed_runs()
    require("s3", ok, f"SeaweedFS cannot run here: {why}")
    with SeaweedCluster(tmp_path_factory.mktemp("weed-cluster"), replication="001", bucket="kvbm-cluster") as c:
        yield c


def batches(keys: list, n: int = 8) -> list[list]:
    return [keys[i : i + n] for i in range(0, len(keys), n)]


def read_all_exact(c, keys: list) -> int:
    return sum(loads_exact(c, part) for part in batches(keys))


def test_fleet_on_a_cluster_survives_a_dead_volume_server(tmp_path, cluster):
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    a = Node(tmp_path, "a", Gateway(cluster, 0), prefix, node_id="a", **FAST)
    b = Node(tmp_path, "b", Gateway(cluster, 1), prefix, node_id="b", **FAST)
    assert a.cfg["s3"]["endpoint"] != b.cfg["s3"]["endpoint"]
    a.start()
    b.start()
    try:
        keys = prompt(BLOCKS)
        with a.client() as ca, b.client() as cb:
            assert wait_until(lambda: connected_to(ca, {"b"}) and connected_to(cb, {"a"}), 30)
            for part in batches(keys):
                ack = ca.store(part, [payload(k) for k in part], durable=True)
                assert ack.durable == len(part)
            assert wait_until(lambda: cb.lookup(keys).matched == BLOCKS, 30)  # A's events, through gateway 2
            holders = cluster.chunk_holders(prefix + "/")
            victim = max(holders, key=lambda n: holders[n])  # the server with the most of these blocks
            assert holders[victim] > 0
            cluster.kill(victim)
            assert not cluster.alive(victim)
            # Every acknowledged block is still there, byte-exact, read through the other gateway.
            assert read_all_exact(cb, keys) == BLOCKS
            assert next(t for t in cb.stats()["tiers"] if t["tier"] == "G4")["stats"]["errors"] == 0
            # Writes go on once the master routes around the dead server; whatever is acked is readable.
            more = prompt(4)
            acked: list = []

            def store_more() -> bool:
                for k in more:
                    if k not in acked and ca.store([k], [payload(k)], durable=True).durable:
                        acked.append(k)
                return len(acked) == len(more)

            assert wait_until(store_more, WAIT_S, step=1.0), f"only {len(acked)} of 4 writes acked after the kill"
            assert wait_until(lambda: cb.lookup(more).matched == 4, 30)
            assert loads_exact(cb, more) == 4
    finally:
        a.stop()
        b.stop()
        for name in cluster.volume_names():
            if not cluster.alive(name):
                cluster.restart(name)


def test_a_cluster_whose_volume_servers_refuse_for_want_of_disk_is_named_at_once(weed_binary, tmp_path):
    """The volume servers' free-disk floor above what is free: the start fails naming it, not after 90 s."""
    import shutil
    import time

    from kvbm.errors import TierUnavailableError

    floor = f"{(shutil.disk_usage(tmp_path).free >> 20) + 8192}MiB"
    c = SeaweedCluster(tmp_path / "c", volumes=1, gateways=1, replication="000", weed=weed_binary,
                       min_free_space=floor)
    t0 = time.monotonic()
    with pytest.raises(TierUnavailableError, match=r"volume-0: SeaweedFS refuses writes: .* free on the disk"):
        c.start()
    assert time.monotonic() - t0 < 60 and not c.procs  # stopped: nothing left running
