#!/usr/bin/env bash
# Start/stop/query the embedded SeaweedFS S3 endpoint kvbm uses by default.
#   scripts/seaweedfs.sh start|stop|status [--dir D] [--port P] [--bucket B]
# D defaults to $KVBM_EMBEDDED_S3_DIR or ~/.cache/kvbm/seaweedfs. Credentials come from
# $KVBM_EMBEDDED_S3_ACCESS_KEY / $KVBM_EMBEDDED_S3_SECRET_KEY (defaults: kvbm / the data dir's own random secret).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${KVBM_PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then py="$here/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
action="${1:-status}"
shift || true
case "$action" in
  start|stop|status) ;;
  *) echo "usage: $0 start|stop|status [--dir D] [--port P] [--bucket B]" >&2; exit 2 ;;
esac
has_dir=0
for a in "$@"; do [[ "$a" == --dir || "$a" == --dir=* ]] && has_dir=1; done
if [[ $has_dir == 0 ]]; then
  set -- --dir "${KVBM_EMBEDDED_S3_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvbm/seaweedfs}" "$@"
fi
cd "$here"
exec "$py" -m kvbm.s3server "$action" "$@"
