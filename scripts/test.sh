#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite, the vLLM end-to-end test included.
# Extra arguments go to pytest. KVBM_EXTRAS=test skips installing vLLM (its test is then skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
KVBM_EXTRAS=${KVBM_EXTRAS-vllm,bench} bash scripts/install.sh
exec .venv/bin/python -m pytest -q "$@"
