"""``kvbm bench long-doc-qa | serve | outage``: kvbm under an engine (vLLM's OpenAI server, or the torch
bench model)."""

from __future__ import annotations

import asyncio
from typing import Any

import click

from kvbm.cli.bench_common import csv_list, emit, run_checked, seed_option, with_model, with_output, with_target
from kvbm.cli.common import SIZE


@click.command("long-doc-qa")
@click.option("--engine", type=click.Choice(["torch", "vllm"]), default="torch", show_default=True,
              help="torch: a tiny decoder in this process, kvbm's manager in-process. vllm: a real vLLM (CPU build) "
              "with KvbmConnector against a `kvbm serve` daemon, per TP size.")
@click.option("--doc-lengths", default=None, help="Document lengths in tokens [torch: 1024,4096,8192; vllm: 4000].")
@click.option("--docs", default=None, type=int, help="Documents per length [torch: 2; vllm: 1].")
@click.option("--queries", default=None, type=int,
              help="Queries per document and source [torch: 2; vllm: 3, the median is reported].")
@click.option("--query-tokens", default=32, show_default=True, help="Question tokens after the document.")
@click.option("--order", type=click.Choice(["tile", "random"]), default="tile", show_default=True, help="torch only.")
@click.option("--inflight", default=1, show_default=True, help="Requests in flight at once (torch only).")
@click.option("--sources", default=None,
              help="What to time [torch: recompute,G2,G3,G4; vllm: recompute,tail,G1,G2,G3,G4; G1 is the hits' b].")
@click.option("--layers", default=None, type=int, help="[torch: 4; vllm: 8]")
@click.option("--hidden", default=None, type=int, help="[torch: 256; vllm: 1024]")
@click.option("--heads", default=None, type=int, help="Attention heads [torch: 4; vllm: 8].")
@click.option("--kv-heads", default=4, show_default=True, help="KV heads of the vLLM model (vllm only).")
@click.option("--intermediate", default=None, type=int, help="MLP size of the vLLM model [2.75 x hidden].")
@click.option("--vocab", default=None, type=int, help="[torch: 32000; vllm: 8192]")
@click.option("--tokens-per-block", default=256, show_default=True,
              help="Tokens per kvbm block (vllm: a multiple of its 128-token blocks).")
@click.option("--tp", default="1,2", show_default=True, help="Tensor-parallel sizes (vllm only).")
@click.option("--connector-extra", default="{}", show_default=True,
              help="JSON merged into KvbmConnector's kv_connector_extra_config (vllm only), "
              "e.g. '{\"async_load\": false}'.")
@click.option("--logs", type=click.Path(file_okay=False), default=None,
              help="Keep each engine's and daemon's log in this directory (vllm only).")
@click.option("--cpu-bind", type=click.Choice(["rank", "shared"]), default="rank", show_default=True,
              help="TP>1 (vllm only): rank = each rank's threads on one core of its own (VLLM_CPU_OMP_THREADS_BIND="
              "0|1); shared = every rank on all cores.")
@click.option("--request-timeout", default=300.0, show_default=True,
              help="Seconds one timed request may run before its engine is stopped and it is reported as stalled "
              "(vllm only).")
@click.option("--s3-client", type=click.Choice(["aiobotocore", "nixl"]), default="aiobotocore", show_default=True,
              help="torch only (the vllm engine's daemon uses its default).")
@seed_option
@with_target()
@with_output(plot="TTFT PNG.")
def longdoc_cmd(engine: str, doc_lengths: str | None, docs: int | None, queries: int | None, sources: str | None,
                **kw: Any) -> None:
    """TTFT of document QA: recompute vs kvbm hits from G2, G3 and G4, by document length."""
    vllm = engine == "vllm"
    lengths = tuple(int(x) for x in csv_list(doc_lengths or ("4000" if vllm else "1024,4096,8192")))
    docs = docs if docs is not None else (1 if vllm else 2)
    queries = queries if queries is not None else (3 if vllm else 2)
    if docs < 1 or queries < 1 or kw["inflight"] < 1 or kw["query_tokens"] < 1:
        raise click.BadParameter("--docs, --queries, --query-tokens and --inflight must be >= 1")
    out = {k: kw.pop(k) for k in ("json_path", "plot_path", "markdown")}
    s3 = {k: kw.pop(k) for k in ("s3_endpoint", "s3_access_key", "s3_secret_key", "s3_bucket", "workdir", "seed")}
    if vllm:
        _longdoc_vllm(lengths, docs, queries, sources, kw, s3, **out)
        return
    from kvbm.bench.longdoc import LongDocOptions, run_longdoc
    from kvbm.bench.report import longdoc_table, plot_longdoc

    if any(n < kw["tokens_per_block"] for n in lengths):
        raise click.BadParameter("every document must hold at least one block", param_hint="--doc-lengths")
    opts = LongDocOptions(
        doc_lengths=lengths, docs=docs, queries=queries, query_tokens=kw["query_tokens"], order=kw["order"],
        inflight=kw["inflight"], sources=csv_list(sources or "recompute,G2,G3,G4"), layers=kw["layers"] or 4,
        hidden=kw["hidden"] or 256, heads=kw["heads"] or 4, vocab=kw["vocab"] or 32000,
        tokens_per_block=kw["tokens_per_block"], s3_client=kw["s3_client"], **s3,
    )
    report = asyncio.run(run_longdoc(opts, click.echo))
    click.echo("")
    click.echo(longdoc_table(report, out["markdown"]))
    emit(report, out["json_path"], out["plot_path"], plot_longdoc)


