"""Check kvbm's vLLM connector against a vLLM release without running it (no GPU, no vLLM import).

    python scripts/vllm_compat.py                    # the installed vLLM
    pip download vllm==0.33.0 --no-deps -d /tmp/w && python scripts/vllm_compat.py --wheel /tmp/w/vllm-*.whl

Reads vLLM's KV-connector base class and the modules kvbm imports as source: the hooks kvbm overrides must
keep the base's signatures, every abstract hook must be implemented, every ``from vllm... import`` must
resolve. Prints JSON (the version, whether it is in kvbm's supported range, problems, and the base's hooks
kvbm leaves to their defaults: review new ones there) and exits 1 on a problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvbm.integrations.vllm import apicheck
from kvbm.integrations.vllm.compat import SUPPORTED, SUPPORTED_BELOW, SUPPORTED_MIN, major_minor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", type=Path, help="a vLLM wheel (default: the installed vLLM)")
    args = ap.parse_args()
    read = apicheck.wheel_reader(args.wheel) if args.wheel else apicheck.installed_reader()
    version = apicheck.source_version(read)
    mm = major_minor(version)
    report = {"vllm": version, "source": str(args.wheel or "installed"), "supported_range": SUPPORTED,
              "supported": mm is not None and SUPPORTED_MIN <= mm < SUPPORTED_BELOW, **apicheck.check(read)}
    print(json.dumps(report, indent=2))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
