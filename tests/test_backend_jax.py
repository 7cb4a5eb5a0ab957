"""keras_mgpu on Keras's JAX backend: imports, refusals, distribution reads."""

from __future__ import annotations

import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu.backend import BackendNotSupportedError


def test_the_backend_is_jax():
    assert keras_mgpu.backend.backend() == "jax"
    assert keras_mgpu.backend.is_jax()


# Each public component used as a user uses it on JAX, in one process.
_USE_EVERY_COMPONENT = """
import sys, tempfile, warnings
import keras_mgpu
for m in keras_mgpu._SUBMODULES: getattr(keras_mgpu, m)
import keras_mgpu.testing, keras_mgpu.backend.jax.distribution
import numpy as np
import keras
from keras_mgpu import callbacks as cb

warnings.simplefilter("ignore")  # no GPU, one process: monitors warn
schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
y = x[:, :4] * 2.0
used = []

def build():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="down")(h))

model = keras_mgpu.apply_recompute(build())
model = keras_mgpu.normalization.use_window_statistics(model, window=2)
used += ["apply_recompute", "use_window_statistics"]
model.compile(
    keras_mgpu.GradientAccumulationOptimizer(
        keras.optimizers.Adam(keras_mgpu.Warmup(0.01, 2), use_ema=True), 2
    ),
    "mse",
)
callbacks = [
    cb.LearningRateWarmup(warmup_steps=2),
    cb.MemoryMonitor(),
    cb.GPULoadMonitor(),
    cb.StragglerMonitor(),
    cb.BackupAndRestore(tempfile.mkdtemp()),
]
if hasattr(cb, "ThroughputMonitor"):
    callbacks.append(cb.ThroughputMonitor())
model.fit(x, y, batch_size=8, epochs=2, callbacks=callbacks, verbose=0)
used += [type(c).__name__ for c in callbacks]
used += ["GradientAccumulationOptimizer", "Warmup"]
plain = build()
plain.compile(keras.optimizers.SGD(0.1), "mse")
scaler = cb.LearningRateScaler(256, batch_size=32)
plain.fit(x, y, batch_size=8, callbacks=[scaler], verbose=0)
data = keras_mgpu.distribute.shard_across_processes(x, y, batch_size=8)
plain.fit(data, verbose=0)
used += ["LearningRateScaler", "shard_across_processes"]
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh(
    (1, len(devices)), ("batch", "model"), devices
)
layout_map = keras_mgpu.sharding.plan_layout_map(plain, mesh)
keras_mgpu.sharding.check_layout_map(
    plain,
    layout_map,
    optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(schedule)
    ),
)
used += ["plan_layout_map", "check_layout_map"]
with keras.distribution.DataParallel(devices=devices).scope():
    zero = keras_mgpu.apply_recompute(build(), offload=True)
    zero.compile(keras.optimizers.Adam(), "mse")
    keras_mgpu.sharding.shard_optimizer_state(zero)
    zero.fit(x, y, batch_size=8, verbose=0)
used += ["shard_optimizer_state", "offload"]
probe = build()
probe.compile(
    keras_mgpu.GradientAccumulationOptimizer(
        keras.optimizers.SGD(schedule), 2
    ),
    "mse",
)
keras_mgpu.find_batch_size(
    probe, (x, y), memory_budget_mb=64, max_batch_size=64
)
used.append("find_batch_size")
print("USED", used)
bad = sorted(
    m for m in sys.modules if m.split(".")[0] in ("tensorflow", "tf_keras")
)
print("TENSORFLOW", bad[:5])
sys.exit(1 if bad else 0)
"""


