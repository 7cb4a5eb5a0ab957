"""float16 / bfloat16 all-reduce on its own, under 4 mirrored replicas:
the float16 sum cannot overflow and keeps small values, bfloat16 stays
within its rounding, non-finite shares are reported everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from _replicas import reduce_shares
from conftest import make_strategy

from keras_mgpu import compression
from keras_mgpu.compression import FloatCompression
from keras_mgpu.compression.float_cast import power_of_two_scales

RNG = np.random.default_rng(5)
REPLICAS = 4


@pytest.fixture(scope="module")
def mirrored_4():
    return make_strategy("mirrored_4")


def _shares():
    large = RNG.uniform(5.0e4, 6.0e4, size=(REPLICAS, 6, 5))  # sum > 65504
    small = RNG.uniform(-1.0e-6, 1.0e-6, size=(REPLICAS, 7))  # subnormal
    mixed = RNG.normal(size=(REPLICAS, 3, 4))
    return [
        [a.astype("float32") for a in (large[r], small[r], mixed[r])]
        for r in range(REPLICAS)
    ]


def test_float16_sum_cannot_overflow_and_keeps_small_values(mirrored_4):
    shares = _shares()
    exact = [sum(r[k].astype("float64") for r in shares) for k in range(3)]
    # Cast as they are, the scenario overflows and loses the small values.
    assert np.isinf(
        sum(r[0].astype("float16") for r in shares).astype("float32")
    ).any()
    naive_small = sum(r[1].astype("float16").astype("float64") for r in shares)
    assert np.max(np.abs(naive_small - exact[1])) > 1e-2 * np.max(
        np.abs(exact[1])
    )
    result = reduce_shares(mirrored_4, FloatCompression("float16"), shares)
    assert result["finite"] == [True] * REPLICAS
    for k in range(3):
        bound = sum(np.abs(r[k]) for r in shares)
        for mean in result["means"][k]:
            assert mean.dtype == np.float32
            # Cast of each share + 3 additions, unit roundoff 2**-11 each.
            assert np.all(np.abs(mean - exact[k]) <= 4 * 2**-11 * bound)
        np.testing.assert_array_equal(
            result["means"][k][0], result["means"][k][3]
        )


def test_bfloat16_within_bfloat16_rounding(mirrored_4):
    shares = _shares()
    result = reduce_shares(mirrored_4, FloatCompression("bfloat16"), shares)
    for k in range(3):
        exact = sum(r[k].astype("float64") for r in shares)
        bound = sum(np.abs(r[k]) for r in shares)
        error = np.abs(result["means"][k][0] - exact)
        assert np.all(error <= 4 * 2**-8 * bound)
        assert np.max(error / bound) > 2**-14  # really rounded to bfloat16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_share_is_reported_on_every_replica(mirrored_4, dtype, bad):
    shares = _shares()
    shares[2][2][1, 1] = bad
    result = reduce_shares(mirrored_4, FloatCompression(dtype), shares)
    # float16 says so in its side information; bfloat16 in the mean.
    finite = [
        f and np.isfinite(m).all()
        for f, m in zip(result["finite"], result["means"][2])
    ]
    assert finite == [False] * REPLICAS


def test_power_of_two_scales():
    bounds = tf.constant([3.0, 2.0**15, 1e-30, 0.0, np.inf, 7e37, 1e-37])
    scales = power_of_two_scales(bounds).numpy()
    for bound, scale in zip(bounds.numpy()[:3], scales[:3]):
        assert 2.0**14 < bound * scale <= 2.0**15
        assert np.log2(scale) == np.round(np.log2(scale))
    assert scales[3] == 1.0 and scales[4] == 1.0
    assert 2.0**14 < 7e37 * scales[5] <= 2.0**15
    assert np.isfinite(scales[6]) and scales[6] == 2.0**126


@pytest.mark.parametrize(
    ("identifier", "error", "message"),
    [
        ("float8", ValueError, r"Argument `compression` must be one of "),
        ("fp16", ValueError, r"Received: compression='fp16'"),
        ("power_sgd", ValueError, r"PowerSGD\(rank=\.\.\.\)"),
        (16, TypeError, r"Received: compression=16 \(of type int\)"),
        ({"method": "zip"}, ValueError, r"Unknown compression method 'zip'"),
    ],
)
def test_unknown_methods(identifier, error, message):
    with pytest.raises(error, match=message):
        compression.get(identifier)


def test_bad_dtype():
    with pytest.raises(ValueError, match=r"Received: dtype='float8'"):
        FloatCompression("float8")


def test_names_round_trip():
    for name in ("float16", "bfloat16"):
        method = compression.get(name)
        assert isinstance(method, FloatCompression)
        assert compression.serialize(method) == name
    assert compression.get(None) is None
    assert compression.serialize(None) is None
