"""KVBM_REQUIRE: a skip naming a required component fails the run; other skips stay skips.

Runs a real pytest in a subprocess on a small test tree that uses tests/needs.py like the suite does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent.parent  # tests/, where needs.py lives

CONFTEST = """
from needs import (pytest_configure, pytest_make_collect_report, pytest_runtest_makereport,
                   pytest_sessionfinish, pytest_terminal_summary)
"""
TESTS = """
import pytest
from needs import needs, require

def test_required():
    require("vllm", False, "vLLM is not here")

def test_optional():
    require("curve", False, "no CURVE here")

@needs("nixl", False, "no NIXL here")
def test_marked():
    pass

def test_untagged_skip():
    pytest.skip("nothing to do with a component")

def test_passes():
    pass
"""
MODULE_SKIP = """
from needs import import_or_skip

import_or_skip("vllm", "kvbm_no_such_module")

def test_never_runs():
    pass
"""


def run_pytest(tmp_path: Path, require: str | None, *files: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVBM_REQUIRE"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    if require is not None:
        env["KVBM_REQUIRE"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), *files], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_parts.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "test_module_skip.py").write_text(textwrap.dedent(MODULE_SKIP))
    return tmp_path


def test_without_kvbm_require_every_missing_component_is_a_skip(tree):
    r = run_pytest(tree, None, "test_parts.py", "test_module_skip.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 5 skipped" in r.stdout, r.stdout
    assert "[needs vllm] vLLM is not here" in r.stdout


def test_a_required_components_skip_fails_the_run_and_others_stay_skips(tree):
    r = run_pytest(tree, "vllm,nixl", "test_parts.py")
    assert r.returncode == 1, r.stdout + r.stderr
    # A skip in the call fails the test; a skipif mark skips in setup, so it becomes an error.
    failed = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))}
    assert failed == {"test_parts.py::test_required", "test_parts.py::test_marked"}, r.stdout
    assert "1 failed, 1 passed, 2 skipped, 1 error" in r.stdout, r.stdout
    assert "requires vllm" in r.stdout and "[needs vllm] vLLM is not here" in r.stdout


def test_a_module_skipped_at_import_for_a_required_component_fails_the_run(tree):
    r = run_pytest(tree, "vllm", "test_module_skip.py")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED (required component skipped) test_module_skip.py" in r.stdout, r.stdout
    optional = run_pytest(tree, "s3", "test_parts.py", "test_module_skip.py")
    assert optional.returncode == 0, optional.stdout + optional.stderr


def test_an_unknown_component_in_kvbm_require_is_a_usage_error(tree):
    r = run_pytest(tree, "vllm,sewaedfs", "test_parts.py")
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, r.stdout + r.stderr
    assert "sewaedfs" in r.stdout + r.stderr