def test_importing_and_using_every_component_leaves_tensorflow_alone():
    """The JAX guide's promise: a JAX run imports neither TensorFlow nor
    tf_keras, whatever component it uses (find_batch_size copied the model
    with Keras's serialization, which imported TensorFlow). One process
    for every component."""
    out = subprocess.run(
        [sys.executable, "-c", _USE_EVERY_COMPONENT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "find_batch_size']" in out.stdout
    assert "TENSORFLOW []" in out.stdout


@pytest.mark.parametrize(
    "build, instead",
    [
        (lambda: keras_mgpu.compression.PowerSGD(), "without compression"),
        (lambda: keras_mgpu.compression.FloatCompression(), "compression"),
        (
            lambda: keras_mgpu.apply_placement(keras.Sequential()),
            "ModelParallel",
        ),
        (
            lambda: keras_mgpu.placement_report(keras.Sequential()),
            "ModelParallel",
        ),
        (
            lambda: keras_mgpu.distribute.enable_multi_worker_fit(),
            "keras.distribution.initialize",
        ),
        (lambda: keras_mgpu.callbacks.PruningStepSync(), None),
    ],
)
def test_tensorflow_only_components_refuse_at_construction(build, instead):
    with pytest.raises(BackendNotSupportedError, match="'jax' backend") as e:
        build()
    assert "Supported: 'tensorflow'" in str(e.value)
    if instead:
        assert instead in str(e.value)


def test_replicas_follow_the_distribution_in_force():
    devices = keras.distribution.list_devices("cpu")
    assert keras_mgpu.num_replicas_in_sync() == 1
    assert keras_mgpu.distribute.strategy_kind() == "default"
    data_parallel = keras.distribution.DataParallel(devices=devices)
    assert keras_mgpu.num_replicas_in_sync(data_parallel) == 4
    with data_parallel.scope():
        assert keras_mgpu.num_replicas_in_sync() == 4
        assert keras_mgpu.global_batch_size(8, accumulation_steps=2) == 64
        assert keras_mgpu.distribute.strategy_kind() == "data_parallel"
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], devices=devices
    )
    model_parallel = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"
    )
    assert keras_mgpu.num_replicas_in_sync(model_parallel) == 2
    assert keras_mgpu.distribute.strategy_kind(model_parallel) == (
        "model_parallel"
    )
    # Without `batch_dim_name`, Keras splits the batch along the mesh's
    # first axis, whatever its name.
    only_model = keras.distribution.DeviceMesh((4,), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(only_model)
    implicit = keras.distribution.ModelParallel(layout_map=layout_map)
    assert keras_mgpu.num_replicas_in_sync(implicit) == 4


def test_worker_info_of_one_process():
    info = keras_mgpu.distribute.worker_info()
    assert info["rank"] == 0 and info["num_workers"] == 1
    assert info["is_chief"] and info["task_name"] == "local"
    assert not keras_mgpu.distribute.is_multi_worker()


def _components(tmp_path):
    """Each public component, built as a user builds it."""
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.BatchNormalization()]
        + [keras.layers.Dense(4)]
    )
    data = (np.zeros((8, 4), "float32"), np.zeros((8, 4), "float32"))
    return {
        "GradientAccumulationOptimizer": lambda: (
            keras_mgpu.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1), 2
            )
        ),
        "Warmup": lambda: keras_mgpu.Warmup(0.1, 2),
        "RecomputeGrad": lambda: keras_mgpu.RecomputeGrad(
            keras.layers.Dense(2)
        ),
        "apply_recompute": lambda: keras_mgpu.apply_recompute(model),
        "strip_recompute": lambda: keras_mgpu.strip_recompute(model),
        "LearningRateScaler": lambda: keras_mgpu.callbacks.LearningRateScaler(
            256, batch_size=32
        ),
        "LearningRateWarmup": lambda: keras_mgpu.callbacks.LearningRateWarmup(
            warmup_steps=2
        ),
        "MemoryMonitor": lambda: keras_mgpu.callbacks.MemoryMonitor(),
        "GPULoadMonitor": lambda: keras_mgpu.callbacks.GPULoadMonitor(),
        "BackupAndRestore": lambda: keras_mgpu.callbacks.BackupAndRestore(
            str(tmp_path)
        ),
        "find_batch_size": lambda: keras_mgpu.find_batch_size(
            model, data, memory_budget_mb=64
        ),
        "configure_batch": lambda: keras_mgpu.configure_batch(
            model, data, 64, memory_budget_mb=64
        ),
        "use_window_statistics": lambda: (
            keras_mgpu.normalization.use_window_statistics(model, window=2)
        ),
        "synchronize_batchnorm": lambda: (
            keras_mgpu.normalization.synchronize_batchnorm(model)
        ),
        "freeze_batchnorm": lambda: keras_mgpu.normalization.freeze_batchnorm(
            model
        ),
        "convert_batchnorm_to_groupnorm": lambda: (
            keras_mgpu.normalization.convert_batchnorm_to_groupnorm(model)
        ),
        "WorkerWatchdog": lambda: keras_mgpu.callbacks.WorkerWatchdog(),
        "StragglerMonitor": lambda: keras_mgpu.callbacks.StragglerMonitor(),
        "PowerSGD": lambda: keras_mgpu.compression.PowerSGD(),
        "apply_placement": lambda: keras_mgpu.apply_placement(model),
    }


@pytest.mark.parametrize("other", ["torch", "numpy", "openvino"])
def test_components_refuse_other_backends(other, tmp_path, monkeypatch):
    """On Keras's other backends every component refuses at construction,
    naming the backend and the supported ones (the backend is faked: only
    JAX and TensorFlow are installed for the suite)."""
    monkeypatch.setattr(keras_mgpu.backend, "backend", lambda: other)
    for name, build in _components(tmp_path).items():
        with pytest.raises(BackendNotSupportedError) as error:
            build()
        message = str(error.value)
        assert f"{other!r} backend" in message, (name, message)
        assert "'tensorflow'" in message, (name, message)
