"""BodyBackend: the interface of the S3 tier's block-body movers (:mod:`.http`, :mod:`.nixl`); without one
(``s3.client: aiobotocore``) the tier moves bodies itself."""

from __future__ import annotations

from typing import Protocol

from kvbm.blocks import BlockKey


class BodyBackend(Protocol):
    """Moves block bodies for the S3 tier; control calls stay on aiobotocore."""

    async def put(self, okey: str, key: BlockKey, payload: memoryview, meta: dict[str, str]) -> None:
        """Store ``header || payload`` as ``okey``; raises on any failure (the write did not happen)."""

    async def get_into(self, okey: str, key: BlockKey, view: memoryview) -> int | None:
        """Verified payload of ``okey`` into ``view``: its length, None if there is no such object.
        Raises CorruptBlockError for a corrupt or truncated object, ValueError if ``view`` is too small."""

    def close(self) -> None: ...
