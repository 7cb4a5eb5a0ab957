"""EMA when `fit` ends inside an accumulation window, under tf_keras (the
bodies are shared with Keras 3: `tests/optimizers/ema_window_bodies.py`).
tf_keras starts its averages at the weights; these check that the end of
`fit` inside the first window keeps the weights all the same."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "optimizers"))
from ema_window_bodies import (  # noqa: E402
    check_fit_ending_at,
    check_weights_set_inside_the_first_window,
)

from keras_mgpu._flavour import IS_TF_KERAS  # noqa: E402

assert IS_TF_KERAS, "tests/legacy runs with TF_USE_LEGACY_KERAS=1"


@pytest.mark.parametrize("micro_steps", (2, 4))
def test_fit_ending_inside_and_after_a_window(micro_steps):
    check_fit_ending_at(micro_steps)


def test_weights_set_inside_the_first_window():
    check_weights_set_inside_the_first_window()
