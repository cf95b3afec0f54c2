#!/usr/bin/env bash
# A distributed SeaweedFS on loopback for fleet tests and benches: one master (-defaultReplication), three volume
# servers, a filer and two S3 gateways, every process bound to 127.0.0.1 on free ports. Runs in the foreground
# until Ctrl-C / SIGTERM; prints one JSON line first: the gateways' URLs, the master, the credentials.
#   scripts/seaweedfs_cluster.sh --dir D [--replication 001|010] [--volumes 3] [--gateways 2] [--bucket B]
# The secret is $KVBM_EMBEDDED_S3_SECRET_KEY when set, else a random one (in that JSON line only).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${KVBM_PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then py="$here/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
cd "$here"
exec "$py" -m kvbm.s3server.cluster "$@"
