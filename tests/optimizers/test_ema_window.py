"""EMA when `fit` ends inside an accumulation window, on each backend (the
bodies: `ema_window_bodies.py`)."""

from __future__ import annotations

import pytest
from ema_window_bodies import (
    MICRO_STEPS,
    check_fit_ending_at,
    check_fits_ending_inside_windows,
    check_weights_set_inside_the_first_window,
)

pytestmark = pytest.mark.backends("tensorflow", "jax")


@pytest.mark.parametrize("micro_steps", MICRO_STEPS)
def test_fit_ending_at_each_window_position(micro_steps):
    check_fit_ending_at(micro_steps)


def test_fits_ending_inside_windows():
    check_fits_ending_inside_windows()


def test_weights_set_inside_the_first_window():
    check_weights_set_inside_the_first_window()


@pytest.mark.backends("tensorflow")
def test_fit_ending_inside_the_first_window_under_mirrored():
    # The averages follow the weights in cross-replica context there.
    from conftest import make_strategy

    check_fit_ending_at(2, scope=make_strategy("mirrored_2").scope())
