"""The connector against a vLLM's source, without importing or running it: the KV-connector hooks kvbm
overrides keep vLLM's base-class signatures, the base's abstract hooks are all implemented, and every
``from vllm... import name`` in kvbm resolves. Reads an installed vLLM or a wheel (``pip download vllm==X
--no-deps``), so a release can be checked before any GPU host runs it (scripts/vllm_compat.py)."""

from __future__ import annotations

import ast
import importlib.util
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
BASE_CLASS = "KVConnectorBase_V1"
# Imports neither vLLM nor torch (the package's __init__ is lazy), so it runs where vLLM is absent.
HERE = Path(__file__).resolve().parent
# kvbm's sources that import vLLM: the connector package, the plugin that registers it included.
KVBM_SOURCES = tuple(sorted(HERE.glob("*.py")))

Reader = Callable[[str], "str | None"]  # module name -> its source, None when it does not exist
Param = tuple[str, str, bool]  # (name, kind, has a default)


def installed_reader() -> Reader:
    """Sources of the installed vLLM, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("vLLM is not installed")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return lambda module: _read_file(root, module)


def _read_file(root: Path, module: str) -> str | None:
    base = root.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p.read_text()
    return None


def wheel_reader(wheel: Path) -> Reader:
    """Sources inside a vLLM wheel."""
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())

    def read(module: str) -> str | None:
        base = "/".join(module.split("."))
        for n in (f"{base}.py", f"{base}/__init__.py"):
            if n in names:
                return zf.read(n).decode()
        return None

    return read


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[Param, ...]:
    a = fn.args
    pos = [*a.posonlyargs, *a.args]
    defaults = [False] * (len(pos) - len(a.defaults)) + [True] * len(a.defaults)
    out: list[Param] = [(p.arg, "positional", d) for p, d in zip(pos, defaults, strict=True)]
    if a.vararg:
        out.append((a.vararg.arg, "*args", False))
    out += [(p.arg, "keyword", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append((a.kwarg.arg, "**kwargs", False))
    return tuple(out[1:] if out and out[0][0] in ("self", "cls") else out)


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
            for d in fn.decorator_list}


def hooks(source: str, cls: str) -> dict[str, tuple[tuple[Param, ...], str, bool]]:
    """``{method: (params, kind, abstract)}`` of class ``cls`` in ``source``; kind: method, classmethod,
    staticmethod or property."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            out = {}
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    dec = _decorators(fn)
                    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in dec), "method")
                    out[fn.name] = (_params(fn), kind, "abstractmethod" in dec)
            return out
    raise LookupError(f"class {cls} not found")


def compare_hooks(base_src: str, ours_src: str, ours_cls: str = "KvbmConnector") -> tuple[list[str], list[str]]:
    """(problems, inherited): hooks kvbm overrides whose signature or kind differs from the base's, abstract
    hooks kvbm lacks; and the base's hooks kvbm leaves to the base's default (new ones show up here)."""
    base, ours = hooks(base_src, BASE_CLASS), hooks(ours_src, ours_cls)
    problems: list[str] = []
    for name, (params, kind, _abstract) in sorted(ours.items()):
        if name not in base or name.startswith("__"):
            continue  # kvbm's own (layouts, scheduler, worker) or the constructor, checked by running it
        bparams, bkind, _ = base[name]
        # vLLM calls with the base's signature: kvbm may add a trailing **kwargs, nothing else.
        extra_kw = params[len(bparams):] == (params[-1],) and params[-1][1] == "**kwargs" if params else False
        if kind != bkind or (params != bparams and not (params[: len(bparams)] == bparams and extra_kw)):
            problems.append(f"{name}: kvbm's {kind}{_fmt(params)} != vLLM's {bkind}{_fmt(bparams)}")
    for name, (_p, _k, abstract) in sorted(base.items()):
        if abstract and name not in ours:
            problems.append(f"{name}: abstract in vLLM's {BASE_CLASS}, not implemented by kvbm")
    inherited = sorted(n for n in base if n not in ours and not n.startswith("_"))
    return problems, inherited


def _fmt(params: tuple[Param, ...]) -> str:
    return "(" + ", ".join(("*" if k == "*args" else "**" if k == "**kwargs" else "") + n + ("=" if d else "")
                           for n, k, d in params) + ")"


def _top_names(tree: ast.Module) -> set[str]:
    """Names a module defines at top level (also inside top-level if/try blocks)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for s in body:
            if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(s.name)
            elif isinstance(s, ast.Assign | ast.AnnAssign | ast.AugAssign):
                for t in s.targets if isinstance(s, ast.Assign) else [s.target]:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(s, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in s.names)
            elif isinstance(s, ast.If | ast.Try):
                visit(s.body)
                visit(s.orelse)
                for h in getattr(s, "handlers", []):
                    visit(h.body)
                visit(getattr(s, "finalbody", []))

    visit(tree.body)
    return names


def vllm_imports(sources: tuple[Path, ...] = KVBM_SOURCES) -> Iterator[tuple[str, str, str]]:
    """``(module, name, "file:line")`` for every ``from vllm... import name`` in kvbm's sources."""
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                for a in node.names:
                    yield node.module or "", a.name, f"{path.name}:{node.lineno}"


def check_imports(read: Reader) -> list[str]:
    """kvbm's vLLM imports that do not resolve in the vLLM ``read`` reads."""
    problems = []
    for module, name, where in vllm_imports():
        src = read(module)
        if src is None:
            problems.append(f"{where}: module {module} does not exist")
        elif read(f"{module}.{name}") is None and name not in _top_names(ast.parse(src)):
            problems.append(f"{where}: {module} has no {name}")
    return problems


def source_version(read: Reader) -> str:
    """``__version__`` as vllm/_version.py assigns it (a string constant), else 'unknown'."""
    src = read("vllm._version")
    for node in ast.walk(ast.parse(src or "")):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)):
            return node.value.value
    return "unknown"


def check(read: Reader) -> dict[str, object]:
    """The whole static check of one vLLM: hook problems and import problems, and the inherited hooks."""
    base = read(BASE_MODULE)
    if base is None:
        return {"problems": [f"{BASE_MODULE} does not exist"], "inherited": []}
    ours = (HERE / "connector.py").read_text()
    hook_problems, inherited = compare_hooks(base, ours)
    return {"problems": hook_problems + check_imports(read), "inherited": inherited}
