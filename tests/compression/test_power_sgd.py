"""PowerSGD on its own, under 2 mirrored replicas: exact on low-rank means,
error feedback conserves the gradient sum, the warm start is a power
iteration, which tensors are compressed, and bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
from _replicas import local_values, make_states, reduce_shares
from conftest import make_strategy

from keras_mgpu import compression
from keras_mgpu.compression import PowerSGD

RNG = np.random.default_rng(3)


@pytest.fixture(scope="module")
def mirrored_2():
    return make_strategy("mirrored_2")


def test_low_rank_mean_is_recovered_in_one_update(mirrored_2):
    # The replicas' shares are full rank, their sum has rank 2.
    low_rank = RNG.normal(size=(12, 2)) @ RNG.normal(size=(2, 8))
    noise = RNG.normal(size=(12, 8))
    shares = [
        [(low_rank / 2 + noise).astype("float32")],
        [(low_rank / 2 - noise).astype("float32")],
    ]
    method = PowerSGD(rank=2, start_after_updates=0)
    states = make_states(mirrored_2, method, [(12, 8)])
    result = reduce_shares(mirrored_2, method, shares, states)
    for mean in result["means"][0]:
        np.testing.assert_allclose(mean, low_rank, atol=1e-5)
    residuals = local_values(mirrored_2, states[0][0])
    np.testing.assert_allclose(sum(residuals), 0.0, atol=1e-5)
    # Each replica keeps what its own share lost (the noise is not in the
    # subspace of the sum).
    assert np.max(np.abs(residuals[0])) > 0.1
    assert result["finite"] == [True, True]


def test_error_feedback_conserves_the_gradient_sum(mirrored_2):
    """Sum of applied means + residuals == sum of the true means."""
    method = PowerSGD(rank=1, start_after_updates=0)
    states = make_states(mirrored_2, method, [(16, 12), (12,)])
    applied = [np.zeros((16, 12)), np.zeros(12)]
    true = [np.zeros((16, 12)), np.zeros(12)]
    for _ in range(4):
        shares = [
            [RNG.normal(size=(16, 12)).astype("float32"), RNG.normal(size=12)]
            for _ in range(2)
        ]
        shares = [[s.astype("float32") for s in r] for r in shares]
        result = reduce_shares(mirrored_2, method, shares, states)
        for k in range(2):
            true[k] += shares[0][k] + shares[1][k]
            applied[k] += result["means"][k][0]
            np.testing.assert_array_equal(*result["means"][k])
    residual = sum(local_values(mirrored_2, states[0][0]))
    np.testing.assert_allclose(applied[0] + residual, true[0], atol=1e-4)
    # Rank 1 of a random 16x12 matrix is far from it: the residual matters.
    assert np.max(np.abs(residual)) > 1.0
    # The bias is small: sent uncompressed, exact.
    np.testing.assert_allclose(applied[1], true[1], atol=1e-5)
    assert states[1] == ()


def test_warm_start_converges_to_the_best_rank_r_approximation(mirrored_2):
    """Reusing the factor makes successive updates a power iteration: on a
    fixed matrix (residual cleared each time), the approximation reaches
    the best rank-1 one (Eckart-Young)."""
    u, _ = np.linalg.qr(RNG.normal(size=(20, 6)))
    v, _ = np.linalg.qr(RNG.normal(size=(6, 6)))
    singular = np.array([4.0, 3.0, 1.0, 0.5, 0.2, 0.1])
    matrix = (u * singular) @ v.T
    best = np.sqrt(np.sum(singular[1:] ** 2))
    method = PowerSGD(rank=1, start_after_updates=0)
    states = make_states(mirrored_2, method, [(20, 6)])
    shares = [[(matrix / 2).astype("float32")]] * 2
    errors = []
    for _ in range(12):
        result = reduce_shares(mirrored_2, method, shares, states)
        errors.append(np.linalg.norm(matrix - result["means"][0][0]))
        states[0][0].assign(np.zeros((20, 6), "float32"))
    assert errors[-1] == pytest.approx(best, rel=1e-3)
    assert errors[0] > best * 1.01


def test_which_tensors_are_compressed():
    method = PowerSGD(rank=2, start_after_updates=0)
    assert method.matrix_shape((3, 3, 16, 32)) == (144, 32)
    assert method.matrix_shape((64, 10)) == (64, 10)
    assert method.matrix_shape((9, 16)) == (9, 16)  # 100 <= 144
    assert method.matrix_shape((4, 4)) is None  # factors not 2x smaller
    assert method.matrix_shape((64,)) is None  # biases, scales
    assert PowerSGD(rank=2, min_compression_rate=1).matrix_shape((4, 4))
    assert PowerSGD(rank=4, start_after_updates=0).matrix_shape((9, 16)) is None


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rank": 0}, ValueError, r"`rank` must be an integer >= 1\. "),
        ({"rank": -2}, ValueError, r"Received: rank=-2"),
        ({"rank": 1.5}, TypeError, r"`rank` must be an integer >= 1"),
        ({"rank": True}, TypeError, r"Received: rank=True"),
        (
            {"start_after_updates": -1},
            ValueError,
            r"`start_after_updates` must be an integer >= 0",
        ),
        (
            {"min_compression_rate": 0.5},
            ValueError,
            r"`min_compression_rate` must be a number >= 1\.0",
        ),
        ({"seed": -1}, ValueError, r"`seed` must be an integer >= 0"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        PowerSGD(**kwargs)


def test_the_default_waits_for_a_warm_up_and_options_are_keywords():
    # Compressing from update 0 cost 1.2 accuracy points on the demo; the
    # default lets the fast early phase pass (PyTorch's default: 1000).
    assert PowerSGD().start_after_updates == 1000
    with pytest.raises(TypeError):
        PowerSGD(2, 0)  # start_after_updates is keyword-only


def test_config_round_trip():
    method = PowerSGD(rank=3, start_after_updates=10, min_compression_rate=4)
    config = compression.serialize(method)
    assert config == {
        "method": "power_sgd",
        "rank": 3,
        "start_after_updates": 10,
        "min_compression_rate": 4.0,
        "seed": 0,
    }
    assert compression.get(config) == method
    assert compression.get(method) is method
    assert repr(method) == (
        "PowerSGD(rank=3, start_after_updates=10, min_compression_rate=4.0, "
        "seed=0)"
    )
