"""keras_mgpu.monitoring.communication, written once and run on each backend:
the arithmetic of `update_bytes` and `predict_scaling`, and the bytes a
data-parallel step hands its gradient reduction against `update_bytes`
(the plain count of the gradients' bytes). TensorFlow counts them as they
run under a `MirroredStrategy` (`CrossDeviceByteCounter`: plain, float16
and PowerSGD compression, accumulation); JAX reads them from the compiled
train step's collectives (4 CPU devices, `DataParallel` and, per device,
`ModelParallel`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import keras_mgpu
from keras_mgpu import _flavour
from keras_mgpu.monitoring import (
    INTERCONNECTS,
    predict_scaling,
    update_bytes,
)

pytestmark = pytest.mark.backends("tensorflow", "jax")

keras = _flavour.keras

# Dense 8 -> 16 -> 3: kernels (8, 16) and (16, 3), biases (16,) and (3,).
LAYER_SHAPES = [(8, 16), (16,), (16, 3), (3,)]
BATCH = 16


def build_model(optimizer="sgd", metrics=None):
    """The model, compiled, named so that a LayoutMap can find it."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="d1"),
            keras.layers.Dense(3, name="d2"),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse", metrics=metrics)
    return model


def batch(rows=BATCH):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = rng.standard_normal((rows, 3)).astype("float32")
    return x, y


def float32_bytes(shapes=LAYER_SHAPES):
    """The gradients' bytes in float32: the plain computation."""
    return sum(4 * int(np.prod(shape)) for shape in shapes)


def _data_parallel():
    return keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")
    )


def _gradient_bytes(counter, replicas=2) -> int:
    """TensorFlow: bytes of the reductions but the scalars (the loss,
    metrics and finiteness counts) and one replica's batch, which Keras's
    `fit` reduces once to learn its shapes (`_maybe_symbolic_build`)."""
    rows = BATCH // replicas
    data = {(rows, 8), (rows, 3)}
    return sum(
        r["bytes"]
        for r in counter.records()
        if r["shape"] and r["shape"] not in data
    )


def _counted_fit(optimizer, steps):
    """TensorFlow: `fit` under a 2-replica MirroredStrategy, its
    reductions' bytes counted as they run."""
    from conftest import make_strategy

    from keras_mgpu.compression import CrossDeviceByteCounter

    strategy = make_strategy("mirrored_2")
    counter = CrossDeviceByteCounter(strategy)
    try:
        with strategy.scope():
            model = build_model(optimizer=optimizer())
        x, y = batch(BATCH * steps)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        return model, _gradient_bytes(counter)
    finally:
        counter.remove()


def _reduced_gradient_bytes() -> tuple:
    """The model after one data-parallel step, and the bytes that step's
    gradient reduction sends: counted as it runs on TensorFlow (Mirrored,
    2 replicas), read from the compiled step's collectives on JAX
    (`DataParallel`, 4 devices)."""
    if keras.backend.backend() != "jax":
        return _counted_fit(lambda: keras.optimizers.SGD(0.1), steps=1)
    from keras_mgpu.monitoring import train_step_collectives

    x, y = batch()
    with _data_parallel().scope():
        model = build_model(metrics=["mae"])
        with pytest.raises(ValueError, match="`model` must be compiled and"):
            train_step_collectives(model, x, y)
        model.train_on_batch(x, y)
        counts = train_step_collectives(model, x, y)
    # XLA combines the reductions into one tuple all-reduce on CPU: the
    # gradients plus the loss's and the metric's scalar sums.
    assert 0 < counts["scalar"] <= 4 * 4
    assert counts["total"] == counts["all-reduce"]
    assert counts["wire"] == pytest.approx(2 * 3 / 4 * counts["all-reduce"])
    return model, counts["all-reduce"] - counts["scalar"]


def test_data_parallel_step_reduces_exactly_the_gradients_bytes():
    model, sent = _reduced_gradient_bytes()
    assert sent == float32_bytes()
    assert update_bytes(model).bytes_per_update == sent


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize(
    "compression, expected",
    [
        # float16: half the bytes, plus one float32 bound per tensor.
        ("float16", float32_bytes() // 2 + 4 * 4),
        # rank 1: kernels as (16 + 8) and (3 + 16) factor elements; biases
        # whole.
        ("power_sgd", 4 * (24 + 19 + 16 + 3)),
    ],
)
def test_compression_and_accumulation_change_the_bytes(compression, expected):
    from keras_mgpu.compression import PowerSGD

    if compression == "power_sgd":
        compression = PowerSGD(1, start_after_updates=0)

    def optimizer():
        return keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1),
            accumulation_steps=2,
            compression=compression,
        )

    # Two micro-steps: one update, one (compressed) reduction.
    model, sent = _counted_fit(optimizer, steps=2)
    traffic = update_bytes(model)
    assert sent == expected
    assert traffic.bytes_per_update == expected
    assert traffic.reductions_per_update == 1
    assert traffic.micro_steps_per_update == 2


