"""``kvbm bench p2p``: node B loads a prefix node A holds in G2, over NIXL from A vs from the bucket
(:mod:`kvbm.bench.p2p`)."""

from __future__ import annotations

import sys

import click


@click.command("p2p")
@click.option("--blocks", default=32, show_default=True, help="Blocks of the prefix node A stores.")
@click.option("--block-mib", default=8, show_default=True, help="Block size in MiB.")
@click.option("--repeats", default=3, show_default=True, help="Loads per path; medians are reported.")
@click.option("--transports", default="default,tcp", show_default=True,
              help="UCX transports, comma-separated: default (UCX picks: shared memory on loopback), tcp.")
@click.option("--root", type=click.Path(file_okay=False), default=None, help="Where the daemons' files go.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def p2p_cmd(blocks: int, block_mib: int, repeats: int, transports: str, root: str | None,
            json_path: str | None) -> None:
    """Peer read vs bucket: GB/s and time to the last block on node B, medians of repeats."""
    from kvbm.bench.common import write_json
    from kvbm.bench.p2p import P2POptions, p2p_table, run_p2p

    opts = P2POptions(blocks=blocks, block_bytes=block_mib << 20, repeats=repeats,
                      transports=[t.strip() for t in transports.split(",") if t.strip()], root=root)
    try:
        report = run_p2p(opts, say=click.echo)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    report["command"] = ["kvbm", "bench", *sys.argv[sys.argv.index("p2p"):]] if "p2p" in sys.argv else sys.argv
    click.echo(p2p_table(report))
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")


COMMANDS = [p2p_cmd]
