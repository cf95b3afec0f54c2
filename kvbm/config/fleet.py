"""The ``fleet`` section: peer reads, daemons serving each other's G2/G3 blocks over NIXL (see
:mod:`kvbm.daemon.peer_reads`). Bounds are checked as the section is built, so a bad value is an error naming
its field (``fleet.peer_read_budget_ms: Expected `float` >= 0``)."""

from __future__ import annotations

from typing import Annotated

import msgspec


class FleetConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Serve peer reads and read from peers: this daemon binds p2p_endpoint, announces it on its events stream, and
    # a lookup whose blocks a followed peer holds in G2/G3 (and this daemon only in the bucket, or nowhere) reads
    # them from that peer's G2 with a one-sided NIXL (UCX) READ. Needs an events_endpoint and NIXL.
    p2p: bool = False
    p2p_endpoint: str = "tcp://127.0.0.1:0"  # the peer-read request socket (CURVE as the request socket)
    announce_p2p_endpoint: str = ""  # what peers dial; empty: the bound endpoint
    # How long a lookup waits for a peer read; past it the lookup answers with what it has (the bucket, or a
    # recompute) and a read still running fills G2 for the next lookup.
    peer_read_budget_ms: Annotated[float, msgspec.Meta(ge=0, le=600_000)] = 200.0
    peer_read_max_blocks: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 256  # blocks one peer read asks for
    # Serving side: peer reads whose blocks are pinned here at once; beyond it a peer is answered `busy`.
    peer_read_max_inflight: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 4
    # Serving side: a peer's pin is released after this long even if it never says it is done (it died).
    peer_read_lease_ms: Annotated[float, msgspec.Meta(gt=0, le=600_000)] = 5000.0
    # The credential this daemon presents to peers that have tenants: a file holding their admin token (every
    # namespace) or a tenant's token there (that tenant's namespaces, as a worker's Register). Empty: none.
    peer_read_token_file: str = ""
