"""``kvbm bench p2p-serve``: the TTFT, through vLLM's OpenAI server, of a prompt another node's engine computed:
served from that node's G2 over NIXL (a peer read), from the bucket, or computed.

Three nodes on loopback and one S3 (a fresh SeaweedFS unless given): daemons A (peer reads on), B (on, following
A) and C (off, following A), each under its own vLLM server with KvbmConnector, one random model. Each repeat sends
a fresh prompt to A (computed: the cold TTFT; its blocks land in A's G2 and, written through, in the bucket), waits
until A's writes are in the bucket and B and C have learned them from A's events, then sends the prompt to B and
to C (who goes first alternates; each request waits out the last one's busy polling): TTFT via the peer and via
the bucket, the tokens each had cached, and what each daemon did (B's blocks read from A and its peer reads late,
refused or failed; every node's bucket GETs). Medians of the repeats; a first prompt before them is reported apart
(first contact: B's NIXL agent meets A's). RDMA needs hardware this machine lacks: UCX runs over shared memory or
TCP here.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbm.bench.common import (
    BenchTarget,
    DaemonProc,
    delete_prefix,
    load_avg,
    machine,
    median,
    s3_server,
    temp_dir,
    writes_settled,
)
from kvbm.bench.openai_server import (
    FIRST_WORD,
    KVBM_CONNECTOR,
    VLLM_BLOCK,
    RandomModelOptions,
    VllmServer,
    bf16_arithmetic,
    client,
    free_port,
    server_command,
    stream_completion,
    words,
    write_model,
)
from kvbm.bench.p2p import events_endpoint, node_config, wait_for

MiB = 1 << 20
NODES = ("a", "b", "c")  # a computes; b reads from a's G2 (peer); c from the bucket


@dataclass
class P2PServeOptions(BenchTarget, RandomModelOptions):
    prompt_tokens: int = 6016
    repeats: int = 3
    tokens_per_block: int = 512  # per kvbm block (a multiple of vLLM's 128-token blocks)
    vllm_kv_bytes: int = 1 << 30
    g2_bytes: int = 512 * MiB  # each node's G2 (A's holds every repeat's prompt: nothing evicted)
    max_tokens: int = 16
    peer_budget_ms: float = 1000.0  # fleet.peer_read_budget_ms on B
    omp_threads: int = 2
    logs: str | None = None

    def check(self) -> None:
        if self.tokens_per_block % VLLM_BLOCK:
            raise ValueError(f"tokens_per_block {self.tokens_per_block}: a multiple of vLLM's {VLLM_BLOCK}")
        if self.prompt_tokens < self.tokens_per_block or self.repeats < 1:
            raise ValueError("a prompt must hold one kvbm block, and repeats must be >= 1")
        need = (self.repeats + 1) * self.block_bytes * (self.full_blocks + 1)  # and the first contact's prompt
        if self.g2_bytes < need:
            raise ValueError(f"g2 {self.g2_bytes} B holds fewer than the {self.repeats + 1} prompts' blocks ({need} B)")

    @property
    def block_bytes(self) -> int:
        return self.tokens_per_block * self.model_spec(self.prompt_tokens).bytes_per_token

    @property
    def full_blocks(self) -> int:
        return self.prompt_tokens // self.tokens_per_block


IDLE_S = 1.5  # vLLM's workers spin on their input queue for 1 s after a step: a timed request waits that out


def _stats(d: DaemonProc) -> dict[str, Any]:
    from kvbm.client import WorkerClient

    with WorkerClient(d.endpoint, timeout_s=10) as c:
        return c.stats()


def _tier(st: dict[str, Any], name: str) -> dict[str, Any]:
    return next((t for t in st["tiers"] if t["tier"] == name), {"blocks": 0, "stats": {}})


def _peer(st: dict[str, Any]) -> dict[str, Any]:
    """What this daemon knows of the one peer it follows (A)."""
    return ((st["daemon"].get("fleet") or {}).get("peers") or [{}])[0]


def _read(st: dict[str, Any]) -> dict[str, Any]:
    """Its peer-read counters ({} on a node without peer reads)."""
    return (((st["daemon"].get("fleet") or {}).get("p2p") or {}).get("read")) or {}


READ_STAGES = ("pin", "prepare", "read", "verify", "commit")  # a peer read's stages on the reading node


# A's compute; B from A's G2 over NIXL; C from the bucket; B again from its own G2 (the floor of a peer read).
PATHS = ("computed", "peer", "bucket", "local")
SERVE_COUNTERS = {"a_pin_reserve_ms": "reserve_seconds", "a_pin_checksum_ms": "checksum_seconds",
                  "a_checksums_computed": "checksums_computed", "a_checksums_known": "checksums_known"}


def _serving(st: dict[str, Any]) -> dict[str, float]:
    """What A's side of the peer reads has spent: its Pins' seconds bringing blocks to G2 and leasing them, and
    checksumming; the checksums computed at a Pin, and those known (summed ahead after the store)."""
    serve = ((st["daemon"].get("fleet") or {}).get("p2p") or {}).get("serve") or {}
    return {k: float(serve.get(v, 0)) * (1e3 if k.endswith("_ms") else 1) for k, v in SERVE_COUNTERS.items()}


def _counters(st: dict[str, Any]) -> dict[str, float]:
    """What a request cost the node: bucket GETs; blocks read from a peer, and peer reads that ran past the budget
    (the lookup answered without them), were refused or failed, and the seconds of each peer-read stage; blocks its
    daemon onboarded."""
    read = _read(st)
    return {"bucket_gets": int(_tier(st, "G4")["stats"].get("gets", 0)), "peer_blocks": int(read.get("blocks", 0)),
            **{f"peer_{k}": int(read.get(k, 0)) for k in ("late", "refused", "failed")},
            **{f"peer_{k}_ms": float(read.get(f"{k}_seconds", 0.0)) * 1e3 for k in READ_STAGES},
            "onboard_blocks": int(st["manager"]["onboard_blocks"])}


def _followed(b: DaemonProc, c: DaemonProc) -> bool:
    """B follows A and has met A's peer-read socket (its own NIXL agent up); C follows A."""
    sb, sc = _stats(b), _stats(c)
    p2p = (sb["daemon"].get("fleet") or {}).get("p2p") or {}
    return bool(p2p.get("serve") is not None and _peer(sb).get("p2p_endpoint") and _peer(sb).get("connected")
                and _peer(sc).get("connected"))


