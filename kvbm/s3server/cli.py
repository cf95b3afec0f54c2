"""Launch and manage a local SeaweedFS (``weed server -s3``) as kvbm's embedded S3 endpoint.

Command line: ``python -m kvbm.s3server start|stop|status --dir D [--port P]``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvbm.errors import ConfigError, TierUnavailableError
from kvbm.s3server.embedded import EmbeddedS3
from kvbm.s3server.service import ensure_running, stop_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbm.s3server", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop", "status"])
    ap.add_argument("--dir", required=True, help="SeaweedFS data dir")
    ap.add_argument("--port", type=int, default=0, help="S3 port (0: pick a free one)")
    ap.add_argument("--bucket", default="kvbm")
    ap.add_argument("--access-key", default=os.environ.get("KVBM_EMBEDDED_S3_ACCESS_KEY", "kvbm"))
    ap.add_argument("--secret-key", default=os.environ.get("KVBM_EMBEDDED_S3_SECRET_KEY", ""),
                    help="default: the data dir's own random secret (kept 0600 in its identity.json)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (start) or before SIGKILL (stop)")
    args = ap.parse_args(argv)
    try:
        if args.action == "start":
            s3 = ensure_running(args.dir, port=args.port, access_key=args.access_key, secret_key=args.secret_key,
                                bucket=args.bucket, startup_timeout_s=args.timeout)
            word = "reused" if s3.reused else "started"
            print(json.dumps({"status": word, "endpoint": s3.endpoint, "pid": s3.pid, "bucket": s3.bucket,
                              "log": str(s3.log_path)}))
            return 0
        if args.action == "stop":
            was = stop_dir(args.dir, stop_timeout_s=args.timeout)
            print(json.dumps({"status": "stopped" if was else "not running"}))
            return 0
        st = EmbeddedS3(args.dir).status()
        print(json.dumps(st))
        return 0 if st["running"] else 3
    except (TierUnavailableError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
