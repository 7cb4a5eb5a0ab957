"""`assert_trains_like`: a model trains to the same weights under a
strategy (TensorFlow) or a `keras.distribution` (JAX) as without one."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np


def assert_trains_like(
    model_fn: Callable[[], Any],
    data: tuple,
    strategy: Any,
    reference: Any = "default",
    *,
    steps: int = 4,
    batch_size: int | None = None,
    epochs: int = 1,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
) -> dict[str, float]:
    """Check that `model_fn()`'s model trains to the same weights under
    `strategy` as under `reference` (no distribution by default).

    Builds the model twice (in each strategy's scope, seeded alike), gives
    the second the first's initial weights, trains both with
    `fit(x, y, batch_size, shuffle=False)` for `steps` steps per epoch, and
    compares every weight with `np.testing.assert_allclose`. `batch_size` is
    the *global* batch: the strategy splits it over its replicas, so the
    reference sees the same examples per update. This is the check behind
    keras_mgpu's own equivalence claims (accumulation, recompute, placement
    against the plain computation), for your models, losses and
    `train_step`s.

    TensorFlow: `strategy` is a `tf.distribute.Strategy`; the models are
    built in its scope and `fit` runs outside it (Keras remembers the
    strategy). JAX: `strategy` is a `keras.distribution.Distribution`
    (`DataParallel`, `ModelParallel`, ...); the models are built *and*
    trained inside `strategy.scope()` (the variables' layouts are fixed at
    creation, and `fit` splits the batch by the distribution in force), the
    reference without a distribution. Either: a matrix name
    (`"data_parallel_2"`, `"mirrored_2"`, see `make_strategy`).

    Args:
        model_fn: builds and compiles the model; called inside each
            strategy's scope.
        data: `(x, y)` (or `(x, y, sample_weight)`) NumPy arrays.
        strategy: the `tf.distribute.Strategy` or
            `keras.distribution.Distribution` under test, or a matrix name.
        reference: "default" (no strategy or distribution), another
            strategy/distribution, or a matrix name.
        steps: int >= 1, steps per epoch.
        batch_size: int or None, the global batch; defaults to
            `len(x) // steps`.
        epochs: int >= 1. Defaults to 1.
        rtol: float, relative tolerance. Defaults to 1e-5.
        atol: float, absolute tolerance. Defaults to 1e-6.
        seed: int, seed of both builds. Defaults to 0.

    Returns:
        `{weight path: max abs difference}` for every weight.

    Raises:
        AssertionError: a weight differs beyond the tolerance (the message
            names it and the largest difference).

    Example:

    ```python
    def test_my_model_trains_like_one_device(strategy):  # the plugin's
        x, y = np.random.rand(64, 8), np.random.rand(64, 1)
        keras_mgpu.testing.assert_trains_like(build_my_model, (x, y),
                                              strategy, steps=4)
    ```
    """
    from keras_mgpu.testing.strategies import (
        describe,
        make_strategy,
        running_backend,
    )

    for name, value in (("steps", steps), ("epochs", epochs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"Argument `{name}` must be an integer >= 1. "
                f"Received: {name}={value!r}"
            )
    if not isinstance(data, (tuple, list)) or not 2 <= len(data) <= 3:
        raise ValueError(
            "Argument `data` must be a tuple (x, y) or (x, y, sample_weight)"
            f" of arrays. Received: data of type {type(data).__name__}"
        )
    if isinstance(strategy, str):
        strategy = make_strategy(strategy)
    if isinstance(reference, str):
        reference = make_strategy(reference)
    train = _train_jax if running_backend() == "jax" else _train
    batch_size = batch_size or max(len(data[0]) // steps, 1)
    expected = train(
        model_fn, data, reference, None, batch_size, steps, epochs, seed
    )
    actual = train(
        model_fn,
        data,
        strategy,
        expected["initial"],
        batch_size,
        steps,
        epochs,
        seed,
    )
    differences = {}
    for path, want, got in zip(
        expected["paths"], expected["weights"], actual["weights"]
    ):
        differences[path] = float(np.max(np.abs(want - got), initial=0.0))
        np.testing.assert_allclose(
            got,
            want,
            rtol=rtol,
            atol=atol,
            err_msg=(
                f"weight {path!r} after training under "
                f"{describe(strategy)} differs from "
                f"{describe(reference)} (max abs difference "
                f"{differences[path]:.3g})"
            ),
        )
    return differences


def _train(
    model_fn, data, strategy, initial, batch_size, steps, epochs, seed
) -> dict:
    import tensorflow as tf

    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)
    with strategy.scope():
        model = model_fn()
    return _fit(model, initial, data, batch_size, steps, epochs)


def _train_jax(
    model_fn, data, distribution, initial, batch_size, steps, epochs, seed
) -> dict:
    """`_train` for a `keras.distribution`: build and fit in its scope."""
    from keras_mgpu.testing.seeds import set_random_seed

    set_random_seed(seed)
    with distribution.scope():
        model = model_fn()
        return _fit(model, initial, data, batch_size, steps, epochs)


def _fit(model, initial, data, batch_size, steps, epochs) -> dict:
    """Both backends' `_train` once the model is built: start from
    `initial` (when given), `fit` on `data` = `(x, y[, sample_weight])` in
    order (no shuffle); the weights before and after, and their paths."""
    if initial is not None:
        model.set_weights(initial)
    start = [np.array(w) for w in model.get_weights()]
    model.fit(
        data[0],
        data[1],
        sample_weight=data[2] if len(data) > 2 else None,
        batch_size=batch_size,
        steps_per_epoch=steps,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return {
        "initial": start,
        "weights": [np.array(w) for w in model.get_weights()],
        # tf_keras's variables have no `path`.
        "paths": [getattr(w, "path", w.name) for w in model.weights],
    }