def _settled(a: DaemonProc, b: DaemonProc, c: DaemonProc) -> bool:
    """A's writes are all in the bucket; B knows every block in A's G2 and both know every object A wrote."""
    sa = _stats(a)
    if not writes_settled(sa):
        return False
    sb, sc = _stats(b), _stats(c)
    in_g2, in_g4 = int(_tier(sa, "G2")["blocks"]), int(_tier(sa, "G4")["stats"].get("puts", 0))
    return (int(_peer(sb).get("resident") or 0) >= in_g2 and int(_peer(sb).get("stored") or 0) >= in_g4
            and int(_peer(sc).get("stored") or 0) >= in_g4)


def _reads_done(d: DaemonProc) -> bool:
    return not int(_read(_stats(d)).get("reading_slots", 0))


async def _request(srv: VllmServer, d: DaemonProc, prompt: str, max_tokens: int) -> dict[str, Any]:
    await asyncio.sleep(IDLE_S)
    before = await asyncio.to_thread(_stats, d)
    got = await stream_completion(client(srv), srv.model, prompt, max_tokens)
    # a peer read past its budget goes on after the lookup answered: its blocks count for this request
    await asyncio.to_thread(wait_for, lambda: _reads_done(d), 60, "the node's peer reads to end")
    after = await asyncio.to_thread(_stats, d)
    c0, c1 = _counters(before), _counters(after)
    return {**got.as_dict(), **{k: round(c1[k] - c0[k], 2) if k.endswith("_ms") else int(c1[k] - c0[k])
                                for k in c1}}


def _daemon(o: P2PServeOptions, root: Path, srv: dict[str, Any], name: str, *, p2p: bool,
            peers: list[str]) -> DaemonProc:
    cfg = node_config(root / name, srv, f"{srv['prefix']}-p2p-serve", name, block_bytes=o.block_bytes,
                      capacity=o.g2_bytes, p2p=p2p, peers=peers, budget_ms=o.peer_budget_ms, lease_ms=5000,
                      max_blocks=o.full_blocks + 1)
    return DaemonProc(root / name, cfg, name)


def _server(o: P2PServeOptions, model: str, d: DaemonProc, logs: Path, name: str) -> VllmServer:
    extra = {"daemon": d.endpoint, "vllm_blocks_per_kvbm_block": o.tokens_per_block // VLLM_BLOCK,
             # a lookup that reads from a peer answers within the peer's budget; the connector waits that long
             "lookup_give_up_ms": o.peer_budget_ms + 500}
    cmd = server_command(model, free_port(), connector={**KVBM_CONNECTOR, "kv_connector_extra_config": extra},
                         kv_bytes=o.vllm_kv_bytes, max_model_len=o.prompt_tokens + o.max_tokens + VLLM_BLOCK,
                         served_name="bench", max_num_seqs=4, dtype=o.dtype)
    return VllmServer(cmd, logs / f"vllm-{name}.log", env={"OMP_NUM_THREADS": str(o.omp_threads)})


