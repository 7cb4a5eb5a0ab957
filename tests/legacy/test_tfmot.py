"""TensorFlow Model Optimization (pruning, QAT) with keras_mgpu under
MirroredStrategy (tf_keras flavour).

Pruning with gradient accumulation is compared with pruning at the large
batch on one device: with `PruningStepSync` the pruning schedule counts
optimizer updates, so masks, sparsity and weights match.
"""

from __future__ import annotations

import numpy as np
import pytest
from _training import assert_weights_close, mlp, regression_data
from conftest import make_strategy

from keras_mgpu._flavour import keras, tf
from keras_mgpu.callbacks import (
    GPULoadMonitor,
    LearningRateWarmup,
    MemoryMonitor,
)
from keras_mgpu.callbacks.pruning_step_sync import (
    PruningStepSync,
    _prune_low_magnitude_class,
)
from keras_mgpu.layers import RecomputeGrad, strip_recompute
from keras_mgpu.optimizers import GradientAccumulationOptimizer
from keras_mgpu.schedules import Warmup

tfmot = pytest.importorskip("tensorflow_model_optimization")
sparsity = tfmot.sparsity.keras

ACCUMULATION = 3
MICRO_BATCH = 8
UPDATES = 4
TARGET_SPARSITY = 0.75
X, Y = regression_data(ACCUMULATION * MICRO_BATCH * UPDATES)


def _schedule():
    # Reaches the target at update 3 of 4, counting in optimizer updates.
    return sparsity.PolynomialDecay(
        0.0, TARGET_SPARSITY, begin_step=0, end_step=UPDATES - 1, frequency=1
    )


def _mask_sparsity(layers) -> float:
    masks = [layer.pruning_vars[0][1].numpy() for layer in layers]
    return float(np.mean([np.mean(m == 0) for m in masks]))


def _prunable(model) -> list:
    wrapper = _prune_low_magnitude_class()
    return [m for m in model.submodules if isinstance(m, wrapper)]


class _Recorder(keras.callbacks.Callback):
    """Pruning step and mask sparsity seen after each batch."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list = []
        self.sparsity: list = []

    def on_train_batch_end(self, batch, logs=None):
        layers = _prunable(self.model)
        self.steps.append(int(layers[0].pruning_step.numpy()))
        self.sparsity.append(_mask_sparsity(layers))


def _monitors() -> list:
    return [MemoryMonitor(warn_fraction=None), GPULoadMonitor(interval=0.05)]


def _assert_monitor_logs(history) -> None:
    keys = set(history.history)
    assert any(k.startswith("mem/") for k in keys), keys
    assert any(k.startswith(("gpu/", "cpu/")) for k in keys), keys


@pytest.fixture(scope="module")
def large_batch_pruning():
    """Pruning at batch K·b on one device with TFMOT's own callback and the
    keras_mgpu Warmup schedule: the reference."""
    keras.utils.set_random_seed(1234)
    model = sparsity.prune_low_magnitude(mlp(), pruning_schedule=_schedule())
    model.compile(
        keras.optimizers.SGD(Warmup(0.05, warmup_steps=2), momentum=0.9),
        loss="mse",
    )
    recorder = _Recorder()
    model.fit(
        X,
        Y,
        batch_size=MICRO_BATCH * ACCUMULATION,
        shuffle=False,
        verbose=0,
        callbacks=[sparsity.UpdatePruningStep(), recorder],
    )
    return model.get_weights(), recorder


def test_pruning_with_accumulation_warmup_and_monitors(large_batch_pruning):
    reference_weights, reference = large_batch_pruning
    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        model = sparsity.prune_low_magnitude(
            mlp(), pruning_schedule=_schedule()
        )
        model.compile(
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.05, momentum=0.9), ACCUMULATION
            ),
            loss="mse",
        )
    recorder = _Recorder()
    history = model.fit(
        X,
        Y,
        batch_size=MICRO_BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[
            PruningStepSync(),
            LearningRateWarmup(warmup_steps=2),
            *_monitors(),
            recorder,
        ],
    )
    # One pruning step per optimizer update, not per micro-batch.
    assert recorder.steps == [
        u + 1 for u in range(UPDATES) for _ in range(ACCUMULATION)
    ]
    assert reference.steps == list(range(1, UPDATES + 1))
    # The masks after each window are those of the large-batch run.
    window_ends = recorder.sparsity[ACCUMULATION - 1 :: ACCUMULATION]
    np.testing.assert_allclose(window_ends, reference.sparsity)
    assert window_ends[-1] == pytest.approx(TARGET_SPARSITY, abs=0.01)
    assert_weights_close(model.get_weights(), reference_weights)
    assert int(model.optimizer.iterations.numpy()) == UPDATES
    _assert_monitor_logs(history)

    stripped = sparsity.strip_pruning(model)
    assert not _prunable(stripped)
    kernels = [
        layer.kernel.numpy()
        for layer in stripped.layers
        if isinstance(layer, keras.layers.Dense)
    ]
    for kernel in kernels:
        assert np.mean(kernel == 0) == pytest.approx(TARGET_SPARSITY, abs=0.02)
    np.testing.assert_allclose(
        stripped.predict(X[:16], verbose=0),
        model.predict(X[:16], verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_quantization_aware_training_with_accumulation():
    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        model = tfmot.quantization.keras.quantize_model(mlp())
        model.compile(
            GradientAccumulationOptimizer(
                keras.optimizers.Adam(0.01), ACCUMULATION
            ),
            loss="mse",
        )
    history = model.fit(
        X,
        Y,
        batch_size=MICRO_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[LearningRateWarmup(warmup_steps=2), *_monitors()],
    )
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[1] < losses[0]
    assert int(model.optimizer.iterations.numpy()) == 2 * UPDATES
    assert int(model.optimizer.pending_steps.numpy()) == 0
    _assert_monitor_logs(history)


@pytest.fixture(scope="module")
def pruned_recompute_run():
    """A pruned Dense pair inside a RecomputeGrad block, under Mirrored ×2
    with accumulation; mask sparsity recorded after each batch."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(1234)
    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        block = keras.Sequential(
            [
                sparsity.prune_low_magnitude(
                    keras.layers.Dense(16, activation="tanh"),
                    pruning_schedule=_schedule(),
                ),
                sparsity.prune_low_magnitude(
                    keras.layers.Dense(16, activation="tanh"),
                    pruning_schedule=_schedule(),
                ),
            ],
            name="block",
        )
        inputs = keras.Input((X.shape[1],))
        outputs = keras.layers.Dense(1)(RecomputeGrad(block)(inputs))
        model = keras.Model(inputs, outputs)
        model.compile(
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.05, momentum=0.9), ACCUMULATION
            ),
            loss="mse",
        )
    sync, recorder = PruningStepSync(), _Recorder()
    model.fit(
        X,
        Y,
        batch_size=MICRO_BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[sync, recorder],
    )
    return model, sync, recorder