@pytest.mark.backends("jax")
def test_model_parallel_reduces_each_devices_shard_over_the_data_axis():
    from keras_mgpu.backend.jax.collectives import (
        collectives_from_hlo,
        compiled_train_step,
    )

    devices = keras.distribution.list_devices("cpu")
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*d1/kernel"] = (None, "model")
    layout_map[".*d1/bias"] = ("model",)
    layout_map[".*d2/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    x, y = batch()
    with distribution.scope():
        model = build_model()
        model.train_on_batch(x, y)
        compiled = compiled_train_step(model, x, y)
        traffic = update_bytes(model)
    # Each device holds half of d1's kernel and bias and of d2's kernel.
    expected = float32_bytes([(8, 8), (8,), (8, 3), (3,)])
    assert traffic.bytes_per_update == expected
    records = collectives_from_hlo(compiled.as_text())
    over_data = [r for r in records if r.mesh_axes == (0,)]
    assert over_data, [r for r in records]
    assert all(r.group_size == 2 for r in over_data)
    assert sum(r.bytes - r.scalar_bytes for r in over_data) == expected
    # The model axis carries the activations' partial sums besides.
    assert any(r.mesh_axes != (0,) for r in records)


@pytest.mark.backends("jax")
def test_accumulation_reduces_every_micro_step_on_jax():
    from keras_mgpu.monitoring import train_step_collectives

    x, y = batch()
    with _data_parallel().scope():
        optimizer = keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=4
        )
        model = build_model(optimizer=optimizer)
        model.train_on_batch(x, y)
        counts = train_step_collectives(model, x, y)
        traffic = update_bytes(model)
    # Each `fit` step (one micro-step) is a compiled call that reduces its
    # gradients once: 4 reductions per update.
    assert counts["all-reduce"] - counts["scalar"] == float32_bytes()
    assert traffic.payload_bytes == float32_bytes()
    assert traffic.reductions_per_update == 4
    assert traffic.bytes_per_update == 4 * float32_bytes()


def test_sizes_dtype_and_sharding_arithmetic():
    traffic = update_bytes([(8, 16), 16, (16, 3)], dtype="bfloat16")
    assert traffic.parameters == 128 + 16 + 48
    assert traffic.bytes_per_update == 2 * 192
    assert traffic.wire_bytes(1) == 0
    assert traffic.wire_bytes(4) == 2 * 3 / 4 * 2 * 192
    assert update_bytes(25_557_032).bytes_per_update == 4 * 25_557_032
    with pytest.raises(ValueError, match="`dtype`.*Received: dtype='bogus'"):
        update_bytes(10, dtype="bogus")
    with pytest.raises(TypeError, match="`model_or_sizes`.*Received"):
        update_bytes("resnet")
    with pytest.raises(ValueError, match="`model_or_sizes`.*>= 0"):
        update_bytes([-3])


@pytest.mark.backends("tensorflow")  # compression is TensorFlow's
def test_a_compressing_optimizer_sets_the_wire_dtype():
    bfloat16 = keras_mgpu.GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1), accumulation_steps=3, compression="bfloat16"
    )
    traffic = update_bytes([(8, 16), 16], optimizer=bfloat16)
    assert (traffic.bytes_per_update, traffic.wire) == (2 * 144, "bfloat16")
    assert traffic.micro_steps_per_update == 3
    with pytest.raises(ValueError, match="`dtype` and an optimizer with"):
        update_bytes(10, optimizer=bfloat16, dtype="float32")


def test_one_device_predicts_the_measured_step_exactly():
    for overlap in (False, True):
        prediction = predict_scaling(
            step_seconds=0.123456789,
            bytes_per_update=4e9,
            devices=1,
            intra_host_gbps=1e-3,
            overlap=overlap,
            latency_seconds=1.0,
        )
        assert prediction.update_seconds == 0.123456789
        assert prediction.efficiency == 1.0
        assert prediction.communication_seconds == 0.0


