"""Install kvbm into an environment that already has another torch, as a vLLM user would, and prove it works.

    python scripts/install_env_check.py --torch 2.11.0 [--src .] [--work DIR] [--tests FILE ...]

1. A wheelhouse of that torch and its dependencies (``pip download``; kept in ``--wheelhouse``, by default
   ``~/.cache/kvbm/wheelhouse/torch-VERSION``, so a second run downloads nothing). It is also how a host
   without network gets its wheels: ``pip download`` them elsewhere, carry the folder in.
2. The user's environment: a fresh venv with only that torch (built by uv from its cache: seconds, where
   pip takes minutes to write torch 2.11's 4.6 GB of CUDA libraries again).
3. Install kvbm into it. ``--mode online``: ``python -m pip install SRC``, the one command a user runs.
   ``--mode offline`` (default; what a GPU host without network does, and fast): kvbm's wheel plus the wheels
   the environment lacks, downloaded with its ``pip freeze`` as constraints into the wheelhouse, installed with
   ``--no-index``. Every package that was there before must be there after, same version (torch above all),
   and ``pip check`` must pass.
4. kvbm imports from that environment; without NIXL, ``transfer.backend: nixl`` is a clear error naming the
   extras and ``auto`` takes the plain movers; then kvbm's unit tests ``--tests`` run there.

Prints one JSON object (steps, seconds, what changed) and exits 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Fast unit tests that touch torch (movers, copies), the block/config codecs and the protocol.
DEFAULT_TESTS = ["tests/unit/test_transfer.py", "tests/unit/test_copiers.py", "tests/unit/test_blocks_config.py",
                 "tests/unit/test_protocol.py"]
# Run inside the new environment: imports, where kvbm comes from, and the NIXL-absent behaviour.
PROBE = r"""
import json, os, sys
import torch, kvbm, kvbm.cli.main, kvbm.tiers, kvbm.transfer, kvbm.integrations.vllm.plugin
from kvbm.config import TransferConfig
from kvbm.transfer import TransferBackendError, make_memory_mover, nixl_available
out = {"torch": torch.__version__, "torch_file": torch.__file__, "kvbm_file": kvbm.__file__,
       "nixl": list(nixl_available())}
if not nixl_available()[0]:
    try:
        make_memory_mover(TransferConfig(backend="nixl"))
        out["nixl_error"] = None
    except TransferBackendError as e:
        out["nixl_error"] = str(e)
out["auto_mover"] = make_memory_mover(TransferConfig(backend="auto")).name
print(json.dumps(out))
"""


class CheckFailed(Exception):
    pass


def run(cmd: list[str], step: str, report: dict[str, Any], **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; record its seconds under ``step``; a non-zero exit fails the check with its output."""
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    report["seconds"][step] = round(time.monotonic() - t, 1)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-3000:]
        raise CheckFailed(f"{step}: `{' '.join(cmd)}` exited {p.returncode}:\n{tail}")
    return p


