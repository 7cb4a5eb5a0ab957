"""Every public callback of ours, with default arguments, keeps Keras's
asynchronous batch dispatch, reads no `logs` value per batch (both
backends), and adds no device-to-host transfer per step beyond plain
Keras's (JAX, where the transfers are counted). The callbacks come from
`keras_mgpu.callbacks.__all__`, so a new one is covered at once (give it
arguments in `REQUIRED_ARGUMENTS` when it has required ones).

What Keras does (3.15, `keras/src/callbacks/callback_list.py`): a
`CallbackList` dispatches `on_train_batch_end` on a thread pool
(`_async_train`) unless a callback overrides `on_train_batch_end` /
`on_batch_end` without declaring `async_safe = True`; begin hooks do not
count. On TensorFlow Keras never dispatches asynchronously
(`backend.IS_THREAD_SAFE` is False), so there the rule is evaluated as JAX
evaluates it (the same code, with the flag on while the list is built).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import keras
import numpy as np
import pytest

import keras_mgpu.callbacks as ours

STEPS = 4
BATCH = 8

pytestmark = pytest.mark.backends("tensorflow", "jax")


def _arguments(tmp_path) -> dict[str, dict]:
    """Minimal required arguments; every other argument is the default."""
    return {
        "BackupAndRestore": {"backup_dir": str(tmp_path / "backup")},
        "LearningRateScaler": {"base_batch_size": BATCH, "batch_size": BATCH},
        "LearningRateWarmup": {"warmup_steps": 2},
    }


# Callbacks that cannot be built in a Keras 3 `fit` here, with the reason;
# their class is still checked (no end hook, or `async_safe`).
NOT_BUILT = {
    "PruningStepSync": "needs TFMOT pruning wrappers (a tf_keras model)",
}


def public_callbacks() -> list[str]:
    return sorted(ours.__all__)


def _model() -> keras.Model:
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    return x, x[:, :1].copy()


def _overrides_batch_end(callback: Any) -> bool:
    from keras.src import utils

    return not (
        utils.is_default(callback.on_train_batch_end)
        and utils.is_default(callback.on_batch_end)
    )


@contextlib.contextmanager
def _thread_safe_backend():
    """Keras's rule as JAX runs it: TensorFlow's `IS_THREAD_SAFE` is False,
    which turns async dispatch off for every callback list."""
    from keras.src import backend

    saved = backend.IS_THREAD_SAFE
    backend.IS_THREAD_SAFE = True
    try:
        yield
    finally:
        backend.IS_THREAD_SAFE = saved


class _EpochCount(keras.callbacks.Callback):
    """Reads a transfer counter at an epoch boundary (begin hooks and
    epoch hooks only: it never affects the dispatch)."""

    def __init__(self, counter, when: str) -> None:
        super().__init__()
        self.counter, self.when, self.values = counter, when, []

    def on_epoch_begin(self, epoch, logs=None):
        if self.when == "begin":
            self.values.append(self.counter())

    def on_epoch_end(self, epoch, logs=None):
        if self.when == "end":
            self.values.append(self.counter())


class _LogsSpy(dict):
    """`logs` that records whether a hook read a value."""

    reads = 0

    def _read(self):
        type(self).reads += 1

    def __getitem__(self, key):
        self._read()
        return super().__getitem__(key)

    def get(self, *args):
        self._read()
        return super().get(*args)

    def items(self):
        self._read()
        return super().items()

    def values(self):
        self._read()
        return super().values()


def _spy_on_batch_hooks(callback: Any) -> None:
    """Hand every batch hook a `_LogsSpy` (set after the list decided its
    dispatch: instance attributes would count as overrides)."""
    for hook in (
        "on_train_batch_begin",
        "on_train_batch_end",
        "on_batch_begin",
        "on_batch_end",
    ):
        original = getattr(callback, hook)

        def spied(batch, logs=None, _original=original):
            return _original(batch, _LogsSpy(logs or {}))

        object.__setattr__(callback, hook, spied)


def _fit(model, callbacks: list, epochs: int = 2):
    x, y = _data()
    callback_list = keras.callbacks.CallbackList(
        callbacks,
        add_history=True,
        model=model,
        verbose=0,
        epochs=epochs,
        steps=STEPS,
    )
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callback_list,
    )
    return callback_list


def check_async_dispatch(name: str, tmp_path) -> None:
    """`name`, built with default arguments, keeps `_async_train` True and
    reads no `logs` value in its batch hooks during a real `fit`."""
    cls = getattr(ours, name)
    if name in NOT_BUILT:
        assert not _overrides_batch_end_class(cls) or getattr(
            cls, "async_safe", False
        ), f"{name} overrides a batch end hook without async_safe"
        pytest.skip(f"{name}: class checked only ({NOT_BUILT[name]})")
    callback = cls(**_arguments(tmp_path).get(name, {}))
    with _thread_safe_backend():
        probe = keras.callbacks.CallbackList([callback])
    assert probe._async_train, (
        f"{name}() with default arguments switches off Keras's asynchronous "
        "batch dispatch (overrides on_train_batch_end/on_batch_end: "
        f"{_overrides_batch_end(callback)}, async_safe: "
        f"{getattr(callback, 'async_safe', False)})"
    )
    _LogsSpy.reads = 0
    _spy_on_batch_hooks(callback)
    _fit(_model(), [callback])
    assert _LogsSpy.reads == 0, f"{name}'s batch hooks read `logs` values"


def _overrides_batch_end_class(cls: type) -> bool:
    base = keras.callbacks.Callback
    return any(
        getattr(cls, hook) is not getattr(base, hook)
        for hook in ("on_train_batch_end", "on_batch_end")
    )


@contextlib.contextmanager
def count_device_to_host():
    """JAX: count reads of a `jax.Array`'s value on the host.

    Two doors, both counted: `ArrayImpl._value` (`float()`, `.item()`,
    `.tolist()`, `jax.device_get`, and `np.asarray` off CPU), and
    `np.array` / `np.asarray` of a `jax.Array` (Keras's `convert_to_numpy`
    and `pythonify_logs`). On CPU numpy reads a `jax.Array` through the
    buffer protocol and JAX's transfer guard sees nothing (measured, jax
    0.10), hence the numpy functions are wrapped rather than relying on it.
    """
    import jax
    from jax._src.array import ArrayImpl

    fetch = ArrayImpl.__dict__["_value"].fget
    lock = threading.Lock()
    total = [0]
    depth = threading.local()

    def count():
        if getattr(depth, "n", 0) == 0:  # one read, however it nests
            with lock:
                total[0] += 1

    def counting_value(self):
        if self._npy_value is None:
            count()
        depth.n = getattr(depth, "n", 0) + 1
        try:
            return fetch(self)
        finally:
            depth.n -= 1

    def wrap(function):
        def counting(value, *args, **kwargs):
            if isinstance(value, jax.Array):
                count()
                depth.n = getattr(depth, "n", 0) + 1
                try:
                    return function(value, *args, **kwargs)
                finally:
                    depth.n -= 1
            return function(value, *args, **kwargs)

        return counting

    saved = np.array, np.asarray
    ArrayImpl._value = property(counting_value)
    np.array, np.asarray = wrap(np.array), wrap(np.asarray)
    try:
        yield lambda: total[0]
    finally:
        ArrayImpl._value = property(fetch)
        np.array, np.asarray = saved


def transfers_in_second_epoch(callbacks: list, counter) -> int:
    """Device-to-host fetches between epoch 2's first and last batch hook
    (the epoch boundaries' own hooks are left out: they are per epoch)."""
    begin = _EpochCount(counter, "begin")  # last: after others' epoch begin
    end = _EpochCount(counter, "end")  # first: before others' epoch end
    _fit(_model(), [end, *callbacks, begin])
    return end.values[1] - begin.values[1]


def check_no_transfer_per_step(name: str, tmp_path) -> None:
    """JAX: a `fit` with `name` fetches no more device values per epoch
    than a plain `fit` of the same steps."""
    if name in NOT_BUILT:
        pytest.skip(f"{name}: {NOT_BUILT[name]}")
    cls = getattr(ours, name)
    with count_device_to_host() as counter:
        plain = transfers_in_second_epoch([], counter)
        callback = cls(**_arguments(tmp_path).get(name, {}))
        with_callback = transfers_in_second_epoch([callback], counter)
    assert plain > 0, "the counter saw none of plain Keras's log fetches"
    assert with_callback <= plain, (
        f"{name}: {with_callback} device-to-host fetches in an epoch of "
        f"{STEPS} steps, plain Keras {plain}"
    )


@pytest.mark.parametrize("name", public_callbacks())
def test_keeps_async_dispatch(name, tmp_path):
    check_async_dispatch(name, tmp_path)


# The counter wraps `jax.Array` reads: a JAX-only measurement.
@pytest.mark.backends("jax")
@pytest.mark.parametrize("name", public_callbacks())
def test_no_device_to_host_transfer_per_step(name, tmp_path):
    check_no_transfer_per_step(name, tmp_path)