def test_ring_and_hierarchical_all_reduce_times():
    payload = 1e9  # 1 GB per update
    ring = predict_scaling(
        step_seconds=1.0,
        bytes_per_update=payload,
        devices=8,
        intra_host_gbps="nvlink4",
    )
    seconds = 2 * 7 / 8 * payload / (450e9)
    assert ring.communication_seconds == pytest.approx(seconds, rel=1e-12)
    assert ring.update_seconds == pytest.approx(1.0 + seconds, rel=1e-12)
    assert ring.efficiency == pytest.approx(1 / (1 + seconds), rel=1e-12)
    assert ring.speedup == pytest.approx(8 * ring.efficiency, rel=1e-12)
    hierarchical = predict_scaling(
        step_seconds=1.0,
        bytes_per_update=payload,
        devices=64,
        hosts=8,
        intra_host_gbps=100.0,
        inter_host_gbps="network_400gbit",
        latency_seconds=1e-5,
    )
    seconds = (
        2 * 7 / 8 * payload / 100e9
        + 2 * 7 / 8 * payload / 50e9
        + 2 * (7 + 7) * 1e-5
    )
    assert hierarchical.communication_seconds == pytest.approx(
        seconds, rel=1e-12
    )
    overlapped = predict_scaling(
        step_seconds=0.01,
        bytes_per_update=payload,
        devices=64,
        hosts=8,
        intra_host_gbps=100.0,
        inter_host_gbps=50.0,
        overlap=True,
    )
    assert overlapped.update_seconds == pytest.approx(
        max(0.01, overlapped.communication_seconds), rel=1e-12
    )
    # Per direction, in gigabytes: NVLink's quoted total over 2, networks'
    # gigabits over 8.
    assert INTERCONNECTS["nvlink4"] == 900 / 2
    assert INTERCONNECTS["network_100gbit"] == 12.5
    assert math.isclose(INTERCONNECTS["network_25gbit"], 3.125)


def test_bad_arguments_name_themselves():
    valid = {
        "step_seconds": 0.1,
        "bytes_per_update": 1e6,
        "devices": 8,
        "intra_host_gbps": 100.0,
    }
    for arguments, message in [
        ({"devices": 0}, r"`devices` must be an integer >= 1.*devices=0"),
        ({"devices": 6, "hosts": 4}, r"`devices` must be a multiple.*hosts=4"),
        ({"hosts": 2}, r"`inter_host_gbps` is required.*hosts=2"),
        ({"step_seconds": 0.0}, r"`step_seconds` must be a number > 0"),
        ({"bytes_per_update": -1}, r"`bytes_per_update` must be .*>= 0"),
        ({"intra_host_gbps": "nvlink9"}, r"`intra_host_gbps`.*'nvlink9'"),
        ({"intra_host_gbps": 0}, r"`intra_host_gbps` must be a number > 0"),
        ({"latency_seconds": -1e-6}, r"`latency_seconds` must be .*>= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            predict_scaling(**(valid | arguments))
    with pytest.raises(TypeError, match=r"`overlap` must be a bool"):
        predict_scaling(**valid, overlap="yes")


# The forms XLA prints (CPU's combined tuple all-reduce with a comment in
# its shape, GPU's asynchronous halves, iota and explicit groups).
_HLO = """HloModule jit_step, num_partitions=4
  %all-reduce.5 = (f32[], f32[16,8]{1,0}, /*index=2*/bf16[3]{0}) all-reduce(%a, %b, %c), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, to_apply=%add
  %ars = f32[10]{0} all-reduce-start(%d), replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[10]{0} all-reduce-done(%ars)
  %rs = f32[4,2]{1,0} reduce-scatter(%e), replica_groups=[2,2]<=[4], dimensions={0}
  %ag = (f32[2]{0}, f32[8]{0}) all-gather-start(%f), replica_groups={}
  %agd = f32[8]{0} all-gather-done(%ag)
  ROOT %cp = s32[5]{0} collective-permute(%g), source_target_pairs={{0,1},{1,0}}
"""  # noqa: E501


def test_hlo_collectives_are_counted_once_each_by_kind():
    from keras_mgpu.backend.jax.collectives import collectives_from_hlo
    from keras_mgpu.monitoring import collective_bytes_from_hlo

    counts = collective_bytes_from_hlo(_HLO)
    assert counts["all-reduce"] == (4 + 4 * 128 + 2 * 3) + 40
    assert counts["scalar"] == 4
    assert counts["reduce-scatter"] == 4 * 8 * 2  # the input: 2 shards
    assert counts["all-gather"] == 4 * 8  # the gathered output
    assert counts["collective-permute"] == 4 * 5
    assert counts["count"] == 5
    groups = [(r.group_size, r.mesh_axes) for r in collectives_from_hlo(_HLO)]
    assert groups == [(2, (0,)), (4, None), (2, None), (4, None), (None, None)]
    assert counts["wire"] == pytest.approx(
        2 * 1 / 2 * 522 + 2 * 3 / 4 * 40 + 1 / 2 * 64 + 3 / 4 * 32 + 20
    )
    with pytest.raises(TypeError, match="`hlo_text` must be a str"):
        collective_bytes_from_hlo(b"HloModule")
