"""Keras's own optimizer tests on JAX, every optimizer they build wrapped in
GradientAccumulationOptimizer with K=1 (the wrapper must be invisible).

The clipping cases of every optimizer Keras ships tests for, two golden-value
cases and EMA run here (40 of 265 cases); the whole set is a command
(`KERAS_BACKEND=jax python tests/optimizers/keras_oracles.py`, about 10
minutes on 2 cores, docs/development.md).
"""

from __future__ import annotations

import keras_oracles as oracles
import pytest

from keras_mgpu._flavour import keras
from keras_mgpu.testing import set_random_seed

CASES = oracles.oracle_cases(oracles.oracle_modules())
# Every clipping case (the wrapper clips the window's mean, not what Keras
# clips itself: these say it is the same at K=1), two golden-value cases
# (each 5-10 s on JAX) and the EMA case: about 30 s on 2 cores.
_GOLDEN = (
    "sgd_test:SGDTest.test_correctness_with_golden",
    "adam_test:AdamTest.test_correctness_with_golden",
    "optimizer_test:OptimizerTest.test_ema",
)
SUBSET = [
    case
    for case in CASES
    if case in _GOLDEN or "clip" in case.rsplit(".", 1)[-1]
]


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    """As in test_keras_oracles.py: each case clears the session itself
    (seeded without Keras's seeding, which imports TensorFlow)."""
    set_random_seed(1234)
    yield


@pytest.mark.slow
@pytest.mark.parametrize("case", SUBSET or [None])
def test_keras_optimizer_oracle_on_jax(case: str | None) -> None:
    if case is None:
        pytest.skip(f"Keras {keras.version()} ships no optimizer tests")
    assert case not in oracles.known_differences(CASES)
    oracles.replay(case, 1)


def test_the_subset_covers_clipping_of_every_optimizer_keras_tests():
    if not CASES:
        pytest.skip(f"Keras {keras.version()} ships no optimizer tests")
    clipped = {c.split(":")[0] for c in SUBSET if c.endswith("clip_norm")}
    assert len(clipped) >= 14, sorted(clipped)
    assert set(_GOLDEN) <= set(SUBSET)
