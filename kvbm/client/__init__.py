"""Worker-side clients of the kvbm daemon: :class:`WorkerClient` (blocking, ``blocking``) and
:class:`AsyncWorkerClient` (``aio``); what both share, from registration to the G2 mapping and the pipelined
store batches, is ``core``; the slot leases (reserve -> copy -> commit, onboard -> copy -> release) ``lease``.

Block bytes never travel over the socket: :meth:`register` maps the daemon's G2 slot pool (shared
memory), ``store`` copies into the slots the daemon reserved, ``load`` copies out of the slots it
onboarded into. The mapping follows the pool's generation: when a re-registration (after a daemon
restart, kill -9 or clean) reports a new one, the client maps the new pool, even under the same
``shm_name``, and its slot requests carry the generation so the daemon refuses any that do not match.
Requests carry ids; a reply that does not arrive within ``timeout_s`` raises
:class:`DaemonUnavailable` (and the socket is recreated, so a late reply cannot be mistaken for the next).
``WorkerClient(fail_fast=True)`` (the vLLM connector's) does not wait that long for a daemon that is gone: it
watches its socket (ZeroMQ monitor events, and ZMTP heartbeats for a peer that vanished without closing) and
raises :class:`DaemonUnavailable` as soon as the connection drops, is refused or fails its handshake.

Credentials: ``curve_server_key`` (the daemon's public key) turns CURVE on, with ``curve_keypair`` the
client's own keys (an allow-listed daemon needs them; without them a throwaway pair is made);
``admin_token`` (the daemon's admin token file, see :mod:`kvbm.security`) makes the registration an admin
one. :func:`client_options` reads all three from a config the way the CLI does.
"""

from kvbm.client.aio import AsyncWorkerClient
from kvbm.client.blocking import WorkerClient
from kvbm.client.core import client_options
from kvbm.client.errors import DaemonError, DaemonUnavailable, Overloaded

__all__ = ["AsyncWorkerClient", "DaemonError", "DaemonUnavailable", "Overloaded", "WorkerClient", "client_options"]
