"""No import cycle between kvbm's modules, lazy (function-level) and ``TYPE_CHECKING`` imports included: the arrows of
the house point down (issue 38). A static scan of the source (ast), so a cycle that only an unusual call order would
trip is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> the package it installs as (pyproject's package-dir); kvbm/cli and kvbm/tiers are symlinks to
# cli/ and tiers/ in a checkout, skipped under kvbm/ so each file is read once.
SOURCES = {"kvbm": "kvbm", "cli": "kvbm.cli", "tiers": "kvbm.tiers"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for src, pkg in SOURCES.items():
        base = ROOT / src
        for p in sorted(base.rglob("*.py")):
            rel = p.relative_to(base)
            if any((base / Path(*rel.parts[: i + 1])).is_symlink() for i in range(len(rel.parts))):
                continue
            parts = [pkg, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every kvbm module ``name`` imports, wherever the import statement stands."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*here[: len(here) - node.level + 1], *([base] if base else [])])
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` the module itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # ``import kvbm.a.b.Name`` style names: the longest known module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:
        start = min(comp)
        # Breadth-first inside the component from start back to start: the shortest cycle through it.
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & comp):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        out.append([start, *reversed(path[1:]), start])
    return out


def test_the_scan_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """The scanner itself: a function-level import and one under TYPE_CHECKING are edges, and a cycle is found."""
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvbm.x import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import kvbm.x.a\n")
    known = {"kvbm.x.a", "kvbm.x.b", "kvbm.x"}
    g = {"kvbm.x.a": _imports("kvbm.x.a", tmp_path / "a.py", known),
         "kvbm.x.b": _imports("kvbm.x.b", tmp_path / "b.py", known)}
    assert g == {"kvbm.x.a": {"kvbm.x.b"}, "kvbm.x.b": {"kvbm.x.a"}}
    assert cycles(g) == [["kvbm.x.a", "kvbm.x.b", "kvbm.x.a"]]


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "kvbm.cli.purge" in graph and "kvbm.tiers.s3.tier" in graph
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)
