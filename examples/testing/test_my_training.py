"""Tests of my_training.py with keras_mgpu.testing's fixtures."""

import keras
import numpy as np
from my_training import build_model, data

from keras_mgpu.testing import assert_trains_like


def test_trains_like_one_device(strategy):
    # Runs 5 times: default, one_device, mirrored_2, mirrored_4,
    # central_storage (see the test ids).
    assert_trains_like(build_model, data(), strategy, steps=4, atol=1e-5)


def test_two_workers_agree_and_match_one_process(run_workers):
    workers = run_workers("my_training:train_on_cluster", 2, 2, timeout=180)
    first, second = ([np.array(w) for w in ws] for ws in workers)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)  # workers hold one model
    # One process on the same global batch of 16 gives the same weights.
    keras.utils.set_random_seed(0)
    model = build_model()
    model.fit(*data(), batch_size=16, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(first, model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
