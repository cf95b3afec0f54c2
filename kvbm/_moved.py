"""Old import paths of modules that moved into packages (kept for one release).

``import kvbm.registry`` gives the very module object of ``kvbm.index.registry``: the alias finder below
answers for the old names only, so monkeypatching through either name patches the same module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    "kvbm.cascade": "kvbm.manager.cascade",
    "kvbm.client_async": "kvbm.client.aio",
    "kvbm.client_core": "kvbm.client.core",
    "kvbm.copiers": "kvbm.manager.copiers",
    "kvbm.external": "kvbm.manager.external",
    "kvbm.failures": "kvbm.manager.failures",
    "kvbm.footprints": "kvbm.index.footprints",
    "kvbm.hashing": "kvbm.blocks.hashing",
    "kvbm.health": "kvbm.daemon.health",
    "kvbm.keycodes": "kvbm.index.keycodes",
    "kvbm.keys": "kvbm.blocks.keys",
    "kvbm.knowledge": "kvbm.manager.knowledge",
    "kvbm.kvevents": "kvbm.daemon.kvevents",
    "kvbm.layout": "kvbm.blocks.layout",
    "kvbm.manager_state": "kvbm.manager.state",
    "kvbm.metrics": "kvbm.daemon.metrics",
    "kvbm.moves": "kvbm.manager.moves",
    "kvbm.owed": "kvbm.manager.owed",
    "kvbm.policy": "kvbm.manager.policy",
    "kvbm.recency": "kvbm.fleet.recency",
    "kvbm.registry": "kvbm.index.registry",
    "kvbm.room": "kvbm.manager.room",
    "kvbm.sessions": "kvbm.daemon.sessions",
    "kvbm.vllm_hash": "kvbm.blocks.vllm_hash",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is the target, already executed."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
