"""The kvbm daemon: serves workers over ZeroMQ and wires their requests to the BlockManager.

One module per job:

* :mod:`~kvbm.daemon.core`: :class:`Daemon`, the thin wiring class (run, shutdown, lease reaper, snapshot).
* :mod:`~kvbm.daemon.transport`: the ROUTER socket: bind, CURVE, framing, admission (``max_queue``,
  ``max_inflight``), the receive loop, replies and error codes.
* :mod:`~kvbm.daemon.service`: the request handlers, plain methods taking a message and a session.
* :mod:`~kvbm.daemon.slots`: the slot requests (PrepareStore, CommitStore, Onboard, Release) within the budgets.
* :mod:`~kvbm.daemon.auth`: who may make which request (credentials: admin, tenants; namespaces).
* :mod:`~kvbm.daemon.barrier`: step barriers between the ranks of an engine.
* :mod:`~kvbm.daemon.events`: the block-event publisher (PUB socket, topic ``kvbm``).
* :mod:`~kvbm.daemon.peering`: this daemon in a fleet: bucket probe, peer followers and discovery, applied to the
  shared tier's index.
* :mod:`~kvbm.daemon.indexing`: listing the bucket apart from the other tiers, with retries.
* :mod:`~kvbm.daemon.prefetch`: bringing slow-tier hits up to G2 after a lookup.
* :mod:`~kvbm.daemon.logs`: JSON logs (:func:`configure_logging`, :func:`logj`).

Worker sessions, and the G2 slot references they hold, live in :mod:`kvbm.daemon.sessions`.
"""

from kvbm.daemon.core import STORE_TIER, Daemon, quarantine_grace_s, serve
from kvbm.daemon.indexing import INDEX_RETRY_S
from kvbm.daemon.logs import JsonFormatter, RedactFields, configure_logging, logj
from kvbm.daemon.stats import DaemonStats
from kvbm.daemon.transport import Handled

__all__ = [
    "INDEX_RETRY_S", "STORE_TIER", "Daemon", "DaemonStats", "Handled", "JsonFormatter", "RedactFields",
    "configure_logging", "logj", "quarantine_grace_s", "serve",
]
