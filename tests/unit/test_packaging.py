"""The built wheel holds every module of the source tree, under the ``kvbm`` namespace only.

An editable install finds modules by directory, so a package missing from pyproject's explicit list goes
unnoticed until someone installs a real wheel; this builds one (pip, no network, no dependencies)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {"kvbm": "kvbm", "cli": "kvbm/cli", "tiers": "kvbm/tiers", "configs": "kvbm/configs"}


def _buildable_copy(dst: Path) -> Path:
    """What the build reads (pyproject.toml, README.md, the mapped packages), copied: a build of the tree itself
    shares its build/ with any other build running (scripts/install_env_check.py, in another xdist worker), and
    one build cleaning what the other copies failed it with ENOENT (CI, round 22)."""
    import shutil

    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    for src in MAPPED:
        shutil.copytree(ROOT / src, dst / src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def test_wheel_holds_every_source_module(tmp_path):
    (tmp_path / "src").mkdir()
    src = _buildable_copy(tmp_path / "src")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvbm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expect = {f"{dst}/{p.relative_to(ROOT / src).as_posix()}"
              for src, dst in MAPPED.items() for p in (ROOT / src).rglob("*.py") if "__pycache__" not in p.parts}
    assert not expect - names, f"modules missing from the wheel: {sorted(expect - names)}"
    top = {n.split("/")[0] for n in names if not n.startswith("kvbm-")}
    assert top == {"kvbm"}, top
    yamls = {f"kvbm/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    assert yamls and not yamls - names, sorted(yamls - names)
    data = {"kvbm/bench/data/mooncake-conversation.jsonl.gz", "kvbm/bench/data/README.md"}  # the shipped trace
    assert not data - names, sorted(data - names)
