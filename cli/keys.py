"""``kvbm keys``: CURVE keypairs for the daemon and its clients."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvbm.cli.common import one_line_errors


@click.group("keys")
def keys() -> None:
    """CURVE keys: the daemon's (daemon.curve_server_key_file) and its clients' (curve_client_key_file)."""


@keys.command()
@click.option("--dir", "directory", type=click.Path(file_okay=False), required=True, help="Where to write the pair.")
@click.option("--name", default="client", show_default=True, help="File name stem: NAME.key and NAME.key_secret.")
@one_line_errors
def generate(directory: str, name: str) -> None:
    """Write NAME.key (public: copy it into the daemon's curve_clients_dir) and NAME.key_secret (both keys,
    mode 0600: give it to the client as curve_client_key_file, or to the daemon as curve_server_key_file).
    Prints the paths and the public key, never the secret."""
    from kvbm.security import load_public_key, write_keypair

    public, secret = write_keypair(Path(directory), name)
    click.echo(json.dumps({"public_key_file": str(public), "secret_key_file": str(secret),
                           "public_key": load_public_key(public).decode()}))
