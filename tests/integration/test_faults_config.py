"""Bad credentials and a taken port are start-up errors naming their field (issue 37, D10): read before any tier
is indexed, never a traceback. Every daemon is ``kvbm serve`` in a subprocess (tests/serve_proc.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq
from needs import needs
from serve_proc import ServeProc

from kvbm.security import write_keypair


def cfg(tmp: Path, **daemon: object) -> dict:
    return {
        "block_bytes": "64KiB", "device": {"enabled": False}, "host": {"capacity": "1MiB", "pin": False},
        "disk": {"dir": str(tmp / "disk"), "capacity": "8MiB", "fsync": False, "o_direct": False},
        "s3": {"enabled": False}, "embedded_s3": {"enabled": False},
        "daemon": {"endpoint": f"ipc://{tmp}/d.sock", "events_endpoint": "", "metrics_port": 0, **daemon},
    }


def refused(tmp: Path, config: dict) -> str:
    """The log of a ``kvbm serve`` that must exit at start."""
    d = ServeProc(tmp, config)
    try:
        with pytest.raises(RuntimeError, match="daemon exited"):
            d.start()
    finally:
        d.stop()
    log = d.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert not (tmp / "disk").exists(), "a tier was started before the error"
    return log


@needs("curve", zmq.has("curve"), "libzmq without CURVE")
def test_a_stray_file_in_the_client_keys_dir_is_an_error_naming_it(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    clients.mkdir()
    server = write_keypair(keys, "server")[1]
    write_keypair(clients, "good")
    (clients / "notes.key").write_text("not a certificate\n")
    log = refused(tmp_path, cfg(tmp_path, curve_server_key_file=str(server), curve_clients_dir=str(clients)))
    assert "daemon.curve_clients_dir" in log and "notes.key is not a CURVE certificate" in log, log[-2000:]


def test_an_unreadable_peer_token_file_fails_before_indexing(tmp_path: Path) -> None:
    log = refused(tmp_path, cfg(tmp_path, peer_token_file=str(tmp_path / "missing.token")))
    assert "daemon.peer_token_file" in log, log[-2000:]


def test_a_taken_metrics_port_is_an_error_naming_the_field(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        log = refused(tmp_path, cfg(tmp_path, metrics_port=port))
    assert "daemon.metrics_port" in log and str(port) in log, log[-2000:]
