"""Limits of Keras itself on the JAX backend that shape our speed figures:
each test passes while the limit holds and fails once Keras fixes it (then
the row of docs/compatibility.md and the benchmarks page change)."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from jax import monitoring

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _CompileMarks(keras.callbacks.Callback):
    """The number of XLA compilations so far at each batch's begin (the
    train step compiles while its batch is dispatched, before the next
    batch begins)."""

    def __init__(self, counter: list) -> None:
        super().__init__()
        self.counter = counter
        self.marks: list[tuple[int, int, int]] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.marks.append((self.epoch, batch, len(self.counter)))

    def compiles_inside_steps(self) -> list[tuple[int, int]]:
        """(epoch, batch) of each step during which something compiled
        (from one batch's begin to the next one's, in the same epoch)."""
        found = []
        for (epoch, batch, n), (next_epoch, _, m) in zip(
            self.marks, self.marks[1:]
        ):
            if epoch == next_epoch and m > n:
                found.append((epoch, batch))
        return found


@pytest.fixture
def compile_counter():
    counter: list = []

    def listener(name, seconds, **kwargs):
        if name == _COMPILE_EVENT:
            counter.append(seconds)

    monitoring.register_event_duration_secs_listener(listener)
    yield counter
    # JAX has no public way to remove one listener; this one only appends
    # to a list nobody reads after the test.


def _fit_three_epochs(counter, distribution) -> list[tuple[int, int]]:
    x = np.ones((64, 8), "float32")
    y = np.ones((64, 1), "float32")
    marks = _CompileMarks(counter)
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(distribution)
    try:
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)]
        )
        model.compile("adam", "mse")
        model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[marks])
    finally:
        keras.distribution.set_distribution(previous)
    return marks.compiles_inside_steps()


@pytest.mark.keras_limit
def test_data_parallel_on_one_device_recompiles_the_train_step(
    compile_counter,
):
    """Keras 3.15 on JAX, `DataParallel` over ONE device (the usual setup on
    a one-GPU machine, as in the H200 figures of the benchmarks page): the
    train step compiles at the first step, again at the second (the state
    comes back with a single-device sharding) and again at the first step
    of the next epoch (the state is read back from the variables). Without
    a distribution, and with DataParallel over 4 devices, it compiles once.
    A recompile of a BERT step inside an epoch adds its seconds to that
    epoch's time per step. Fails once Keras compiles the step once."""
    plain = _fit_three_epochs(compile_counter, None)
    assert plain == [(0, 0)]
    four = _fit_three_epochs(
        compile_counter,
        keras.distribution.DataParallel(devices=jax.devices()[:4]),
    )
    assert four == [(0, 0)]
    one = _fit_three_epochs(
        compile_counter,
        keras.distribution.DataParallel(devices=jax.devices()[:1]),
    )
    assert one == [(0, 0), (0, 1), (1, 0)]
