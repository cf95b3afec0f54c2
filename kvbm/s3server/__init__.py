"""Launch and manage a local SeaweedFS (``weed server -s3``) as kvbm's embedded S3 endpoint.

``EmbeddedS3`` starts a real ``weed`` process bound to 127.0.0.1 with its own free ports, waits until an
authenticated PUT into the bucket succeeds, and stops it again (SIGTERM to the process group, SIGKILL
after ``stop_timeout_s``). It can also leave the server running as a background service
(``detach()``, used by ``kvbm serve`` and ``scripts/seaweedfs.sh``) and reuse one that is already running
from the same data dir. The data dir holds:

* ``identity.json``  - the S3 identity (access/secret key), mode 0600. Without an explicit secret the
                       dir's own is used: the one this file already holds, else a new random one (so no
                       two data dirs share a secret and none is published); it is never printed
* ``weed.log``       - the server's stdout/stderr
* ``weed.pid``       - the pid of a running server
* ``kvbm-s3.json``   - state: pid, all ports, access key (never the secret); ports are kept after a stop
                       so a restart on the same dir comes back on the same endpoint
* ``kvbm-s3.lock``   - ``flock``ed around "read state -> reuse, adopt or launch", so processes starting
                       the server on one dir at once (``kvbm serve`` next to ``kvbm status``) end up
                       sharing one server, never launching a second one on the same data

A ``weed`` already serving the dir that the state file does not name (an orphan) is adopted: reused and
written into the state file; one that does not accept our credentials is stopped before a new launch,
since it holds the filer's lock on the data and would kill the new server.

Command line: ``python -m kvbm.s3server start|stop|status --dir D [--port P]``.

Modules: ``weed`` (the binary, its command line and log), ``ports``, ``procs`` (process identity,
stopping), ``state`` (the dir's state, identity and lock files), ``probe`` (the readiness PUT),
``embedded`` (``EmbeddedS3``), ``service`` (ensure running, stop a dir) and ``cli``.
"""

from kvbm.s3server.cli import main
from kvbm.s3server.embedded import EmbeddedS3
from kvbm.s3server.ports import choose_ports, pick_ports, port_free
from kvbm.s3server.probe import PROBE_KEY, probe_put, s3_client
from kvbm.s3server.procs import pid_alive, pid_is_weed, terminate, weeds_serving
from kvbm.s3server.service import embedded_dir, embedded_from_config, ensure_running, running_from_config, stop_dir
from kvbm.s3server.state import IDENTITY_FILE, LOCK_FILE, LOG_FILE, PID_FILE, STATE_FILE, dir_lock
from kvbm.s3server.weed import find_weed, weed_runs

__all__ = [
    "IDENTITY_FILE",
    "LOCK_FILE",
    "LOG_FILE",
    "PID_FILE",
    "PROBE_KEY",
    "STATE_FILE",
    "EmbeddedS3",
    "choose_ports",
    "dir_lock",
    "embedded_dir",
    "embedded_from_config",
    "ensure_running",
    "find_weed",
    "main",
    "pick_ports",
    "pid_alive",
    "pid_is_weed",
    "port_free",
    "probe_put",
    "running_from_config",
    "s3_client",
    "stop_dir",
    "terminate",
    "weed_runs",
    "weeds_serving",
]
