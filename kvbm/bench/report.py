"""Tables (plain text / markdown) and PNG plots for the bench reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    if markdown:
        out = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in cells[1:]]
        return "\n".join(out)
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(widths[i]) if i >= 2 and _numeric(c) else c.ljust(widths[i])
                               for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _numeric(c: str) -> bool:
    return c == "-" or c.replace(",", "").replace(".", "", 1).lstrip("-").isdigit()


# -- tiers --------------------------------------------------------------------------------------------
TIERS_HEADERS = ("path", "kvbm", "MB/s", "baseline", "base MB/s", "ratio", "CPU-s/GB", "base CPU-s/GB",
                 "srv CPU-s/GB", "base srv CPU-s/GB")


def tiers_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in report.get("rows", []):
        rows.append([
            r["path"], r["kvbm"], _fmt(r.get("MBps")), r["baseline"], _fmt(r.get("baseline_MBps")),
            _fmt(r.get("ratio"), 2), _fmt(r.get("cpu_s_per_GB"), 2), _fmt(r.get("baseline_cpu_s_per_GB"), 2),
            _fmt(r.get("server_cpu_s_per_GB"), 2), _fmt(r.get("baseline_server_cpu_s_per_GB"), 2),
        ])
    return rows


def tiers_table(report: dict[str, Any], markdown: bool = False) -> str:
    return table(TIERS_HEADERS, tiers_rows(report), markdown)


def plot_tiers(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.get("rows", []) if r.get("MBps") and not r.get("peer")]  # peer rows: the table
    labels = [f"{r['path']}\n{r['kvbm']}" for r in rows]
    kv = [r["MBps"] or 0 for r in rows]
    base = [r.get("baseline_MBps") or 0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows) + 3), 5.5))
    x = range(len(rows))
    w = 0.4
    ax.bar([i - w / 2 for i in x], kv, w, label="kvbm (manager + tiers)")
    ax.bar([i + w / 2 for i in x], base, w, label="raw baseline (same process, same bytes)")
    ax.set_yscale("log")
    ax.set_ylabel("MB/s (median, log scale)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    m = report.get("machine", {})
    blk = report.get("options", {})
    ax.set_title(f"kvbm bench tiers: {blk.get('blocks')} x {blk.get('block_bytes', 0) / 2**20:g} MiB, "
                 f"{m.get('cpu_count')} CPUs ({m.get('cpu_model', '')[:40]})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- manager ------------------------------------------------------------------------------------------
def manager_table(report: dict[str, Any], markdown: bool = False) -> str:
    rows = [[r["metric"], r["via"], _fmt(r["value"], 3 if isinstance(r["value"], float) and r["value"] < 100 else 0),
             r["unit"], r.get("note", "")] for r in report.get("rows", [])]
    return table(("metric", "via", "value", "unit", "note"), rows, markdown)


# -- long-doc-qa --------------------------------------------------------------------------------------
LONGDOC_HEADERS = ("doc tokens", "source", "n", "mean ms", "p50 ms", "p90 ms", "p99 ms", "speedup vs recompute")


def longdoc_table(report: dict[str, Any], markdown: bool = False) -> str:
    rows = []
    for r in report.get("rows", []):
        t = r["ttft_ms"]
        rows.append([r["doc_tokens"], r["source"], t["n"], _fmt(t["mean"], 1), _fmt(t["p50"], 1), _fmt(t["p90"], 1),
                     _fmt(t["p99"], 1), _fmt(r.get("speedup"), 2)])
    return table(LONGDOC_HEADERS, rows, markdown)


def plot_longdoc(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_src: dict[str, list[tuple[int, float, float]]] = {}
    for r in report.get("rows", []):
        by_src.setdefault(r["source"], []).append((r["doc_tokens"], r["ttft_ms"]["mean"], r["ttft_ms"]["p90"]))
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for src, pts in by_src.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{src} (mean)")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    mdl = report.get("model", {})
    ax.set_title(f"long-doc-qa: TTFT, recompute vs kvbm hits ({mdl.get('layers')}L/{mdl.get('hidden')}H, CPU)",
                 fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- long-doc-qa, vLLM engine -------------------------------------------------------------------------
LONGDOC_VLLM_HEADERS = ("TP", "doc tokens", "source", "n", "TTFT p50 ms", "min ms", "max ms", "speedup",
                        "tier MB/s", "a move ms", "b tail ms", "c rest ms", "daemon onboard ms", "vLLM wait ms",
                        "vLLM prefill ms", "TTFT/(a+b)", "goal")


def longdoc_vllm_table(report: dict[str, Any], markdown: bool = False) -> str:
    """Per TP, length and source: TTFT; for hits the parts a (bytes at the tier's measured bandwidth), b (tail
    prefill: the G1 row) and c (the rest), and the ratio against the goal."""
    rows = []
    for r in report.get("rows", []):
        t, p, e = r["ttft_ms"], r.get("parts_ms") or {}, r.get("engine_ms") or {}
        if t is None:
            rows.append([r["tp"], r["doc_tokens"], r["source"], "-", f"STALLED > {r['stalled_after_s']:.0f} s",
                         *["-"] * (len(LONGDOC_VLLM_HEADERS) - 6), "MISSED"])
            continue
        goal = "" if "ratio" not in r else ("ok" if r.get("meets_goal") else "MISSED")
        rows.append([r["tp"], r["doc_tokens"], r["source"], t["n"], _fmt(t["p50"], 1), _fmt(t["min"], 1),
                     _fmt(t["max"], 1), _fmt(r.get("speedup"), 2), _fmt(r.get("tier_MBps")), _fmt(p.get("a_move"), 1),
                     _fmt(p.get("b_tail_prefill"), 1), _fmt(p.get("c_rest"), 1), _fmt(r.get("daemon_onboard_ms"), 1),
                     _fmt(e.get("wait"), 1), _fmt(e.get("prefill"), 1), _fmt(r.get("ratio"), 2), goal or "-"])
    return table(LONGDOC_VLLM_HEADERS, rows, markdown)


def plot_longdoc_vllm(report: dict[str, Any], path: str) -> None:
    """Median TTFT per source, one panel per (TP, length); hits stacked as a (move) + b (tail) + c (rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in report.get("rows", []):
        if r["ttft_ms"] is not None:
            groups.setdefault((r["tp"], r["doc_tokens"]), []).append(r)
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5.5 * max(1, len(groups)), 5), squeeze=False)
    for ax, ((tp, n), rows) in zip(axes[0], sorted(groups.items()), strict=False):
        x = list(range(len(rows)))
        for i, r in enumerate(rows):
            p = r.get("parts_ms")
            if p and p.get("b_tail_prefill") is not None:
                a, b = p["a_move"], p["b_tail_prefill"]
                c = max(0.0, r["ttft_ms"]["p50"] - a - b)
                ax.bar(i, b, color="tab:green", label="b tail prefill" if i == 3 else None)
                ax.bar(i, a, bottom=b, color="tab:blue", label="a move (tier MB/s)" if i == 3 else None)
                ax.bar(i, c, bottom=a + b, color="tab:red", label="c rest" if i == 3 else None)
                ax.text(i, r["ttft_ms"]["p50"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
            else:
                ax.bar(i, r["ttft_ms"]["p50"], color="tab:gray")
        ax.set_xticks(x)
        ax.set_xticklabels([r["source"] for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT p50 (ms, log)")
        ax.set_title(f"TP={tp}, {n}-token document", fontsize=9)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=7)
    mdl = report.get("model", {})
    fig.suptitle(f"long-doc-qa, vLLM CPU + KvbmConnector: random Llama {mdl.get('layers')}L/{mdl.get('hidden')}H; "
                 f"label: TTFT / (a + b), goal <= {report.get('goal_ratio')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_all(results_dir: str) -> str:
    """Markdown tables for every report found in ``results_dir`` (tiers, manager, long-doc-qa and its vLLM runs)."""
    import json
    from pathlib import Path

    out = []
    for name, fn in (("tiers", tiers_table), ("manager", manager_table), ("long-doc-qa", longdoc_table),
                     ("long-doc-qa-vllm", longdoc_vllm_table), ("long-doc-qa-vllm-syncload", longdoc_vllm_table)):
        p = Path(results_dir) / f"{name}.json"
        if p.exists():
            rep = json.loads(p.read_text())
            out.append(f"### {name}\n\n{fn(rep, markdown=True)}\n")
    return "\n".join(out)


if __name__ == "__main__":  # python -m kvbm.bench.report results/
    import sys

    print(markdown_all(sys.argv[1] if len(sys.argv) > 1 else "results"))