def test_recompute_block_inside_pruned_model_prunes(pruned_recompute_run):
    model, sync, recorder = pruned_recompute_run
    # TFMOT's UpdatePruningStep does not look inside wrappers; ours does.
    assert len(sync.prunable_layers) == 2
    assert recorder.sparsity[-1] == pytest.approx(TARGET_SPARSITY, abs=0.01)
    for layer in sync.prunable_layers:
        # Re-masked at the epoch end: the kernel itself is sparse.
        kernel = layer.layer.kernel.numpy()
        assert np.mean(kernel == 0) == pytest.approx(TARGET_SPARSITY, abs=0.02)
        np.testing.assert_array_equal(
            kernel == 0, layer.pruning_vars[0][1] == 0
        )


def test_strip_recompute_then_strip_pruning(pruned_recompute_run):
    model, _, _ = pruned_recompute_run
    # Cloning a TFMOT layer from its config needs TFMOT's custom objects.
    with sparsity.prune_scope():
        plain = strip_recompute(model)
    stripped = sparsity.strip_pruning(plain)
    assert not _prunable(stripped)
    for layer in stripped.get_layer("block").layers:
        assert np.mean(layer.kernel.numpy() == 0) == pytest.approx(
            TARGET_SPARSITY, abs=0.02
        )
    np.testing.assert_allclose(
        stripped.predict(X[:16], verbose=0),
        model.predict(X[:16], verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_recompute_block_follows_the_pruning_schedule(pruned_recompute_run):
    _, _, recorder = pruned_recompute_run
    expected = [
        _schedule()(tf.constant(u + 1, tf.int64))[1].numpy()
        for u in range(UPDATES)
    ]
    window_ends = recorder.sparsity[ACCUMULATION - 1 : ACCUMULATION * UPDATES]
    np.testing.assert_allclose(window_ends[::ACCUMULATION], expected, atol=0.02)


def test_pruning_step_sync_rejects_steps_per_execution():
    model = sparsity.prune_low_magnitude(mlp(), pruning_schedule=_schedule())
    model.compile("sgd", loss="mse", steps_per_execution=2)
    with pytest.raises(
        ValueError,
        match=r"needs `steps_per_execution=1`.*Received: "
        r"steps_per_execution=2",
    ):
        model.fit(X, Y, batch_size=8, verbose=0, callbacks=[PruningStepSync()])


def test_pruning_step_sync_without_pruned_layers_does_nothing():
    model = mlp()
    model.compile("sgd", loss="mse")
    sync = PruningStepSync()
    model.fit(X[:16], Y[:16], batch_size=8, verbose=0, callbacks=[sync])
    assert sync.prunable_layers == []
