"""Keras 3: `synchronize_batchnorm` composed with `use_window_statistics`,
in every order, undone in every order, saved to `.keras` files, and under a
2-replica MirroredStrategy with batches that do not split evenly (the
tf_keras twins are in tests/legacy/test_batchnorm_remedies.py)."""

from __future__ import annotations

import pytest
from _batchnorm_checks import (
    COMPOSITION_ORDERS,
    check_composition,
    check_synchronized_window_file,
    check_synchronized_window_uneven_split,
)

from keras_mgpu import _flavour

if _flavour.IS_TF_KERAS:  # tests/legacy covers tf_keras
    pytest.skip("Keras 3 tests", allow_module_level=True)

keras = _flavour.keras


@pytest.mark.parametrize("order", COMPOSITION_ORDERS)
def test_compose_and_undo_in_any_order(order):
    check_composition(keras, order)


@pytest.mark.parametrize("order", ["sync,window", "window,sync"])
def test_synchronized_window_keras_file_resumes_mid_window(order, tmp_path):
    check_synchronized_window_file(
        keras, order, str(tmp_path / "synchronized_window.keras")
    )


def test_synchronized_window_with_uneven_replica_split_is_the_large_batch(
    mirrored_strategy,
):
    # Each micro-batch's statistics are global, and so is its weight in
    # the window: 5 examples (3 + 2 per replica) weigh 5/29, not 3/27 on
    # one replica and 2/26 on the other.
    check_synchronized_window_uneven_split(
        keras, mirrored_strategy(2), "window,sync"
    )
