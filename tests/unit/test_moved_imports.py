"""Modules that moved into packages keep their old import paths for one release (kvbm/_moved.py)."""

import importlib
import subprocess
import sys

import pytest

from kvbm._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_is_the_very_module_at_its_new_path(old):
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_old_from_imports_work_in_a_fresh_interpreter():
    code = ("from kvbm.registry import Registry; from kvbm.manager import BlockManager; "
            "from kvbm.layout import KVLayout; from kvbm.client import WorkerClient; "
            "import kvbm.index.registry as r, kvbm.blocks.layout as lay; "
            "assert Registry is r.Registry and KVLayout is lay.KVLayout; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "ok"
