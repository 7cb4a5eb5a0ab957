"""PlacedModel in `model.fit`: equal to the unplaced model, updates on the
variables' devices, activations crossing only at stage boundaries, `.keras`
files, the other components of the pack, and the strategies."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _placement_helpers import (
    CPUS,
    data,
    device_of,
    placed_nodes,
    stage_cuts,
    staged_mlp,
    transfers,
)

from keras_mgpu import GradientAccumulationOptimizer, _flavour
from keras_mgpu.callbacks import (
    GPULoadMonitor,
    LearningRateScaler,
    LearningRateWarmup,
    MemoryMonitor,
)
from keras_mgpu.placement import PlacedModel, apply_placement

keras = _flavour.keras
tf = _flavour.tf

HOST = "/device:CPU:0"
STAGES = ["/device:CPU:1", "/device:CPU:2", "/device:CPU:3"]


def _fit(model, x, y, optimizer, epochs=2, **kwargs):
    model.compile(optimizer=optimizer, loss="mse")
    return model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


def _assert_same_weights(a, b, rtol=1e-5, atol=1e-6):
    for va, vb in zip(a.weights, b.weights, strict=True):
        np.testing.assert_allclose(va.numpy(), vb.numpy(), rtol=rtol, atol=atol)


def _stage_of(device):
    return STAGES.index(device) if device in STAGES else None


@pytest.mark.slow
def test_fit_equals_the_unplaced_model_and_tensors_cross_only_at_boundaries():
    """Stages on cpu:1..3, the host (input pipeline, loss scalars) on
    cpu:0. Between stage devices only the boundary activation goes forward
    and its gradient back, once each per step; stages other than the last
    send the host no data; each optimizer slot lives with its variable."""
    model = staged_mlp(3)
    placed = apply_placement(model, CPUS[1:4], policy=stage_cuts(model))
    x, y = data()
    nodes = placed_nodes(
        lambda: _fit(
            placed, x, y, keras.optimizers.Adam(0.01, clipnorm=1.0), epochs=1
        )
    )
    _fit(model, x, y, keras.optimizers.Adam(0.01, clipnorm=1.0), epochs=1)
    _assert_same_weights(placed, model)

    between_stages, to_host = [], []
    for source, target, name in transfers(nodes):
        s, t = _stage_of(source), _stage_of(target)
        if s is not None and t is not None:
            between_stages.append((s, t))
        elif s is not None and target == HOST:
            to_host.append((s, name))
    assert sorted(between_stages) == [(0, 1), (1, 0), (1, 2), (2, 1)]
    assert {s for s, _ in to_host} <= {2}, to_host  # the loss, from the last
    for variable in placed.optimizer.variables:
        if len(variable.shape):  # slots, not the step counters
            owner = variable.path.split("/")[-1].rsplit("_", 1)[0]
            assert device_of(variable) != HOST, (variable.path, owner)
    devices = {device_of(v) for v in placed.optimizer.variables if len(v.shape)}
    assert devices == set(STAGES)


@pytest.mark.slow
def test_keras_file_round_trip_keeps_placement_and_resumes_exactly(tmp_path):
    model = staged_mlp(2)
    placed = apply_placement(model, CPUS[2:4])
    x, y = data()
    _fit(placed, x, y, keras.optimizers.Adam(0.01), epochs=1)
    path = str(tmp_path / "placed.keras")
    placed.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, PlacedModel)
    assert [device_of(v) for v in loaded.weights] == [
        device_of(v) for v in placed.weights
    ]
    assert {
        device_of(v) for v in loaded.optimizer.variables if len(v.shape)
    } == {
        "/device:CPU:2",
        "/device:CPU:3",
    }
    placed.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(loaded, placed, rtol=1e-6, atol=1e-7)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        again = keras.models.load_model(path)
    assert {device_of(v) for v in again.weights} == {
        "/device:CPU:2",
        "/device:CPU:3",
    }


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:LearningRateWarmup")  # 2 of 3 updates
def test_composes_with_accumulation_lr_callbacks_and_monitors():
    model = staged_mlp(2)
    placed = apply_placement(model, CPUS[:2])
    x, y = data(16)

    def callbacks(monitors):
        found = [
            LearningRateScaler(
                base_batch_size=4, per_replica_batch_size=8, verbose=0
            ),
            LearningRateWarmup(warmup_steps=3),
        ]
        if monitors:
            found += [MemoryMonitor(), GPULoadMonitor(interval=0.05)]
        return found

    def optimizer():
        return GradientAccumulationOptimizer(keras.optimizers.Adam(0.01), 2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no NVML / CPU-only notices
        history = _fit(placed, x, y, optimizer(), callbacks=callbacks(True))
    plain = _fit(model, x, y, optimizer(), callbacks=callbacks(False))
    _assert_same_weights(placed, model)
    assert int(placed.optimizer.iterations.numpy()) == 2  # 4 steps, K=2
    assert "mem/host_rss_mb" in history.history
    # Without a GPU the load monitor logs CPU utilization (psutil).
    assert "cpu/util_mean_pct" in history.history
    # Scaled 0.01 x 16/4, two updates into a 3-update warmup.
    assert history.history["learning_rate"] == plain.history["learning_rate"]
    assert history.history["learning_rate"][-1] == pytest.approx(0.04 * 2 / 3)


@pytest.mark.slow
def test_one_device_strategy_trains_with_variables_on_the_stages():
    x, y = data()
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = staged_mlp(2)
        placed = apply_placement(model, CPUS[2:4])
        _fit(placed, x, y, keras.optimizers.SGD(0.05, momentum=0.9))
        _fit(model, x, y, keras.optimizers.SGD(0.05, momentum=0.9))
    assert {device_of(v) for v in placed.weights} == {
        "/device:CPU:2",
        "/device:CPU:3",
    }
    _assert_same_weights(placed, model)


def _mirrored():
    return tf.distribute.MirroredStrategy(
        CPUS[:2], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )


MESSAGE = (
    r"Model parallelism and data parallelism cannot be combined in "
    r"tf.distribute \({}\).*one device per replica.*Instead: train the "
    r"placed model under the default strategy"
)


def test_replicating_strategies_are_refused_with_what_to_do(tmp_path):
    with _mirrored().scope():
        with pytest.raises(ValueError, match=MESSAGE.format("apply_placement")):
            apply_placement(staged_mlp(2), CPUS[2:4])
    central = tf.distribute.experimental.CentralStorageStrategy(CPUS[:2])
    with central.scope():
        with pytest.raises(ValueError, match="CentralStorageStrategy"):
            apply_placement(staged_mlp(2), CPUS[2:4])
    placed = apply_placement(staged_mlp(2), CPUS[2:4])
    path = str(tmp_path / "placed.keras")
    placed.save(path)
    with _mirrored().scope():
        with pytest.raises(
            ValueError, match=MESSAGE.format("building PlacedLayer 's0_a'")
        ):
            keras.models.load_model(path)
        placed.compile(optimizer="sgd", loss="mse")
    x, y = data()
    with pytest.raises(
        ValueError,
        match=MESSAGE.format(
            "its optimizer was created under a replicating strategy"
        ),
    ):
        placed.fit(x, y, verbose=0)


def test_xla_is_turned_off():
    placed = apply_placement(staged_mlp(2), CPUS[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        placed.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert placed.jit_compile is False


def test_memory_monitor_reads_every_stage_device():
    from keras_mgpu.monitoring.tf_memory import strategy_devices

    placed = apply_placement(staged_mlp(2), CPUS[:2])
    assert strategy_devices(None, placed.variables) == ["CPU:0", "CPU:1"]


@pytest.mark.gpu
def test_memory_monitor_shows_one_stage_per_gpu():
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((1024,)), keras.layers.Dense(8192), keras.layers.Dense(16)]
    )
    placed = apply_placement(model, ["/gpu:0", "/gpu:1"], policy=[1])
    x = np.zeros((256, 1024), "float32")
    y = np.zeros((256, 16), "float32")
    history = _fit(placed, x, y, "adam", epochs=1, callbacks=[MemoryMonitor()])
    assert (
        history.history["mem/gpu0_peak_mb"][0]
        > 3 * history.history["mem/gpu1_peak_mb"][0]
    )
