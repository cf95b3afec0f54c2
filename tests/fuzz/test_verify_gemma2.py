"""A fixed seed of the verify harness on a hybrid model (kvbm.verify, ``gemma2``: a sliding-window KV-cache group and
a full-attention one under vLLM's hybrid manager): the window's frees, the fence before every forward, window-only
loads. Its own file so that pytest-xdist runs it beside test_verify_seeds.py."""

from __future__ import annotations

import pytest
from test_verify_seeds import check_seed, models, pytestmark  # noqa: F401 (the fixture and the marks)


@pytest.mark.parametrize("seed", [pytest.param(1, id="gemma2-seed-1-sync-load-hit")])
def test_a_seeded_schedule_on_a_hybrid_model_keeps_every_invariant(seed, models, tmp_path):  # noqa: F811
    check_seed(seed, "gemma2", models, tmp_path)
