"""G4: the S3 tier as a package; ``from kvbm.tiers.s3 import S3Tier, make_s3_tier, ...`` keeps working.

Modules: :mod:`.tier` (S3Tier, the Tier data path), :mod:`.http` (the ``http`` body client).
"""

from kvbm.tiers.s3.http import BodyBackend, HttpBodyClient, S3HttpError
from kvbm.tiers.s3.tier import (
    DELETE_CHUNK,
    HEADER_LEN,
    LIST_PAGE,
    LIST_SERIAL_PAGES,
    META_FORMAT,
    UNSIGNED_SIGV4,
    CircuitBreaker,
    S3Stats,
    S3Tier,
    make_s3_tier,
)

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
