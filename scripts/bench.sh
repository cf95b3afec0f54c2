#!/usr/bin/env bash
# Run the three kvbm benchmarks with the configuration committed under results/ (JSON + PNG + logs).
# Usage: scripts/bench.sh [OUT_DIR]   (default: results/). Takes ~10-15 minutes on a 2-core machine.
# Everything runs on loopback: each bench starts its own SeaweedFS in a temp dir and removes it after.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-results}"
mkdir -p "$OUT"
PY=.venv/bin/python
# The same group as `kvbm bench` (cli/main.py); called through the interpreter so no console script is needed.
KB=("$PY" -c "from kvbm.cli.bench import bench; bench()")
"$PY" -c "import boto3, matplotlib" 2>/dev/null || .venv/bin/pip install -q 'boto3==1.43.117' matplotlib

"${KB[@]}" tiers --block-size 8MiB --blocks 64 --repeats 3 --file-io auto,plain --disk-modes direct,buffered \
  --s3-clients aiobotocore,nixl --boto3-threads 8 \
  --json "$OUT/tiers.json" --plot "$OUT/tiers.png" 2>&1 | tee "$OUT/tiers.txt"

"${KB[@]}" manager --registered 1000000 --prefix-blocks 1000 --lookups 1000 \
  --daemon-events 50000 --daemon-batch 64 --daemon-lookups 500 \
  --onboard-blocks 32 --block-size 8MiB --repeats 3 \
  --json "$OUT/manager.json" 2>&1 | tee "$OUT/manager.txt"

"${KB[@]}" long-doc-qa --doc-lengths 1024,4096,8192 --docs 2 --queries 3 --query-tokens 32 --order tile \
  --inflight 1 --layers 4 --hidden 256 --heads 4 --tokens-per-block 256 \
  --json "$OUT/long-doc-qa.json" --plot "$OUT/long-doc-qa.png" 2>&1 | tee "$OUT/long-doc-qa.txt"