async def _repeats(o: P2PServeOptions, servers: dict[str, VllmServer], daemons: dict[str, DaemonProc],
                   say: Callable[[str], None]) -> list[dict[str, Any]]:
    a, b, c = (daemons[n] for n in NODES)
    await asyncio.to_thread(wait_for, lambda: _followed(b, c), 120, "B and C to follow A (B's NIXL agent up)")
    rng = random.Random(o.seed)
    out = []
    for r in range(o.repeats + 1):  # the first one is first contact (NIXL metadata, UCX connection): kept apart
        prompt = words([rng.randrange(FIRST_WORD, o.vocab) for _ in range(o.prompt_tokens)])
        stored0 = (await asyncio.to_thread(_stats, a))["manager"]["offload_blocks"]
        row: dict[str, Any] = {"computed": await _request(servers["a"], a, prompt, o.max_tokens)}
        await asyncio.to_thread(wait_for, lambda: _settled(a, b, c), 300, "A's blocks in the bucket, known to B and C")
        # what A's engine stored of the prompt (a link down on A would store nothing: B and C then compute it)
        row["a_stored_blocks"] = (await asyncio.to_thread(_stats, a))["manager"]["offload_blocks"] - stored0
        for path, node in (("peer", "b"), ("bucket", "c")) if r % 2 == 0 else (("bucket", "c"), ("peer", "b")):
            s0 = _serving(await asyncio.to_thread(_stats, a))
            row[path] = await _request(servers[node], daemons[node], prompt, o.max_tokens)
            s1 = _serving(await asyncio.to_thread(_stats, a))
            row[path].update({k: round(s1[k] - s0[k], 2) for k in s1})
        # The floor: the same prompt from B's own G2 (its copy of A's blocks), vLLM's own cache on B emptied first.
        await asyncio.to_thread(servers["b"].reset_prefix_cache)
        row["local"] = await _request(servers["b"], b, prompt, o.max_tokens)
        row["local"].update(dict.fromkeys(SERVE_COUNTERS, 0.0))
        say(f"  {f'repeat {r}' if r else 'first contact'}: " + ", ".join(
            f"{p} {row[p]['ttft_s'] * 1e3:.0f} ms (cached {row[p]['cached_tokens']}, peer blocks "
            f"{row[p]['peer_blocks']}, late {row[p]['peer_late']}, GETs {row[p]['bucket_gets']})"
            for p in PATHS if row[p]["ttft_s"] is not None))
        out.append(row)
    return out


def _summary(rows: list[dict[str, Any]], path: str) -> dict[str, Any]:
    xs = [r[path] for r in rows]
    ok = [x["ttft_s"] for x in xs if x["ttft_s"] is not None and not x["error"]]
    out: dict[str, Any] = {"ttft_ms_median": round(median(ok) * 1e3, 1) if ok else None,
                           "cached_tokens": [x["cached_tokens"] for x in xs],
                           "errors": [x["error"] for x in xs if x["error"]]}
    for k in ("peer_blocks", "peer_late", "peer_refused", "peer_failed", "bucket_gets"):
        out[k] = sum(x[k] for x in xs)
    out["peer_stages_ms_median"] = {k: round(median([x[f"peer_{k}_ms"] for x in xs]), 1) for k in READ_STAGES}
    out["a_serving_median"] = {k: round(median([x.get(k, 0.0) for x in xs]), 1) for k in SERVE_COUNTERS}
    return out


