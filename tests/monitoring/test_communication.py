"""keras_mgpu.monitoring.communication on TensorFlow: the arithmetic of
`update_bytes` and `predict_scaling`, and the bytes a `MirroredStrategy`
step hands its reductions, counted as they run, against `update_bytes`
(plain, float16 / bfloat16 and PowerSGD compression, accumulation)."""

from __future__ import annotations

import math

import keras
import pytest
from conftest import make_strategy
from monitoring import _communication_cases as cases

import keras_mgpu
from keras_mgpu.compression import CrossDeviceByteCounter, PowerSGD
from keras_mgpu.monitoring import (
    INTERCONNECTS,
    predict_scaling,
    update_bytes,
)


def _gradient_bytes(counter, replicas=2) -> int:
    """Bytes of the reductions but the scalars (the loss, metrics and
    finiteness counts) and one replica's batch, which Keras's `fit`
    reduces once to learn its shapes (`_maybe_symbolic_build`)."""
    rows = cases.BATCH // replicas
    data = {(rows, 8), (rows, 3)}
    return sum(
        r["bytes"]
        for r in counter.records()
        if r["shape"] and r["shape"] not in data
    )


def _counted_fit(optimizer, steps):
    strategy = make_strategy("mirrored_2")
    counter = CrossDeviceByteCounter(strategy)
    try:
        with strategy.scope():
            model = cases.build_model(keras, optimizer=optimizer())
        x, y = cases.batch(cases.BATCH * steps)
        model.fit(x, y, batch_size=cases.BATCH, epochs=1, verbose=0)
        return model, _gradient_bytes(counter)
    finally:
        counter.remove()


def test_mirrored_step_reduces_the_gradients_bytes():
    model, sent = _counted_fit(lambda: keras.optimizers.SGD(0.1), steps=1)
    assert sent == cases.float32_bytes()
    assert update_bytes(model).bytes_per_update == sent


@pytest.mark.parametrize(
    "compression, expected",
    [
        # float16: half the bytes, plus one float32 bound per tensor.
        ("float16", cases.float32_bytes() // 2 + 4 * 4),
        # rank 1: kernels as (16 + 8) and (3 + 16) factor elements; biases
        # whole.
        (PowerSGD(1, start_after_updates=0), 4 * (24 + 19 + 16 + 3)),
    ],
    ids=["float16", "power_sgd"],
)
def test_compression_and_accumulation_change_the_bytes(compression, expected):
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


def test_sizes_dtype_and_sharding_arithmetic():
    traffic = update_bytes([(8, 16), 16, (16, 3)], dtype="bfloat16")
    assert traffic.parameters == 128 + 16 + 48
    assert traffic.bytes_per_update == 2 * 192
    assert traffic.wire_bytes(1) == 0
    assert traffic.wire_bytes(4) == 2 * 3 / 4 * 2 * 192
    assert update_bytes(25_557_032).bytes_per_update == 4 * 25_557_032
    bfloat16 = keras_mgpu.GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1), accumulation_steps=3, compression="bfloat16"
    )
    traffic = update_bytes([(8, 16), 16], optimizer=bfloat16)
    assert (traffic.bytes_per_update, traffic.wire) == (2 * 144, "bfloat16")
    assert traffic.micro_steps_per_update == 3
    with pytest.raises(ValueError, match="`dtype` and an optimizer with"):
        update_bytes(10, optimizer=bfloat16, dtype="float32")
    with pytest.raises(ValueError, match="`dtype`.*Received: dtype='bogus'"):
        update_bytes(10, dtype="bogus")
    with pytest.raises(TypeError, match="`model_or_sizes`.*Received"):
        update_bytes("resnet")
    with pytest.raises(ValueError, match="`model_or_sizes`.*>= 0"):
        update_bytes([-3])


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
