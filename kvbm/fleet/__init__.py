"""Many daemons, one bucket: live sharing without a central registry.

Keys are content-addressed, so nodes computing the same prefix write the same objects; what a running
daemon lacks is *knowing* what the others stored since it listed the bucket. Two mechanisms close that gap:

* :mod:`kvbm.fleet.probe`: a lookup whose leading run ends at a block the index lacks asks the bucket (HEAD,
  batched, bounded) about the next blocks; misses are remembered for a TTL (negative cache).
* :mod:`kvbm.fleet.peers`: a daemon follows other daemons' event streams (``daemon.peers``, and the members
  discovery finds) and learns their G4 stores and removals as they happen; the probe covers peers it does not
  follow and lost messages.
* :mod:`kvbm.fleet.members`: with ``daemon.discovery`` each daemon announces itself in the bucket
  (``_members/{node}.json``) and follows every other member found there, joining and leaving without a list.

A block deleted from the bucket leaves the other nodes' indexes by the peer's event, or at the first read
(a 404 on GET is a miss that drops the entry).
"""

from kvbm.fleet.peers import PeerFollower, PeerStats
from kvbm.fleet.probe import BucketProbe, NegativeCache, ProbeStats

__all__ = ["BucketProbe", "NegativeCache", "PeerFollower", "PeerStats", "ProbeStats"]
