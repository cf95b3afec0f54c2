"""A weight update (a new weights epoch) never lets the old weights' KV into the new epoch's namespace, whatever the
threads' interleaving. Real parts: the connector's worker side (its saver thread and session) against a real daemon.

Found by CI (round 16, ``test_vllm_server.py::test_a_weight_update_through_the_server_never_loads_the_old_weights_kv``:
the request after ``/pause`` got 768 cached tokens of the old weights). The daemon's log showed the saver's session
registering under the new epoch's namespace while the first request's saves were still due, then at once again: the
saver's link had read the epoch's generation, then (after a round trip to the daemon, during which the worker
followed the new epoch) its tag, so it registered under the new namespace as the old generation, and the save's
"planned in this generation?" check let the old weights' blocks in."""

from __future__ import annotations

import importlib.util
import threading

import pytest
from needs import needs
from test_vllm_outage import _worker as _outage_worker
from test_vllm_outage import daemon  # noqa: F401 (the daemon fixture)

from kvbm.blocks import BlockKey

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]

NEW_TAG = "reset=0123456789abcdef"


def _worker(endpoint: str):
    """The outage tests' worker side (k = 1), with the weights epoch the connector gives every engine."""
    from kvbm.integrations.vllm.epoch import WeightsEpoch

    return _outage_worker(endpoint, 1, epoch=WeightsEpoch(None), async_save=True, async_load=True)


def test_a_save_of_the_old_weights_never_lands_in_the_new_epoch_while_its_session_registers(daemon, monkeypatch):  # noqa: F811
    """The saver's session connects (again) for a save planned before the weight update; while its link asks the
    daemon for the block size (a round trip), the worker follows the scheduler's new epoch (vLLM's next step).
    The block must be stored under the old epoch's namespace (its KV is the old weights') or not at all; never
    under the new one, where the next request would load it."""
    from kvbm.integrations.vllm import BlockTransfer, KvbmConnectorMetadata, link

    w = _worker(daemon.endpoint)
    old_layout = w._link.layout  # the worker's own session registered at register_kv_caches: the old epoch
    # The saver's session opened at start-up too; dropped (on its thread: a link is one thread's), as an outage
    # drops it, so that this save connects it again: where the update can still land in its round trips.
    w.saver._pool.submit(w.saver._link.close).result(timeout=30)
    key = b"e" * 32
    in_round_trip, followed = threading.Event(), threading.Event()
    real = link.daemon_block_bytes

    def round_trip_across_the_update(client):  # the saver's connection: the update lands in its round trip
        in_round_trip.set()
        assert followed.wait(30), "the worker never followed the new epoch"
        return real(client)

    monkeypatch.setattr(link, "daemon_block_bytes", round_trip_across_the_update)
    try:
        w.wait_for_save(KvbmConnectorMetadata(k=1, saves=[BlockTransfer("r1", [key], [[2]])]))
        (job,) = w.saver._jobs["r1"]
        assert in_round_trip.wait(30), "the saver never connected"
        w.handle_preemptions(KvbmConnectorMetadata(k=1, weights=NEW_TAG))  # vLLM's next step, after the update
        assert w.epoch.tag == NEW_TAG
        followed.set()
        assert job.future.result(timeout=30) is None
        monkeypatch.setattr(link, "daemon_block_bytes", real)
        # The next request's lookup: a session of the new epoch (as the scheduler's, once it reset).
        reader = _worker(daemon.endpoint)
        try:
            reader.epoch.follow(NEW_TAG)
            client = reader._link.get()
            assert client is not None and reader._link.layout.namespace != old_layout.namespace
            leaked = client.lookup([BlockKey(reader._link.layout.namespace, key)]).matched
        finally:
            reader.shutdown()
        assert leaked == 0, "the old weights' block was stored under the new weights epoch"
        assert w.saver._link.gen == w.epoch.gen or w.saver._link.layout.namespace == old_layout.namespace, \
            "the saver's session is named for one epoch and counted as another"
    finally:
        followed.set()
        w.shutdown()
