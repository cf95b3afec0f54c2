"""Storage operations behind ``kvbm status``, ``kvbm purge`` and ``kvbm prewarm``.

The CLI only parses options and prints; everything that decides *what* to touch lives here, one job a
module:

* :mod:`kvbm.ops.inventory`: walk the disk dir and list the bucket (only kvbm block keys), select by scope.
* :mod:`kvbm.ops.purge`: plan what to delete (age, ``--all``, byte budget, access logs) and delete it safely.
* :mod:`kvbm.ops.purge_run`: one whole purge (:func:`run_purge`: list, rank, plan, ask, delete, tell the daemon).
* :mod:`kvbm.ops.prewarm`: turn hashes or prompts into keys and pull them into the disk or host tier.
* :mod:`kvbm.ops.link`: a registration-only admin session with a running daemon.
"""

from __future__ import annotations

from kvbm.blocks.keys import check_namespace, model_slug
from kvbm.config import parse_size
from kvbm.ops.inventory import (
    Entry,
    Selector,
    iso,
    iter_bucket,
    iter_disk,
    open_bucket,
    parse_duration,
    summarize,
    with_access,
)
from kvbm.ops.link import DaemonLink, daemon_reachable
from kvbm.ops.prewarm import (
    PrewarmReport,
    keys_from_hashes_file,
    keys_from_tokens_file,
    leading_runs,
    prewarm_disk,
    prewarm_host,
    prewarm_manager,
    rank_hottest,
)
from kvbm.ops.purge import DELETE_BATCH, DeleteResult, delete_bucket, delete_disk, plan_log_purge, plan_purge
from kvbm.ops.purge_run import PurgeOptions, PurgeUI, run_purge

__all__ = [
    "DELETE_BATCH", "DaemonLink", "DeleteResult", "Entry", "PrewarmReport", "PurgeOptions", "PurgeUI", "Selector",
    "check_namespace",
    "daemon_reachable", "delete_bucket", "delete_disk", "iso", "iter_bucket", "iter_disk", "keys_from_hashes_file",
    "keys_from_tokens_file", "leading_runs", "model_slug", "open_bucket", "parse_duration", "parse_size",
    "plan_log_purge", "plan_purge", "prewarm_disk", "prewarm_host", "prewarm_manager", "rank_hottest", "run_purge",
    "summarize",
    "with_access",
]
