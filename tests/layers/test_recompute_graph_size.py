"""Recompute costs one extra forward of the recomputed blocks, counted in
the ops of the train step TensorFlow runs (see layers/graph_size.py):
a regression signal for step time that load cannot blur. tf_keras:
tests/legacy/test_recompute_in_place.py runs the same check."""

from __future__ import annotations

import pytest
from layers.graph_size import assert_one_extra_forward

CASES = ("in_place", "wrapper", "sqrt")


@pytest.mark.parametrize("case", CASES)
def test_train_step_runs_one_extra_forward_per_block(case):
    assert_one_extra_forward(case, CASES)
