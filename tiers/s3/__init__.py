"""G4: S3-compatible object storage, as a package; ``from kvbm.tiers.s3 import S3Tier, make_s3_tier, ...`` works.

Modules, each with one job:

* :mod:`.tier`: :class:`S3Tier`, the Tier data path (put, get_into, delete) and the key/format scheme; it holds a
  session, a block mover, a listing and a bulk mover (below) and hands them its index and counters.
* :mod:`.blocks`: :class:`S3Blocks`, PUT and GET of one block (shedding, breaker, index bookkeeping).
* :mod:`.session`: :class:`S3Session`, client set-up, credentials, naming, health, offline -> online.
* :mod:`.connect`: the bucket check and the http / NIXL body clients' start, each proven by a write + read.
* :mod:`.listing`: LIST (paged, parallel), the index-rebuilding scan, usage per namespace.
* :mod:`.bulk`: HEAD/exists of many blocks, batch deletes, auxiliary objects.
* :mod:`.fastlist`: the fast LIST reply parser (timestamps, ``<Contents>``).
* :mod:`.breaker`: :class:`CircuitBreaker`.
* :mod:`.codes`: S3 error codes (miss, bad credentials) and one-line error text.
* :mod:`.bodies`: the :class:`BodyBackend` interface, implemented by :mod:`.http`, :mod:`.aio` and :mod:`.nixl`.
* :mod:`.factory`: :func:`make_s3_tier` (credentials from arguments, config or environment).
"""

from kvbm.tiers.s3.blocks import META_FORMAT
from kvbm.tiers.s3.bodies import BodyBackend
from kvbm.tiers.s3.breaker import CircuitBreaker
from kvbm.tiers.s3.bulk import DELETE_CHUNK
from kvbm.tiers.s3.factory import make_s3_tier
from kvbm.tiers.s3.http import HttpBodyClient, S3HttpError
from kvbm.tiers.s3.listing import LIST_PAGE, LIST_SERIAL_PAGES
from kvbm.tiers.s3.session import HEADER_LEN, UNSIGNED_SIGV4, S3Stats
from kvbm.tiers.s3.tier import S3Tier

__all__ = [
    "DELETE_CHUNK",
    "HEADER_LEN",
    "LIST_PAGE",
    "LIST_SERIAL_PAGES",
    "META_FORMAT",
    "UNSIGNED_SIGV4",
    "BodyBackend",
    "CircuitBreaker",
    "HttpBodyClient",
    "S3HttpError",
    "S3Stats",
    "S3Tier",
    "make_s3_tier",
]
