#!/usr/bin/env bash
# Build a separate virtual environment with LMCache 0.5.6 for `kvbm bench tiers --peer-python`.
# LMCache pins numpy<=2.2.6 (and cupy), which clashes with kvbm's own environment, so it lives apart.
# Usage: scripts/lmcache_venv.sh [DIR]   (default: .venv-lmcache); prints the python to pass as --peer-python.
set -euo pipefail
dir=${1:-.venv-lmcache}
py=${PYTHON:-python3}
if [ ! -x "$dir/bin/python" ]; then
  "$py" -m venv "$dir"
fi
# CPU torch first so lmcache's torch requirement is already met and no CUDA wheels are pulled.
"$dir/bin/pip" install -q torch==2.13.0
"$dir/bin/pip" install -q lmcache==0.5.6
"$dir/bin/python" -c "import lmcache, awscrt; from lmcache.v1.storage_backend.connector import CreateConnector" >/dev/null
echo "$(cd "$dir" && pwd)/bin/python"
