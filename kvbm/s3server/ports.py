"""Ports for an embedded SeaweedFS: each of its four servers takes a port and, by SeaweedFS's gRPC
convention, port + 10000; all are drawn so that neither can collide with client sockets."""

from __future__ import annotations

import random
import socket

from kvbm.config import SEAWEED_GRPC_OFFSET, check_embedded_port
from kvbm.errors import TierUnavailableError

# Ports are drawn below the Linux ephemeral range (32768+) so client sockets cannot take them, and so that
# port + 10000 (SeaweedFS's gRPC convention) stays below it too.
_PORT_LO, _PORT_HI = 10000, 22700
PORT_NAMES = ("s3", "master", "volume", "filer")
GRPC_OFFSET = SEAWEED_GRPC_OFFSET
check_port = check_embedded_port


def port_free(port: int) -> bool:
    if not 0 < port < 65536:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Like Go's listeners: a port with only TIME_WAIT leftovers counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_pair_free(port: int) -> bool:
    return port_free(port) and port_free(port + 10000)


def pick_ports(n: int = 4, first: int = 0, avoid: set[int] | None = None) -> list[int]:
    """``n`` distinct ports that are free together with port+10000; ``first`` (if non-zero) is used as is."""
    taken = set(avoid or ())
    out: list[int] = []
    if first:
        out.append(first)
        taken |= {first, first + 10000, first - 10000}
    rng = random.SystemRandom()
    for _ in range(5000):
        if len(out) == n:
            return out
        p = rng.randrange(_PORT_LO, _PORT_HI)
        if p in taken or p + 10000 in taken or p - 10000 in taken:
            continue
        if port_pair_free(p):
            out.append(p)
            taken |= {p, p + 10000, p - 10000}
    raise TierUnavailableError("could not find free ports for SeaweedFS")


def choose_ports(old: dict[str, int], port: int) -> dict[str, int]:
    """The ports for a launch: the dir's previous ones (``old``) while all are free and agree with ``port``
    (so a restart comes back on the same endpoint), else fresh ones with ``port`` (if non-zero) for S3."""
    if (
        old and set(old) >= set(PORT_NAMES) and (not port or port == old["s3"])
        and all(port_pair_free(old[n]) for n in PORT_NAMES)
    ):
        return {n: old[n] for n in PORT_NAMES}
    if port and not port_pair_free(port):
        raise TierUnavailableError(f"port {port} (or its gRPC port {port + 10000}) is in use")
    return dict(zip(PORT_NAMES, pick_ports(len(PORT_NAMES), first=port), strict=True))