async def run_p2p_serve(o: P2PServeOptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    report: dict[str, Any] = {
        "bench": "p2p-serve", "machine": machine(), "bf16": bf16_arithmetic(), "options": asdict(o),
        "kvbm_block_bytes": o.block_bytes, "idle_before_each_request_s": IDLE_S, "load_before": load_avg(),
        "rdma": "not run: no RDMA hardware here (UCX picks shared memory or TCP on loopback)"}
    t0 = time.perf_counter()
    with temp_dir("kvbm-p2p-serve-", o.workdir) as tmp, s3_server(
            tmp, endpoint=o.s3_endpoint, access_key=o.s3_access_key, secret_key=o.s3_secret_key,
            bucket=o.s3_bucket) as srv:
        logs = Path(o.logs) if o.logs else tmp / "logs"
        model = write_model(tmp / "model", o.model_spec(o.prompt_tokens + o.max_tokens + VLLM_BLOCK))
        daemons: dict[str, DaemonProc] = {}
        servers: dict[str, VllmServer] = {}
        try:
            daemons["a"] = _daemon(o, tmp, srv, "a", p2p=True, peers=[])
            daemons["a"].start()
            ev = events_endpoint(daemons["a"])
            for name, p2p in (("b", True), ("c", False)):
                daemons[name] = _daemon(o, tmp, srv, name, p2p=p2p, peers=[ev])
                daemons[name].start()
            say(f"daemons up: a, b (peer reads from a, budget {o.peer_budget_ms:.0f} ms), c (the bucket)")
            servers.update({name: _server(o, model, daemons[name], logs, name) for name in NODES})
            # started together (a third of the wait); a server that fails stopped itself, the rest stop below
            started = await asyncio.gather(*(asyncio.to_thread(sv.start) for sv in servers.values()),
                                           return_exceptions=True)
            failed = [e for e in started if isinstance(e, BaseException)]
            if failed:
                raise failed[0]
            say("  servers up in " + ", ".join(f"{n} {sv.startup_s:.0f}s" for n, sv in servers.items()))
            first, *rows = await _repeats(o, servers, daemons, say)
        finally:
            for s in servers.values():
                s.stop()
            for name, d in daemons.items():
                d.stop()
                if o.logs and d.log_path.exists():  # the temp dir goes: keep what a failed run would be read from
                    logs.mkdir(parents=True, exist_ok=True)
                    shutil.copy(d.log_path, logs / f"daemon-{name}.log")
            delete_prefix(srv, f"{srv['prefix']}-p2p-serve/")
    report["first_contact"], report["repeats"] = first, rows
    # A repeat whose prompt A did not store whole measures nothing of either path: said, and left out.
    report["repeats_without_as_blocks"] = sum(1 for r in rows if r["a_stored_blocks"] < o.full_blocks)
    rows = [r for r in rows if r["a_stored_blocks"] >= o.full_blocks]
    for path in PATHS:
        report[path] = _summary(rows, path)
    peer, bucket = report["peer"], report["bucket"]
    # The peer path measured what it says only if every load came from A over NIXL within the budget.
    report["peer_path_clean"] = not (peer["errors"] or peer["peer_late"] or peer["peer_refused"]
                                     or peer["peer_failed"] or peer["bucket_gets"])
    pm, bm = peer["ttft_ms_median"], bucket["ttft_ms_median"]
    report["peer_over_bucket"] = round(pm / bm, 3) if pm and bm else None
    lm = report["local"]["ttft_ms_median"]  # what no peer read can go below: B's own G2 hit
    report["local_over_bucket"] = round(lm / bm, 3) if lm and bm else None
    report["peer_over_local"] = round(pm / lm, 3) if pm and lm else None
    report["goals"] = {"ttft_peer_at_most_half_of_bucket": bool(report["peer_path_clean"] and pm and bm
                                                                and pm <= 0.5 * bm)}
    report["load_after"], report["seconds"] = load_avg(), round(time.perf_counter() - t0, 1)
    return report


def p2p_serve_table(report: dict[str, Any]) -> str:
    rows = ["| path | node | TTFT p50 | cached tokens | blocks read from the peer | late / refused / failed peer reads "
            "| bucket GETs |", "|---|---|---|---|---|---|---|"]
    for path, node in zip(PATHS, ("A", "B", "C", "B"), strict=True):
        r = report[path]
        ttft = f"{r['ttft_ms_median']:.0f} ms" if r["ttft_ms_median"] is not None else "-"
        rows.append(f"| {path} | {node} | {ttft} | {', '.join(map(str, r['cached_tokens']))} | {r['peer_blocks']} "
                    f"| {r['peer_late']} / {r['peer_refused']} / {r['peer_failed']} | {r['bucket_gets']} |")
    stages = report["peer"]["peer_stages_ms_median"]
    rows.append("\nB's peer read per request, medians (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    a = report["peer"]["a_serving_median"]
    rows.append(f"A's side of it, medians: the pin's reserve {a['a_pin_reserve_ms']:.1f} ms and checksums "
                f"{a['a_pin_checksum_ms']:.1f} ms; checksums computed at the pin {a['a_checksums_computed']:.0f}, "
                f"known from the store {a['a_checksums_known']:.0f}")
    return "\n".join(rows)