def packages(py: Path, report: dict[str, Any], step: str) -> dict[str, str]:
    p = run([str(py), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"], step, report)
    return {d["name"].lower(): d["version"] for d in json.loads(p.stdout)}


def uv_bin() -> str:
    """uv from the test extra (this interpreter's environment), else on PATH."""
    try:
        import uv  # type: ignore[import-not-found]

        return str(uv.find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if not found:
            raise CheckFailed("uv not found: it is in kvbm's test extra (pip install uv)") from None
        return found


def check(args: argparse.Namespace, report: dict[str, Any]) -> None:
    pip = [sys.executable, "-m", "pip"]
    wh = Path(args.wheelhouse or Path.home() / ".cache" / "kvbm" / "wheelhouse" / f"torch-{args.torch}")
    done = wh / ".complete"
    if not done.exists():
        wh.mkdir(parents=True, exist_ok=True)
        run([*pip, "download", "-q", "--disable-pip-version-check", f"torch=={args.torch}", "-d", str(wh)],
            "wheelhouse_download", report)
        done.write_text(f"torch=={args.torch}\n")
    report["wheelhouse"] = str(wh)
    env = Path(args.work) / "env"
    py = env / "bin" / "python"
    uv = uv_bin()
    run([uv, "venv", "-q", "--seed", "-p", sys.executable, str(env)], "venv", report)
    run([uv, "pip", "install", "-q", "--python", str(py), "--no-index", "--find-links", str(wh),
         f"torch=={args.torch}"], "user_env_torch", report)
    before = packages(py, report, "list_before")
    report["torch_before"] = before.get("torch")
    report["mode"] = args.mode
    quiet = ["-q", "--disable-pip-version-check"]
    if args.mode == "online":
        # The user's command: the environment's own pip, its own configuration, no constraints of ours.
        run([str(py), "-m", "pip", "install", *quiet, str(args.src)], "pip_install_kvbm", report)
    else:
        # A host without network: kvbm's wheel and the wheels it lacks, fetched elsewhere with the host's own
        # `pip freeze` as constraints, then installed with --no-index (docs/install.md, a GPU host without network).
        dist = Path(args.work) / "dist"
        run([*pip, "wheel", *quiet, "--no-deps", "--no-build-isolation", "-w", str(dist), str(args.src)],
            "build_kvbm_wheel", report)
        (wheel,) = dist.glob("kvbm-*.whl")
        freeze = Path(args.work) / "host-freeze.txt"
        freeze.write_text(run([str(py), "-m", "pip", "freeze", "--disable-pip-version-check"], "freeze",
                              report).stdout)
        # pip download re-reads every file already in the wheelhouse (2.6 GB for torch 2.11): skip it when
        # neither kvbm's requirements nor the environment changed since the last run.
        key = hashlib.sha256((Path(args.src) / "pyproject.toml").read_bytes() + freeze.read_bytes()).hexdigest()
        marker = wh / f".deps-{key[:16]}"
        if not marker.exists():
            run([*pip, "download", *quiet, "-c", str(freeze), "-d", str(wh), str(wheel), "pytest"],
                "download_missing", report)
            marker.touch()
        for stale in wh.glob("kvbm-*.whl"):  # pip download copied our wheel in; the explicit path installs
            stale.unlink()
        run([str(py), "-m", "pip", "install", *quiet, "--no-index", "--find-links", str(wh), str(wheel)],
            "pip_install_kvbm", report)
    after = packages(py, report, "list_after")
    changed = {n: [v, after.get(n)] for n, v in before.items() if after.get(n) != v}
    report["changed"] = changed
    report["added"] = sorted(set(after) - set(before))
    if changed:
        raise CheckFailed(f"installing kvbm changed packages that were there before: {changed}")
    if after.get("kvbm") is None:
        raise CheckFailed("kvbm is not installed after pip install")
    run([str(py), "-m", "pip", "check", "--disable-pip-version-check"], "pip_check", report)
    probe = json.loads(run([str(py), "-c", PROBE], "import", report, cwd=args.work).stdout.strip().splitlines()[-1])
    report["probe"] = probe
    if not probe["kvbm_file"].startswith(str(env)):
        raise CheckFailed(f"kvbm imported from {probe['kvbm_file']}, not from the new environment")
    if probe["torch"].split("+")[0] != before["torch"]:  # pip lists 2.11.0 for torch 2.11.0+cu130
        raise CheckFailed(f"torch is {probe['torch']} at run time, {before['torch']} was installed")
    if not probe["nixl"][0] and "kvbm[cu12] or kvbm[cu13]" not in (probe.get("nixl_error") or ""):
        raise CheckFailed(f"without NIXL, backend 'nixl' did not fail naming the extras: {probe.get('nixl_error')}")
    if args.tests:
        offline = ["--no-index", "--find-links", str(wh)] if args.mode == "offline" else []
        run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *offline, "pytest"],
            "pytest_install", report)
        tests = [str(Path(args.src) / t) for t in args.tests]
        # Only the components this environment lacks on purpose may skip here (NIXL, vLLM); the caller's
        # KVBM_REQUIRE is for its own environment.
        penv = {k: v for k, v in os.environ.items() if k != "KVBM_REQUIRE"}
        p = run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests], "unit_tests", report,
                cwd=args.work, env=penv)
        lines = p.stdout.strip().splitlines()
        report["unit_tests"] = lines[-1]
        report["unit_test_skips"] = [ln for ln in lines if ln.startswith("SKIPPED")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch", default="2.11.0", help="the torch the user's environment has")
    ap.add_argument("--src", default=str(ROOT), help="the kvbm source tree to install")
    ap.add_argument("--mode", choices=["offline", "online"], default="offline",
                    help="offline: from a wheelhouse with --no-index (a GPU host); online: `pip install SRC`")
    ap.add_argument("--work", default="", help="where the environment is built (default: a temp dir, removed)")
    ap.add_argument("--wheelhouse", default="", help="torch's wheels (default ~/.cache/kvbm/wheelhouse/torch-V)")
    ap.add_argument("--tests", nargs="*", default=DEFAULT_TESTS, help="unit tests to run there (relative to --src)")
    args = ap.parse_args()
    keep = bool(args.work)
    args.work = args.work or tempfile.mkdtemp(prefix="kvbm-env-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"torch": args.torch, "src": args.src, "seconds": {}}
    t = time.monotonic()
    try:
        check(args, report)
        report["ok"] = True
    except CheckFailed as e:
        report["ok"], report["error"] = False, str(e)
    finally:
        report["seconds"]["total"] = round(time.monotonic() - t, 1)
        if not keep:
            shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
