"""A kvbm hit answers what vLLM's own prefix-cache hit of the same tokens answers, token for token, in bf16
(kvbm.verify.numerics, a real vLLM CPU engine and daemon). Both may differ from a full compute: a hit computes the
last tokens over cached KV, another kernel shape than the prefill that stored them, and bf16 rounds them
differently (a near tie flips the first token). That is why a hit's tokens are checked against vLLM's own hit."""

from __future__ import annotations

import importlib.util

import pytest
from needs import needs

from kvbm.verify.numerics import run

pytestmark = [pytest.mark.slow, needs("vllm", importlib.util.find_spec("vllm") is not None,
                                      "vLLM not installed (KVBM_EXTRAS=vllm bash scripts/install.sh)")]


def test_a_kvbm_hit_answers_what_vllms_own_hit_answers_in_bf16(tmp_path):
    report = run(tmp_path, prompts=6, dtype="bfloat16", layers=2, max_tokens=16, timeout_s=900)
    assert report["kvbm_hits"] == 6, report  # every prompt was served from kvbm the third time
    assert report["same_cached_tokens"] == 6, report  # ... as far as vLLM's own cache served it
    assert report["kvbm_hit_differs_from_own_hit"] == 0, report["differences"]
