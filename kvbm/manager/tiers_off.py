"""Starting the tiers, and turning off one that cannot start when the caller can serve without it.

A G3 directory the daemon can read but not write (a read-only or immutable filesystem) is not turned off: the disk
tier starts read-only (:class:`~kvbm.tiers.disk.DiskTier`), so what it holds is still served and still paid to the
bucket. One that cannot start at all (a directory that cannot be created or read) still lets the daemon serve G2 and
G4: the disk tier is taken out of the tier order (as if ``disk.enabled`` were false), logged loudly, and reported as
a tier of kind ``off`` with the reason (``kvbm status`` shows it). Only a kind the caller names as optional is turned
off, and only for a start failure that names the setting (:class:`ConfigError`) or an OS error; another process
holding the directory (``DiskDirBusy``) still stops the start."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvbm.errors import ConfigError
from kvbm.manager.state import ManagerState

log = logging.getLogger(__name__)


async def start_tiers(state: ManagerState, optional: Sequence[str] = ()) -> None:
    """Start every tier of ``state``; one of a kind in ``optional`` that fails to start is turned off."""
    for tier in list(state.tiers):
        try:
            await tier.start()
        except (ConfigError, OSError) as e:
            if tier.kind not in optional:
                raise
            why = str(e) or type(e).__name__
            state.turn_off(tier, why)
            log.error("%s (%s) is OFF: it could not start, and the daemon serves without it: %s", tier.name,
                      tier.kind, why)
            try:
                await tier.close()
            except Exception:  # it never started; nothing of it is in use
                log.debug("close of %s (off) failed", tier.name, exc_info=True)


def off_rows(state: ManagerState) -> list[dict[str, object]]:
    """The tiers turned off, as rows of ``describe()``: kind ``off``, no capacity, and why."""
    return [{"tier": name, "kind": "off", "capacity_bytes": 0, "used_bytes": 0, "blocks": 0, "off": why, "stats": {}}
            for name, why in state.off.items()]