def _connector_extra(text: str) -> dict[str, Any]:
    import json

    try:
        extra = json.loads(text)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--connector-extra") from None
    if not isinstance(extra, dict):
        raise click.BadParameter("a JSON object", param_hint="--connector-extra")
    return extra


def _serve_extra(text: str) -> dict[str, Any]:
    extra = _connector_extra(text)
    taken = sorted({"daemon", "vllm_blocks_per_kvbm_block"} & extra.keys())
    if taken:
        raise click.BadParameter(f"{', '.join(taken)}: set by the bench (its daemon, --tokens-per-block)",
                                 param_hint="--connector-extra")
    return extra


def _longdoc_vllm(lengths: tuple[int, ...], docs: int, queries: int, sources: str | None, kw: dict[str, Any],
                  s3: dict[str, Any], json_path: str | None, plot_path: str | None, markdown: bool) -> None:
    from kvbm.bench.longdoc_vllm import SOURCES, VLLM_BLOCK, VllmLongDocOptions, run_longdoc_vllm
    from kvbm.bench.report import longdoc_vllm_table, plot_longdoc_vllm

    if kw["tokens_per_block"] % VLLM_BLOCK:
        raise click.BadParameter(f"must be a multiple of vLLM's {VLLM_BLOCK}-token blocks",
                                 param_hint="--tokens-per-block")
    extra = _connector_extra(kw["connector_extra"])
    hidden = kw["hidden"] or 1024
    opts = VllmLongDocOptions(
        doc_lengths=lengths, docs=docs, queries=queries, query_tokens=kw["query_tokens"],
        tp=tuple(int(x) for x in csv_list(kw["tp"])), layers=kw["layers"] or 8, hidden=hidden, heads=kw["heads"] or 8,
        kv_heads=kw["kv_heads"], intermediate=kw["intermediate"] or int(hidden * 2.75), vocab=kw["vocab"] or 8192,
        vllm_blocks_per_kvbm_block=kw["tokens_per_block"] // VLLM_BLOCK, sources=csv_list(sources or ",".join(SOURCES)),
        connector=extra, logs=kw["logs"], request_timeout_s=kw["request_timeout"], cpu_bind=kw["cpu_bind"], **s3,
    )
    try:
        opts.check()
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    report = asyncio.run(run_longdoc_vllm(opts, click.echo))
    click.echo("")
    click.echo(longdoc_vllm_table(report, markdown))
    emit(report, json_path, plot_path, plot_longdoc_vllm)


@click.command("serve")
@click.option("--workloads", default="long-doc-qa,ttft-length", show_default=True,
              help="long-doc-qa, ttft-length, multi-turn (comma separated).")
@click.option("--sources", default="vllm,kvbm,lmcache,offloading", show_default=True,
              help="Servers to run, one at a time: vllm (no connector: recompute and its own prefix cache, G1), kvbm "
              "(KvbmConnector + a kvbm serve daemon: G2/G3/G4), lmcache (LMCacheConnectorV1), offloading (vLLM's "
              "OffloadingConnector); a peer that cannot run here is recorded with its error.")
@click.option("--docs", default=16, show_default=True, help="long-doc-qa: documents.")
@click.option("--doc-tokens", default=6000, show_default=True, help="long-doc-qa: tokens per document.")
@click.option("--queries", default=2, show_default=True, help="long-doc-qa: queries per document (tile order).")
@click.option("--query-tokens", default=32, show_default=True)
@click.option("--concurrency", default=4, show_default=True, help="long-doc-qa: requests in flight.")
@click.option("--lengths", default="1000,2000,4000,8000,16000", show_default=True,
              help="ttft-length: input lengths in tokens.")
@click.option("--repeats", default=3, show_default=True, help="ttft-length: prompts per length (P95 over them).")
@click.option("--s3-clients", default="http,nixl,aiobotocore", show_default=True,
              help="ttft-length: the daemon's S3 clients timed for G4 hits (restarted with each).")
@click.option("--sessions", default=2, show_default=True, help="multi-turn: conversations.")
@click.option("--turns", default=4, show_default=True, help="multi-turn: turns per conversation.")
@click.option("--turn-tokens", default=512, show_default=True, help="multi-turn: new tokens per turn.")
@click.option("--max-tokens", default=16, show_default=True, help="Output tokens per request (greedy, ignore_eos).")
@click.option("--vllm-kv", type=SIZE, default="1GiB", show_default=True,
              help="vLLM's KV space (--kv-cache-memory-bytes).")
