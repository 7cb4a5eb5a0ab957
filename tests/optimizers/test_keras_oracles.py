"""Keras's own optimizer tests, replayed through GradientAccumulationOptimizer,
on each backend.

Every `*_test.py` the installed Keras ships under `keras/src/optimizers/`
runs with each applied gradient split into K micro-gradients whose mean is
that gradient (keras_oracles.py says how). Cases that cannot pass through a
wrapper are strict xfails with the reason; Keras's own skips stay skips. The
broken-wrapper test shows the replay can fail.

TensorFlow replays every case at K = 1, 2, 3. JAX replays a subset at K = 1
(the wrapper must be invisible): the clipping cases of every optimizer Keras
ships tests for, two golden-value cases and EMA (40 of 265 cases, about 30 s
on 2 cores; each golden case takes 5-10 s on JAX). The whole JAX set is a
command (`KERAS_BACKEND=jax python tests/optimizers/keras_oracles.py`, about
10 minutes on 2 cores, docs/development.md).
"""

from __future__ import annotations

import keras_oracles as oracles
import pytest

from keras_mgpu._flavour import keras
from keras_mgpu.testing import set_random_seed

pytestmark = pytest.mark.backends("tensorflow", "jax")

ON_JAX = keras.backend.backend() == "jax"
MODULES = oracles.oracle_modules()
CASES = oracles.oracle_cases(MODULES)
NO_ORACLES = (
    f"Keras {keras.version()} ships no optimizer tests (*_test.py) under "
    "keras/src/optimizers/ in its wheel"
)
# JAX's subset: every clipping case (the wrapper clips the window's mean,
# not what Keras clips itself: these say it is the same at K=1), two
# golden-value cases and the EMA case.
_GOLDEN = (
    "sgd_test:SGDTest.test_correctness_with_golden",
    "adam_test:AdamTest.test_correctness_with_golden",
    "optimizer_test:OptimizerTest.test_ema",
)
JAX_SUBSET = [
    case
    for case in CASES
    if case in _GOLDEN or "clip" in case.rsplit(".", 1)[-1]
]


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    """Overrides the conftest fixture: each oracle case clears the Keras
    session itself (Keras's `TestCase.setUp`, without a garbage collection);
    the conftest's `clear_session()` collects garbage twice per test, which
    tripled this module's run time. Seeds as the conftest does (without
    Keras's seeding, which imports TensorFlow on JAX)."""
    set_random_seed(1234)
    yield


def _replay_params() -> list:
    """(case, K) per backend: every case at K = 1, 2, 3 on TensorFlow,
    known differences as strict xfails; JAX's subset at K = 1, none of
    which may be a known difference there."""
    if not CASES:
        return [pytest.param(None, 1, marks=pytest.mark.skip(NO_ORACLES))]
    if ON_JAX:
        return [pytest.param(case, 1, id=f"{case}-K1") for case in JAX_SUBSET]
    known = oracles.known_differences(CASES)
    params = []
    for case in CASES:
        reason = known.get(case)
        marks = (
            [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        )
        for steps in (1, 2, 3):
            params.append(
                pytest.param(case, steps, marks=marks, id=f"{case}-K{steps}")
            )
    return params


@pytest.mark.slow
@pytest.mark.parametrize(("case", "steps"), _replay_params())
def test_keras_optimizer_oracle(case: str, steps: int) -> None:
    if ON_JAX:
        assert case not in oracles.known_differences(CASES)
    oracles.replay(case, steps)


def test_known_differences_name_existing_cases() -> None:
    if not CASES:
        pytest.skip(NO_ORACLES)
    stale = sorted(set(oracles.KNOWN_DIFFERENCES) - set(CASES))
    assert not stale, (
        f"KNOWN_DIFFERENCES names cases Keras no longer has: {stale}"
    )


@pytest.mark.backends("jax")
def test_the_subset_covers_clipping_of_every_optimizer_keras_tests():
    if not CASES:
        pytest.skip(NO_ORACLES)
    clipped = {c.split(":")[0] for c in JAX_SUBSET if c.endswith("clip_norm")}
    assert len(clipped) >= 14, sorted(clipped)
    assert set(_GOLDEN) <= set(JAX_SUBSET)


# A subset of the oracles, and the cases each broken wrapper must fail.
# (Adam is scale-invariant: summing instead of averaging moves it by the
# epsilon only, so the sum is caught by SGD's cases.)
_SGD_GOLDEN = "sgd_test:SGDTest.test_correctness_with_golden"
_SGD_EMA = "optimizer_test:OptimizerTest.test_ema"
_ADAM_GOLDEN = "adam_test:AdamTest.test_correctness_with_golden"
_CLIPPING = (
    "sgd_test:SGDTest.test_clip_norm",
    "optimizer_test:OptimizerTest.test_global_clip_norm",
)
_SUBSET = (_SGD_GOLDEN, _SGD_EMA, _ADAM_GOLDEN, *_CLIPPING)
_MUST_FAIL = {
    "sum_instead_of_mean": (_SGD_GOLDEN, _SGD_EMA),
    "update_every_micro_step": (_SGD_GOLDEN, _SGD_EMA, _ADAM_GOLDEN),
    "clip_per_micro_step": _CLIPPING,
}


def _failing(cases: tuple, breakage: dict | None) -> list[str]:
    failing = []
    for case in cases:
        try:
            oracles.replay(case, 2, breakage)
        except AssertionError:
            failing.append(case)
    return failing


# TensorFlow only: JAX replays at K = 1, where no breakage shows, and its
# golden cases cost 5-10 s each.
@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("broken", sorted(oracles.BROKEN_WRAPPERS))
def test_broken_wrappers_fail_the_oracles(broken: str) -> None:
    if not CASES:
        pytest.skip(NO_ORACLES)
    assert _failing(_SUBSET, None) == []  # the real wrapper passes them
    failing = _failing(_SUBSET, oracles.BROKEN_WRAPPERS[broken]())
    assert set(_MUST_FAIL[broken]) <= set(failing), failing
