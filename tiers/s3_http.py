"""Moved to :mod:`kvbm.tiers.s3.http`; this alias keeps the old import path working."""

from kvbm.tiers.s3.bodies import BodyBackend
from kvbm.tiers.s3.http import HttpBodyClient, S3HttpError

__all__ = ["BodyBackend", "HttpBodyClient", "S3HttpError"]
