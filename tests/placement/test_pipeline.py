"""Pipelining with micro-batches: the same gradients as the un-pipelined
model, stages fed micro-batch by micro-batch, the documented caveats."""

from __future__ import annotations

import numpy as np
import pytest
from _placement_helpers import (
    CPUS,
    FEATURES,
    assert_grads_close,
    data,
    loss_and_grads,
    placed_nodes,
    stage_cuts,
    staged_mlp,
    transfers,
)

from keras_mgpu import _flavour
from keras_mgpu.normalization import BatchNormMicroBatchWarning
from keras_mgpu.placement import (
    PlacedModel,
    apply_placement,
    strip_placement,
)
from keras_mgpu.placement.apply_placement import micro_batches_of
from keras_mgpu.placement.pipeline import MicroBatchSplit, micro_batch_sizes

keras = _flavour.keras
tf = _flavour.tf


@pytest.mark.parametrize(
    "stages, micro_batches, batch",
    [(2, 2, 12), (2, 4, 10), (4, 4, 12), (4, 8, 13)],
)
def test_gradients_equal_the_unpipelined_model(stages, micro_batches, batch):
    model = staged_mlp(stages)
    placed = apply_placement(
        model,
        CPUS[:stages],
        policy=stage_cuts(model),
        micro_batches=micro_batches,
    )
    assert micro_batches_of(placed) == micro_batches
    x, y = data(batch)
    np.testing.assert_allclose(placed(x), model(x), rtol=1e-6, atol=1e-6)
    loss, grads = loss_and_grads(placed, tf.constant(x), y)
    expected_loss, expected = loss_and_grads(model, tf.constant(x), y)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert_grads_close(grads, expected)


@pytest.mark.slow
def test_pipelined_fit_equals_unplaced_and_each_micro_batch_crosses_once():
    model = staged_mlp(3)
    placed = apply_placement(
        model, CPUS[1:4], policy=stage_cuts(model), micro_batches=2
    )
    x, y = data(16)

    def fit(m):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    nodes = placed_nodes(lambda: fit(placed))
    fit(model)
    # Float rounding only (each weight gradient is a sum over micro-batches
    # instead of one matmul), Adam's normalisation included.
    for a, b in zip(placed.weights, model.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    stage = {f"/device:CPU:{i}": i - 1 for i in (1, 2, 3)}
    crossings = sorted(
        (stage[s], stage[t])
        for s, t, _ in transfers(nodes)
        if s in stage and t in stage
    )
    # Each micro-batch's activation forward, its gradient back.
    assert crossings == sorted([(0, 1), (1, 0), (1, 2), (2, 1)] * 2)


def test_micro_batch_sizes_differ_by_at_most_one():
    sizes = micro_batch_sizes(tf.constant(10), 4).numpy().tolist()
    assert sizes == [3, 3, 2, 2]
    assert micro_batch_sizes(tf.constant(3), 4).numpy().tolist() == [1, 1, 1, 0]


def test_a_training_batch_smaller_than_micro_batches_is_refused():
    model = staged_mlp(2)
    placed = apply_placement(model, CPUS[:2], micro_batches=4)
    x, y = data(3)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match="Argument `micro_batches` of the placed model is 4, so each "
        "training batch needs at least 4 examples",
    ):
        placed(x, training=True)
    # Inference: empty micro-batches are harmless.
    np.testing.assert_allclose(placed(x), model(x), rtol=1e-6, atol=1e-6)


def test_batch_normalization_sees_micro_batches():
    """The documented caveat: statistics per micro-batch, M updates per
    step (as under gradient accumulation)."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(4, name="d"),
            keras.layers.BatchNormalization(momentum=0.5, name="bn"),
        ]
    )
    with pytest.warns(BatchNormMicroBatchWarning, match="micro"):
        placed = apply_placement(model, CPUS[:2], micro_batches=2)
    x, _ = data(8)
    placed(x, training=True)
    hidden = model.get_layer("d")(x).numpy()
    expected = np.zeros(4)
    for half in (hidden[:4], hidden[4:]):
        expected = 0.5 * expected + 0.5 * half.mean(axis=0)
    bn = [layer for layer in placed.layers if isinstance(layer, keras.Model)][0]
    moving_mean = bn.get_layer("bn").layer.moving_mean.numpy()
    np.testing.assert_allclose(moving_mean, expected, rtol=1e-5, atol=1e-6)


def test_pipelined_model_round_trips_and_strips(tmp_path):
    model = staged_mlp(2)
    placed = apply_placement(model, CPUS[:2], micro_batches=3)
    assert (
        sum(isinstance(layer, MicroBatchSplit) for layer in placed.layers) == 1
    )
    path = str(tmp_path / "pipelined.keras")
    placed.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, PlacedModel) and micro_batches_of(loaded) == 3
    x, _ = data(9)
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6, atol=1e-6)
    plain = strip_placement(loaded)
    assert micro_batches_of(plain) == 1
    np.testing.assert_allclose(plain(x), model(x), rtol=1e-6, atol=1e-6)
