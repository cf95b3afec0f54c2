#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite, the vLLM end-to-end test included.
# Extra arguments go to pytest (KVBM_TEST_WORKERS=0 for one process, e.g. to debug one test). KVBM_EXTRAS=test skips installing vLLM (its tests are then skipped).
# KVBM_REQUIRE=s3,nixl,odirect,vllm,otheruid,cuda_bindings turns a skip for a missing component into a failure (.ci/run sets it;
# CI=true sets it too unless KVBM_REQUIRE is already set, even to empty).
if [[ "${CI:-}" == "true" ]]; then export KVBM_REQUIRE=${KVBM_REQUIRE-s3,nixl,odirect,vllm,otheruid,cuda_bindings}; fi
set -euo pipefail
cd "$(dirname "$0")/.."
KVBM_EXTRAS=${KVBM_EXTRAS-vllm,bench} bash scripts/install.sh
# Whole files on KVBM_TEST_WORKERS pytest-xdist workers (default 4: the suite waits on daemons, SeaweedFS and
# vLLM's engines far more than it computes, so 4 workers keep 2 cores busy; 0 runs it in this one process). The
# longest files go out first (tests/conftest.py). --durations: the 15 slowest tests, so .ci/run shows them.
workers=${KVBM_TEST_WORKERS-4}
parallel=()
if [[ "$workers" != 0 ]]; then parallel=(-n "$workers" --dist loadfile); fi
exec .venv/bin/python -m pytest -q "${parallel[@]}" --durations=15 "$@"
