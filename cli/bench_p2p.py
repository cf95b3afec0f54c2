"""``kvbm bench p2p``: node B loads a prefix node A holds in G2, over NIXL from A vs from the bucket
(:mod:`kvbm.bench.p2p`); ``kvbm bench p2p-serve``: the same through vLLM's OpenAI server, TTFT
(:mod:`kvbm.bench.p2p_serve`)."""

from __future__ import annotations

import sys
from typing import Any

import click

from kvbm.cli.bench_common import run_checked, seed_option, with_model, with_target
from kvbm.cli.common import SIZE


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


@click.command("p2p-serve")
@click.option("--prompt-tokens", default=6016, show_default=True, help="Tokens of each prompt node A computes.")
@click.option("--repeats", default=3, show_default=True, help="Prompts after the first contact's; medians.")
@click.option("--tokens-per-block", default=512, show_default=True,
              help="Tokens per kvbm block (a multiple of vLLM's 128-token blocks).")
@click.option("--vllm-kv", type=SIZE, default="1GiB", show_default=True, help="Each server's KV space.")
@click.option("--g2", type=SIZE, default="512MiB", show_default=True, help="Each daemon's G2.")
@click.option("--max-tokens", default=16, show_default=True, help="Output tokens per request.")
@click.option("--peer-budget-ms", default=1000.0, show_default=True, help="Node B's fleet.peer_read_budget_ms.")
@click.option("--omp-threads", default=2, show_default=True, help="OMP_NUM_THREADS of each vLLM server.")
@with_model
@seed_option
@click.option("--logs", type=click.Path(file_okay=False), default=None, help="Keep the servers' logs here.")
@with_target()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def p2p_serve_cmd(vllm_kv: int, g2: int, json_path: str | None, **kw: Any) -> None:
    """TTFT through vLLM's OpenAI server of a prompt node A computed: on node B from A's G2 over NIXL, on node C
    from the bucket, medians of repeats."""
    from kvbm.bench.common import write_json
    from kvbm.bench.openai_server import native_dtype
    from kvbm.bench.p2p_serve import P2PServeOptions, p2p_serve_table, run_p2p_serve

    if kw["dtype"] == "auto":
        kw["dtype"] = native_dtype()
    report = run_checked(P2PServeOptions(vllm_kv_bytes=vllm_kv, g2_bytes=g2, **kw), run_p2p_serve, "p2p-serve")
    click.echo(p2p_serve_table(report))
    click.echo(f"goals: {report['goals']} (peer / bucket TTFT {report['peer_over_bucket']}; the peer path clean: "
               f"{report['peer_path_clean']}; B's own G2 hit / bucket {report['local_over_bucket']}, the least a "
               f"peer read could reach; peer / own G2 {report['peer_over_local']})")
    if json_path:
        write_json(json_path, report)
        click.echo(f"json: {json_path}")


COMMANDS = [p2p_cmd, p2p_serve_cmd]