@click.option("--g2", type=SIZE, default="256MiB", show_default=True,
              help="The daemon's G2 (host) capacity in long-doc-qa.")
@click.option("--g3", type=SIZE, default="768MiB", show_default=True,
              help="The daemon's G3 (disk) capacity in long-doc-qa.")
@click.option("--block-size", default=128, show_default=True, help="vLLM block size (CPU: a multiple of 32).")
@click.option("--tokens-per-block", default=256, show_default=True, help="Tokens per kvbm block.")
@with_model
@click.option("--omp-threads", default=2, show_default=True, help="OMP_NUM_THREADS of each vLLM server.")
@click.option("--server-python", default=None, help="Interpreter the vLLM servers run in [this one].")
@click.option("--peer-python", default=None, help="Interpreter of the peers' servers (a venv with LMCache) [this one].")
@click.option("--request-timeout", default=600.0, show_default=True, help="Seconds per request.")
@click.option("--connector-extra", default="{}", show_default=True,
              help="JSON merged into kvbm's kv_connector_extra_config (not daemon or vllm_blocks_per_kvbm_block, "
              "which the bench sets), e.g. '{\"hook_warn_ms\": 20}'.")
@click.option("--logs", type=click.Path(file_okay=False), default=None, help="Keep the servers' and daemon's logs.")
@seed_option
@with_target()
@with_output(plot="PNG (four panels).", markdown="Print the tables as markdown.")
def serve_cmd(workloads: str, sources: str, lengths: str, s3_clients: str, vllm_kv: int, g2: int, g3: int,
              tokens_per_block: int, block_size: int, request_timeout: float, connector_extra: str,
              json_path: str | None, plot_path: str | None, markdown: bool, **kw: Any) -> None:
    """vLLM's OpenAI server over HTTP (streamed, C in flight): recompute, vLLM's prefix cache, kvbm, peers."""

    from kvbm.bench.openai_server import native_dtype
    from kvbm.bench.serve import ServeBenchOptions, plot_serve, run_serve, serve_table

    if kw["dtype"] == "auto":
        kw["dtype"] = native_dtype()
    if tokens_per_block % block_size:
        raise click.BadParameter(f"a multiple of --block-size {block_size}", param_hint="--tokens-per-block")
    opts = ServeBenchOptions(
        workloads=csv_list(workloads), sources=csv_list(sources), lengths=tuple(int(x) for x in csv_list(lengths)),
        s3_clients=csv_list(s3_clients), vllm_kv_bytes=vllm_kv, g2_bytes=g2,
        g3_bytes=g3, block_size=block_size,
        vllm_blocks_per_kvbm_block=tokens_per_block // block_size, request_timeout_s=request_timeout,
        connector_extra=_serve_extra(connector_extra), **kw)
    report = run_checked(opts, run_serve, "serve")
    click.echo("")
    click.echo(serve_table(report, markdown))
    emit(report, json_path, plot_path, plot_serve)


@click.command("outage")
@click.option("--prompt-words", default=3000, show_default=True, help="Words (tokens) of each new prompt.")
@click.option("--decode-tokens", default=6000, show_default=True, help="At most (cut off after each phase).")
@click.option("--arrivals", default=2, show_default=True, help="New requests sent at once in a prefill phase.")
@seed_option
@click.option("--root", type=click.Path(file_okay=False), default=None,
              help="Keep the model, logs and daemon files here (else a temporary dir).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def outage_cmd(prompt_words: int, decode_tokens: int, arrivals: int, seed: int, root: str | None,
               json_path: str | None) -> None:
    """The daemon SIGKILLed or SIGSTOPped under vLLM's OpenAI server: decode gaps, TTFTs, the hooks' step times."""
    import json
    import tempfile
    from pathlib import Path

    from kvbm.bench.outage import run

    with tempfile.TemporaryDirectory(prefix="kvbm-outage-") as tmp:
        report = asyncio.run(run(Path(root or tmp), prompt_words, decode_tokens, arrivals, seed))
    text = json.dumps(report, indent=1)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
    for name, ph in report["phases"].items():
        worst = max((v["steps"]["slowest_bucket_le_ms"] or 0 for v in ph["hook_times"].values()
                     if v["steps"]["slowest_bucket_le_ms"] != "inf"), default=0)
        click.echo(f"{name:14} decode gap before {ph['decode_max_gap_before_s'] or 0:.3f}s during "
                   f"{ph['decode_max_gap_during_s'] or 0:.3f}s  slowest kvbm step <= {worst} ms  "
                   f"new TTFT {[round(t, 2) for t in ph['new_concurrent_ttft_s'] + ph['new_after_ttft_s']]}")


COMMANDS = [longdoc_cmd, serve_cmd, outage_cmd]
