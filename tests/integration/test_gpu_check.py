"""scripts/gpu_check.py, the GPU host's one command, runs here on CPU: every check that does not need CUDA
runs byte-exact (both movers both ways, the paged gather/scatter, the worker's async save and load against a
real daemon), and exactly the CUDA-only parts are reported as skipped."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch
from needs import require

from kvbm.transfer import nixl_available

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_on_cpu_and_names_what_it_skipped():
    require("nixl", nixl_available()[0], f"the NIXL mover check needs NIXL: {nixl_available()[1]}")
    require("vllm", importlib.util.find_spec("vllm") is not None, "the worker check needs vLLM importable")
    p = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py")], capture_output=True, text=True,
                       timeout=300)
    report = json.loads(p.stdout)  # stdout is the JSON only (NIXL's and vLLM's logs go to stderr)
    assert p.returncode == 0 and report["ok"], json.dumps(report, indent=1) + p.stderr[-2000:]
    checks = report["checks"]
    ran = [checks["movers"]["plain"], checks["movers"]["nixl"], checks["paged"], checks["worker"]]
    assert all(c["ran"] and c["exact"] for c in ran), checks
    assert {checks["movers"]["plain"]["mover"], checks["movers"]["nixl"]["mover"]} == {"torch", "nixl-ucx"}
    assert checks["worker"]["load_errors"] == [] and checks["worker"]["async_save"] and checks["worker"]["async_load"]
    for c in ran:
        assert all(v > 0 for key, v in c.items() if key.endswith("GBps")), c
    if not torch.cuda.is_available():
        assert set(report["skipped"]) == {"g1_cuda", "g2_pinned", "nixl_vram", "cuda_streams", "native"}, \
            report["skipped"]
        assert "CUDA only" in report["skipped"]["native"]  # vllm serve with OffloadingConnector
        assert report["cuda"] is False and checks["paged"]["stream"] is False
    else:
        assert report["skipped"] == {}, report["skipped"]
    # The exit code a GPU host's runbook relies on: --require-cuda fails without CUDA.
    if not torch.cuda.is_available():
        q = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--require-cuda", "--blocks", "2",
                            "--slot-mib", "1"], capture_output=True, text=True, timeout=300)
        assert q.returncode == 2 and json.loads(q.stdout)["cuda"] is False, q.stdout[-2000:] + q.stderr[-2000:]
