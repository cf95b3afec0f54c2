#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite, the vLLM end-to-end test included.
# Extra arguments go to pytest. KVBM_EXTRAS=test skips installing vLLM (its tests are then skipped).
# KVBM_REQUIRE=s3,nixl,odirect,vllm,otheruid,cuda_bindings turns a skip for a missing component into a failure (.ci/run sets it;
# CI=true sets it too unless KVBM_REQUIRE is already set, even to empty).
if [[ "${CI:-}" == "true" ]]; then export KVBM_REQUIRE=${KVBM_REQUIRE-s3,nixl,odirect,vllm,otheruid,cuda_bindings}; fi
set -euo pipefail
cd "$(dirname "$0")/.."
KVBM_EXTRAS=${KVBM_EXTRAS-vllm,bench} bash scripts/install.sh
exec .venv/bin/python -m pytest -q --durations=15 "$@"  # the 15 slowest tests, so .ci/run shows them
