"""What both daemon clients share (:mod:`kvbm.client`): the G2 mapping, message building, and the
copies between caller buffers and G2 slots."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import zmq

from kvbm import protocol as p
from kvbm.blocks import BlockKey
from kvbm.blocks.layout import KVLayout
from kvbm.client.errors import DaemonError, Overloaded
from kvbm.client.lease import pin_window, session_budget
from kvbm.tiers.host import HostTier

R = TypeVar("R")
Buffer = Any  # bytes-like, numpy array or torch tensor (CPU or CUDA)


def client_options(dc: Any, *, admin: bool = False) -> dict[str, Any]:
    """Client keyword arguments for a :class:`kvbm.config.DaemonConfig`: CURVE keys from its files, the
    tenant token of ``tenant_token_file`` and, with ``admin``, the admin token when this user can read its
    file ("" otherwise: no admin session)."""
    from kvbm.security import admin_token_path, client_curve, read_admin_token, read_tenant_token

    server, keypair = client_curve(dc)
    out: dict[str, Any] = {"curve_server_key": server, "curve_keypair": keypair,
                           "tenant_token": read_tenant_token(dc.tenant_token_file, "daemon.tenant_token_file")}
    if admin:
        out["admin_token"] = read_admin_token(admin_token_path(dc))
    return out


def _flat_u8(buf: Buffer) -> torch.Tensor:
    """A flat uint8 tensor view of ``buf`` (no copy for tensors, numpy arrays and writable buffers)."""
    if isinstance(buf, torch.Tensor):
        return buf.detach().contiguous().view(torch.uint8).reshape(-1)
    arr = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, (bytes, bytearray, memoryview)) else buf
    arr = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    if not arr.flags.writeable:
        arr = arr.copy()  # a source only; torch cannot wrap read-only memory
    return torch.from_numpy(arr)


def _host_u8(buf: Buffer) -> np.ndarray | None:
    """A flat uint8 numpy view of a host buffer (no copy when it is contiguous); None for a device tensor."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            return None
        return buf.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _host_out(buf: Buffer) -> np.ndarray | None:
    """A flat writable uint8 numpy view of a contiguous host output buffer, or None (a device tensor, or a
    buffer written through a copy: the torch path keeps what it did for those)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            return None
        return buf.detach().reshape(-1).view(torch.uint8).numpy()
    arr = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, (bytes, bytearray, memoryview)) else buf
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous or not arr.flags.writeable:
        return None
    return arr.reshape(-1).view(np.uint8)


def _host_rows(bufs: Any) -> np.ndarray | None:
    """A 2-D host array or tensor of one block per row as uint8 rows (None for anything else)."""
    if isinstance(bufs, torch.Tensor) and bufs.ndim == 2 and bufs.device.type == "cpu":
        bufs = bufs.detach().contiguous().view(torch.uint8).numpy()  # bytes first: bf16/fp8 have no numpy dtype
    if not isinstance(bufs, np.ndarray) or bufs.ndim != 2:
        return None
    return np.ascontiguousarray(bufs).view(np.uint8).reshape(len(bufs), -1)


def _nbytes(buf: Buffer) -> int:
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    return memoryview(buf).nbytes if not isinstance(buf, np.ndarray) else buf.nbytes


# Requests that may be sent again after re-registering (a CommitStore or Release would refer to slots or
# pins the daemon already dropped with the old registration).
_RESENDABLE = (p.Ping, p.Lookup, p.Stats, p.PrepareStore, p.Onboard, p.Barrier, p.Evict)


class _Core:
    """Message building and the G2 mapping shared by both clients."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 10.0,
        max_message_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES,
        curve_server_key: str = "",
        curve_keypair: tuple[bytes, bytes] | None = None,
        admin_token: str = "",
        tenant_token: str = "",
        map_g2: bool = True,
    ) -> None:
        self.endpoint = endpoint
        # False for a session that only pins and looks up (the connector's scheduler): another process copies
        # out of the pool, so this one neither maps it nor (on a CUDA host) registers it with the driver.
        self.map_g2 = map_g2
        self.admin_token = admin_token
        self.tenant_token = tenant_token
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.curve_server_key = curve_server_key
        self.curve_keypair = curve_keypair
        self.token = ""
        self.namespace = ""
        self.registered: p.Registered | None = None
        self.g2: HostTier | None = None
        self.generation = ""  # of the G2 pool mapped in self.g2 (or registered with, unmapped)
        self._reg_msg: p.Register | None = None
        self._rids = itertools.count(1)

    def _setup(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve_server_key:
            pub, sec = self.curve_keypair or zmq.curve_keypair()
            sock.curve_serverkey = self.curve_server_key.encode()
            sock.curve_publickey = pub
            sock.curve_secretkey = sec
        sock.connect(self.endpoint)

    def _prep(self, msg: Any) -> bytes:
        msg.rid = next(self._rids)
        if not isinstance(msg, p.Register):
            msg.token = self.token
        if isinstance(msg, p._SlotReq):
            msg.generation = self.generation
        return p.encode(msg, self.max_message_bytes)

    def _reregister(self, msg: Any, reply: Any) -> bool:
        """Whether to register again and resend: the daemon forgot us (restart, lease) and ``msg`` is safe."""
        return (isinstance(reply, p.Error) and reply.code in (p.E_UNREGISTERED, p.E_STALE)
                and self._reg_msg is not None and isinstance(msg, _RESENDABLE))

    @staticmethod
    def _check(reply: Any, expect: type[R]) -> R:
        if isinstance(reply, p.Shed):
            raise Overloaded(reply.retry_after_ms)
        if isinstance(reply, p.Error):
            raise DaemonError(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise DaemonError(p.E_BAD_REQUEST, f"expected {expect.__name__}, got {type(reply).__name__}")
        return reply

    def _ns(self, keys: Sequence[BlockKey | bytes]) -> tuple[str, list[bytes]]:
        """One namespace and the hashes; plain hashes use this worker's namespace."""
        if not keys:
            return self.namespace, []
        if isinstance(keys[0], BlockKey):
            ns = keys[0].namespace
            if any(k.namespace != ns for k in keys):  # type: ignore[union-attr]
                raise ValueError("all keys of one request must share a namespace")
            return ns, [k.hash for k in keys]  # type: ignore[union-attr]
        return self.namespace, list(keys)  # type: ignore[arg-type]

    def _register_msg(self, layout: KVLayout, worker_id: str, engine_id: str, tp_rank: int | None,
                      tp_size: int | None, g1_capacity_blocks: int) -> p.Register:
        return p.Register(
            worker_id=worker_id or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}",
            engine_id=engine_id or "engine", layout=layout,
            tp_rank=layout.tp_rank if tp_rank is None else tp_rank,
            tp_size=layout.tp_size if tp_size is None else tp_size,
            g1_capacity_blocks=g1_capacity_blocks, admin_token=self.admin_token, tenant_token=self.tenant_token,
        )

    def _attach(self, reg: p.Registered) -> None:
        if isinstance(reg, p.Error):
            raise DaemonError(reg.code, reg.message)
        self.token, self.namespace, self.registered = reg.token, reg.namespace, reg
        if not self.map_g2:
            self.generation = reg.generation  # what this session's pins name
            return
        # A new generation is a new pool even under the same name: the old mapping is an orphan.
        if self.g2 is None or self.g2.shm_name != reg.shm_name or self.generation != reg.generation:
            self._detach()
            self.g2 = HostTier.attach(reg.shm_name, reg.capacity_bytes, reg.slot_bytes)
            self.generation = reg.generation

    def _forget(self) -> None:
        """Drop the registration, the G2 mapping and the socket (after Unregister, or when it failed)."""
        self.token = ""
        self._reg_msg = None
        self._detach()
        self._reset()

    def _detach(self) -> None:
        if self.g2 is not None:
            self.g2.release()
            self.g2 = None
        self.generation = ""

    def _store_msgs(self, keys: Sequence[BlockKey | bytes], bufs: Sequence[Buffer]) -> tuple[str, list[bytes], int]:
        if len(keys) != len(bufs):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        ns, hashes = self._ns(keys)
        sizes = {_nbytes(b) for b in bufs}
        if len(sizes) > 1:
            raise ValueError(f"buffers of one store must be equal-sized, got {sorted(sizes)}")
        return ns, hashes, sizes.pop() if sizes else 0

    def _covers(self, covers: Sequence[Sequence[BlockKey | bytes]] | None, ns: str, count: int) -> list[list[bytes]]:
        """A store's ``covers`` (per block, the partial blocks it supersedes) as hashes; ValueError naming the field
        when they are not one list per key, all in the store's namespace."""
        if not covers:
            return []
        if len(covers) != count:
            raise ValueError(f"covers: {len(covers)} lists for {count} keys (one per key)")
        out = []
        for c in covers:
            cns, hashes = self._ns(list(c))
            if hashes and cns != ns:
                raise ValueError(f"covers: namespace {cns!r} is not the store's {ns!r}")
            out.append(hashes)
        return out

    def _store_step(self, count: int, batch: int, in_flight: int) -> int:
        """Blocks per PrepareStore of a store of ``count`` blocks: ``batch``; but a store of more blocks than this
        session may hold at once (the slot budget the daemon states, else G2's slots) streams through G2, in
        batches whose ``in_flight`` reserved at once fit in :func:`kvbm.client.lease.pin_window` (a committed
        batch's slots are free again once written below), instead of failing whole with ``full``."""
        reg = self.registered
        if reg is None or not reg.num_slots:
            return batch
        if count <= min(session_budget(reg), batch):
            return batch
        return max(1, min(batch, pin_window(reg) // max(1, in_flight)))

    @staticmethod
    def _full_waits(deadline: float) -> Iterator[float]:
        """Backoff delays while a streamed store's batch is refused ``full`` until ``deadline`` (monotonic): G2
        then holds this store's own committed batches still being written down, and they free their slots soon
        (a write-down takes milliseconds); a daemon whose G2 stays pinned answers ``full`` at the deadline."""
        delay = 0.002
        while time.monotonic() + delay < deadline:
            yield delay
            delay = min(delay * 2, 0.1)

    def _copy_in(self, slots: Sequence[int | None], bufs: Sequence[Buffer], n: int) -> None:
        """Copy each buffer into its reserved slot: host buffers through numpy (a torch copy per 1 KiB block
        costs ~20x more in dispatch than the bytes), a 2-D host array of the whole batch in one indexed copy,
        device tensors through torch."""
        g2 = self.g2
        assert g2 is not None, "register first"
        sb = g2.slot_bytes
        pool = g2.pool.numpy()
        rows = _host_rows(bufs)
        if rows is not None:
            if len(rows) != len(slots):
                raise ValueError(f"{len(slots)} slots but {len(rows)} buffers")
            take = [i for i, s in enumerate(slots) if s is not None]
            idx = np.asarray([slots[i] for i in take], dtype=np.int64)
            # Every slot given (the usual case): the rows as a view, so the batch is copied once, into G2.
            src = rows[:, :n] if len(take) == len(rows) else rows[take, :n]
            pool[: g2.num_slots * sb].reshape(g2.num_slots, sb)[idx, :n] = src
            return
        for slot, buf in zip(slots, bufs, strict=True):
            if slot is None:
                continue
            src = _host_u8(buf)
            if src is None:
                g2.slot_tensor(slot, n).copy_(_flat_u8(buf))
            else:
                pool[slot * sb : slot * sb + n] = src

    def _copy_out(self, rep: p.Onboarded, outs: Sequence[Buffer]) -> None:
        """Copy each onboarded slot into its output: into host memory through numpy (one memcpy; torch's copy
        splits a large block over its intra-op threads, which on a loaded 2-core host took 10x as long: 8 MiB
        blocks, 370 ms against 30 ms for 256 MiB), into device tensors through torch."""
        assert self.g2 is not None, "register first"
        pool = self.g2.pool.numpy()
        sb = self.g2.slot_bytes
        for slot, nb, out in zip(rep.slots, rep.nbytes, outs, strict=False):
            host = _host_out(out)
            if host is not None:
                if host.size < nb:
                    raise ValueError(f"output buffer of {host.size} bytes < block of {nb}")
                np.copyto(host[:nb], pool[slot * sb : slot * sb + nb])
                continue
            dst = _flat_u8(out)
            if dst.numel() < nb:
                raise ValueError(f"output buffer of {dst.numel()} bytes < block of {nb}")
            dst[:nb].copy_(self.g2.slot_tensor(slot, nb))
