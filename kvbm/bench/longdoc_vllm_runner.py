"""The engine process of ``kvbm bench long-doc-qa --engine vllm``: one JSON spec in, one JSON result out.

Run as ``python -m kvbm.bench.longdoc_vllm_runner SPEC OUT`` by :mod:`kvbm.bench.longdoc_vllm` (vLLM spawns
its TP worker processes, hence a process of its own). It builds a real vLLM (CPU build) whose KV connector is
``KvbmConnector``, found by name through kvbm's ``vllm.general_plugins`` entry point, against the bench's
daemon, and then:

1. warms: computes every document once (the connector stores its full blocks) and waits until the daemon has
   written them through to G3 and G4;
2. measures, in this process, the raw bandwidth of each tier on the bytes of those blocks: G2 a memcpy of
   that many bytes, G3 reads of the daemon's block files with their page cache dropped, G4 GETs of the
   daemon's objects (boto3, ``s3_threads`` in flight);
3. per query and per source, times one ``generate`` of one token (TTFT) after forcing where the prefix can
   come from: ``recompute`` (a fresh document), ``tail`` (a fresh prompt as long as a hit's uncached
   tail), ``G1`` (vLLM's own prefix cache holds exactly the blocks kvbm would load: the tail prefilled over
   the cached prefix, nothing moved), ``G2``/``G3``/``G4`` (vLLM's prefix cache reset; the daemon's copies
   in the tiers above evicted, G3's page cache dropped). Every hit is checked: vLLM reports the expected
   cached tokens and the daemon counted the hits in the expected tier.

Sources are interleaved per query so that load from other work on the machine spreads over all of them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

HIT_SOURCES = ("G2", "G3", "G4")


class Daemon:
    """The bench's daemon as seen from the engine process: stats, admin evictions."""

    def __init__(self, endpoint: str, admin_token_file: str) -> None:
        from kvbm.security import read_admin_token

        self.endpoint = endpoint
        self.admin_token = read_admin_token(Path(admin_token_file))
        if not self.admin_token:
            raise RuntimeError(f"no admin token in {admin_token_file}")

    def stats(self) -> dict[str, Any]:
        from kvbm.client import WorkerClient

        with WorkerClient(self.endpoint, timeout_s=10) as c:
            return c.stats()

    def evict(self, namespaces: list[str], tiers: list[str]) -> int:
        from kvbm.ops import DaemonLink

        removed = 0
        with DaemonLink(self.endpoint, 10, admin_token=self.admin_token) as link:
            for ns in namespaces:
                removed += link.client.evict(namespace=ns, tiers=tiers).removed
        return removed

    def wait_quiet(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Stats once no write-through is pending (background S3 PUTs would compete with a timed request)."""
        from kvbm.bench.common import writes_settled

        deadline = time.monotonic() + timeout_s
        while True:
            st = self.stats()
            if writes_settled(st):
                return st
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon still busy after {timeout_s:.0f}s: {st['manager'].get('pending_cascades')}")
            time.sleep(0.2)


def tier_counts(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {t["tier"]: {"blocks": t["blocks"], "hits": t["stats"]["hits"]} for t in stats["tiers"]}


def drop_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def check_source(source: str, hits: dict[str, int], blocks: int) -> None:
    """The blocks came from ``source``: reads counted there (a G2 hit reads no tier), none from below it."""
    below = HIT_SOURCES[HIT_SOURCES.index(source) + 1 :]
    ok = all(hits.get(t, 0) == 0 for t in below) and (source == "G2" or hits.get(source, 0) >= blocks)
    if not ok:
        raise RuntimeError(f"a {source} hit of {blocks} blocks, but the daemon's tiers counted reads {hits}")


# -- raw tier bandwidth on the same bytes ---------------------------------------------------------------
def bw_memcpy(nbytes: int) -> float:
    """Seconds for one memcpy of ``nbytes`` (fresh source, resident destination)."""
    src = np.random.default_rng(1).integers(0, 255, size=nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in: the engine's KV cache is resident
    src = np.random.default_rng(2).integers(0, 255, size=nbytes, dtype=np.uint8)
    t = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t


def bw_files(files: list[Path], threads: int) -> tuple[float, int]:
    """Seconds to read ``files`` with their page cache dropped (O_DIRECT where the filesystem allows it)."""
    drop_page_cache(files)

    def read(f: Path) -> int:
        size = f.stat().st_size
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(f, flags)
        except OSError:
            fd = os.open(f, os.O_RDONLY)
        try:
            import mmap

            buf = mmap.mmap(-1, (size + 4095) // 4096 * 4096)  # page aligned, as O_DIRECT needs
            n = os.preadv(fd, [buf], 0)
            buf.close()
            return n
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        n = sum(ex.map(read, files))
    return time.perf_counter() - t, n


def bw_s3(s3: dict[str, Any], keys: list[str], threads: int) -> tuple[float, int]:
    """Seconds to GET ``keys`` with ``threads`` in flight (boto3, one client)."""
    from kvbm.bench.common import boto3_client

    cli = boto3_client(s3, pool=threads)
    try:
        def get(k: str) -> int:
            return len(cli.get_object(Bucket=s3["bucket"], Key=k)["Body"].read())

        get(keys[0])  # connection set-up is not the tier's bandwidth
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            n = sum(ex.map(get, keys))
        return time.perf_counter() - t, n
    finally:
        cli.close()


def s3_keys(s3: dict[str, Any], prefix: str) -> list[str]:
    from kvbm.bench.common import boto3_client, key_pages

    cli = boto3_client(s3)
    try:
        return [k for page in key_pages(cli, s3["bucket"], prefix) for k in page]
    finally:
        cli.close()


def tier_bandwidth(spec: dict[str, Any], files: list[Path], keys: list[str], nbytes: int) -> dict[str, Any]:
    """Median seconds per tier to move ``nbytes`` (the warm documents' blocks), over ``spec['repeats']``."""
    reps = max(1, int(spec["bw_repeats"]))
    g2 = [bw_memcpy(nbytes) for _ in range(reps)]
    g3 = [bw_files(files, spec["disk_threads"]) for _ in range(reps)]
    g4 = [bw_s3(spec["s3"], keys, spec["s3_threads"]) for _ in range(reps)]
    out: dict[str, Any] = {}
    for name, secs, n in (("G2", g2, nbytes), ("G3", [s for s, _ in g3], g3[0][1]),
                          ("G4", [s for s, _ in g4], g4[0][1])):
        med = statistics.median(secs)
        out[name] = {"bytes": n, "seconds": secs, "MBps": round(n / med / 1e6, 1)}
    return out


# -- the engine --------------------------------------------------------------------------------------------
class Engine:
    """One vLLM with KvbmConnector; timed one-token generates."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams

        kw: dict[str, Any] = dict(
            model=spec["model"], enforce_eager=True, skip_tokenizer_init=True, seed=0, max_num_seqs=4,
            disable_log_stats=False,  # per-request engine timestamps: queued, scheduled, first token
            # Prefix caching on, reset before every timed request: it is the G1 reference and, reset, it cannot
            # serve a hit that kvbm should.
            enable_prefix_caching=True,
            max_model_len=spec["max_model_len"],
            max_num_batched_tokens=spec["max_model_len"],  # the whole prompt in one step: TTFT is one prefill
            kv_transfer_config={"kv_connector": "KvbmConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {"daemon": spec["daemon"],
                                                              "model_name": spec["model_name"], "timeout_s": 30,
                                                              **spec.get("connector", {})}},
        )
        if spec["tp"] > 1:
            kw.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
        self.llm = LLM(**kw)
        self.params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.rng = np.random.default_rng(spec["seed"])
        self.vocab = spec["vocab"]

    def rand(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(3, self.vocab, size=n)]

    def reset(self) -> None:
        """Empty vLLM's prefix cache once kvbm's saves of the last request landed (the in-process engine does not
        step after a generate on its own, and a reset is no barrier for kvbm's saves: kvbm.integrations.vllm.drain)."""
        from kvbm.integrations.vllm.drain import drain

        if not drain(self.llm) or not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM's prefix cache could not be reset")

    def generate(self, prompt: list[int]) -> tuple[float, Any]:
        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], self.params, use_tqdm=False)[0]
        return time.perf_counter() - t, out


def engine_times(out: Any) -> dict[str, float]:
    """Where the engine spent a request's TTFT: waiting to be scheduled (for a kvbm hit: the async load) and
    from being scheduled to its first token (the prefill step), from vLLM's per-request timestamps."""
    m = getattr(out, "metrics", None)
    if m is None or not getattr(m, "first_token_ts", 0.0):
        return {}
    return {"engine_wait_s": max(0.0, m.scheduled_ts - m.queued_ts),
            "engine_prefill_s": max(0.0, m.first_token_ts - m.scheduled_ts)}


def thread_states(pid: int) -> list[dict[str, Any]]:
    """Name, state, CPU ticks and kernel wait channel of every thread of ``pid`` (from /proc)."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            stat = (task / "stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            out.append({"tid": int(task.name), "name": (task / "comm").read_text().strip(), "state": fields[0],
                        "cpu_ticks": int(fields[11]) + int(fields[12]),
                        "wchan": (task / "wchan").read_text().strip()})
        except OSError:
            continue
    return out


class Watchdog:
    """Ends the process when one timed request runs past ``limit_s``: a stalled hit must not hang the bench
    (``generate`` cannot be interrupted). What was measured so far is already in the output file, and the
    stall is written there too, with the daemon's stats, before exiting."""

    def __init__(self, limit_s: float, out_path: str, daemon: Daemon, s3: dict[str, Any] | None = None,
                 daemon_pid: int = 0) -> None:
        self.limit_s, self.out_path, self.daemon, self.s3 = limit_s, out_path, daemon, s3
        self.daemon_pid = daemon_pid
        self.done: list[dict[str, Any]] = []  # finished lengths
        self.current: dict[str, Any] | None = None  # the length being measured
        self._what: dict[str, Any] | None = None
        self._since = 0.0
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="ldqa-watchdog").start()

    def save(self, stalled: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {"lengths": self.done + ([self.current] if self.current else [])}
        if stalled:
            body["stalled"] = stalled
        tmp = Path(self.out_path + ".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(self.out_path)

    def timing(self, what: dict[str, Any] | None) -> None:
        with self._lock:
            self._what, self._since = what, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            with self._lock:
                what, since = self._what, self._since
            if what is None or time.monotonic() - since < self.limit_s:
                continue
            stalled: dict[str, Any] = {**what, "after_s": round(time.monotonic() - since, 1)}
            try:
                stalled["daemon_stats"] = self.daemon.stats()
            except Exception as e:  # the daemon itself may be what stalls
                stalled["daemon_stats_error"] = repr(e)
            if self.daemon_pid:  # what each of the daemon's threads is doing (state, kernel wait channel)
                stalled["daemon_threads"] = thread_states(self.daemon_pid)
            if self.s3 is not None:  # is it the S3 server or kvbm? One GET straight to the server, timed.
                try:
                    keys = s3_keys(self.s3, self.s3["prefix"] + "/")[:1]
                    t = time.perf_counter()
                    n = bw_s3(self.s3, keys, 1)[1] if keys else 0
                    stalled["direct_get"] = {"bytes": n, "seconds": round(time.perf_counter() - t, 3)}
                except Exception as e:
                    stalled["direct_get_error"] = repr(e)
            self.save(stalled)
            print(f"ldqa: {what} still running after {self.limit_s:.0f}s: stopping", file=sys.stderr, flush=True)
            os._exit(3)


def measure_length(spec: dict[str, Any], eng: Engine, daemon: Daemon, doc_len: int,
                   dog: Watchdog) -> dict[str, Any]:
    """Warm, tier bandwidths, then every source ``queries`` times, for documents of ``doc_len`` tokens."""
    q_len, bt, tp = spec["query_tokens"], spec["kvbm_block_tokens"], spec["tp"]
    hit_tokens = (doc_len + q_len - 1) // bt * bt  # what kvbm can hold: full blocks, one token left to compute
    per_doc = hit_tokens // bt * tp  # kvbm blocks of one document, all ranks
    docs = [eng.rand(doc_len) for _ in range(spec["docs"])]
    t0 = time.perf_counter()
    for d in docs:
        eng.reset()
        _, out = eng.generate(d + eng.rand(q_len))
        if out.num_cached_tokens:
            raise RuntimeError(f"a fresh document hit {out.num_cached_tokens} cached tokens")
    eng.reset()
    st = daemon.wait_quiet()
    warm_s = time.perf_counter() - t0
    blocks = per_doc * len(docs)
    counts = tier_counts(st)
    if any(counts[t]["blocks"] != blocks for t in HIT_SOURCES):
        raise RuntimeError(f"after the warm-up the daemon holds {counts}, expected {blocks} blocks per tier")
    disk = Path(spec["disk_dir"])
    files = sorted(disk.rglob("*.kvb"))
    namespaces = sorted(p.name for p in disk.iterdir() if p.is_dir())
    keys = s3_keys(spec["s3"], spec["s3"]["prefix"] + "/")
    if len(files) != blocks or len(keys) != blocks:
        raise RuntimeError(f"{len(files)} block files and {len(keys)} objects, expected {blocks} of each")
    bw = tier_bandwidth(spec, files, keys, blocks * spec["block_bytes"])
    # One document's bytes at the bandwidth measured on all of them (the same blocks, the same concurrency).
    result: dict[str, Any] = {"doc_tokens": doc_len, "warm_s": warm_s, "hit_tokens": hit_tokens,
                              "namespaces": namespaces, "blocks_per_doc": per_doc, "bandwidth": bw, "runs": []}
    dog.current = result

    # Sources interleave per query; G4 comes last, in a pass of its own: a G4 hit leaves no copy in G3.
    questions = [eng.rand(q_len) for _ in range(spec["queries"])]
    passes = [[s for s in spec["sources"] if s != "G4"], [s for s in spec["sources"] if s == "G4"]]
    for qi, sources in [(qi, p) for p in passes for qi in range(spec["queries"]) if p]:
        doc, question = docs[qi % len(docs)], questions[qi]
        for source in sources:
            prompt, expect_cached, removed = doc + question, hit_tokens, None
            if source == "recompute":
                prompt, expect_cached = eng.rand(doc_len + q_len), 0
            elif source == "tail":
                prompt, expect_cached = eng.rand(doc_len + q_len - hit_tokens), 0
            eng.reset()
            if source == "G1":
                eng.generate([*doc[:hit_tokens], 3])  # vLLM caches exactly the blocks kvbm would load
            elif source in ("G3", "G4"):
                daemon.wait_quiet()
                removed = daemon.evict(namespaces, ["G2"] if source == "G3" else ["G2", "G3"])
                if source == "G3":
                    drop_page_cache(files)
            before = daemon.wait_quiet()
            dog.timing({"tp": tp, "doc_tokens": doc_len, "source": source, "query": qi})
            ttft, out = eng.generate(prompt)
            dog.timing(None)
            after = daemon.stats()
            run: dict[str, Any] = {"query": qi, "source": source, "ttft_s": ttft, "prompt_tokens": len(prompt),
                                   "cached_tokens": out.num_cached_tokens, "tokens": list(out.outputs[0].token_ids)}
            run.update(engine_times(out))
            if out.num_cached_tokens != expect_cached:
                raise RuntimeError(f"{source}: {out.num_cached_tokens} cached tokens, expected {expect_cached} "
                                   f"({out.kv_transfer_params})")
            if ((out.kv_transfer_params or {}).get("kvbm") or {}).get("degraded"):
                raise RuntimeError(f"the connector is degraded: {out.kv_transfer_params}")
            bc, ac = tier_counts(before), tier_counts(after)
            run["tier_hits"] = {t: ac[t]["hits"] - bc[t]["hits"] for t in ac}
            run["daemon_onboard_s"] = after["daemon"]["onboard_seconds"] - before["daemon"]["onboard_seconds"]
            run["daemon_lookup_s"] = after["daemon"]["lookup_seconds"] - before["daemon"]["lookup_seconds"]
            if source in HIT_SOURCES:
                check_source(source, run["tier_hits"], per_doc)
            if removed is not None:
                run["evicted"] = removed
            result["runs"].append(run)
            dog.save()
    # A clean slate for the next length: nothing of this one left in any tier.
    eng.reset()
    daemon.wait_quiet()
    daemon.evict(namespaces, list(HIT_SOURCES))
    return result


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    daemon = Daemon(spec["daemon"], spec["admin_token_file"])
    eng = Engine(spec)
    eng.generate(eng.rand(16))  # first-call costs are nobody's TTFT
    dog = Watchdog(spec["request_timeout_s"], out_path, daemon, spec["s3"], spec.get("daemon_pid", 0))
    for n in spec["doc_lengths"]:
        dog.done.append(measure_length(spec, eng, daemon, n, dog))
        dog.current = None
    dog.save()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
