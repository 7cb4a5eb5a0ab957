"""The private Keras hooks behind `enable_multi_worker_fit()`.

Everything that touches Keras internals for multi-worker `fit` is here, read
from `keras/src/backend/tensorflow/trainer.py` of Keras 3.10-3.15 (unchanged
on Keras's main branch, 2026-11): `TensorFlowTrainer._maybe_symbolic_build`,
`TensorFlowTrainer.fit` / `evaluate` / `predict`, the module function
`reduce_per_replica` and `TFEpochIterator.__init__`. Each replacement calls
Keras's original unless the model's strategy is a multi-worker
`MultiWorkerMirroredStrategy`. `install()` returns the originals;
`uninstall(originals)` puts them back.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import threading
import warnings
from typing import Any

from keras_mgpu.distribute.multi_worker_fit import MultiWorkerFitWarning
from keras_mgpu.distribute.strategy import is_multi_worker

_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
_METHODS = ("_maybe_symbolic_build", "fit", "evaluate", "predict")
_STATE = threading.local()


def _trainer_module() -> Any:
    import importlib

    return importlib.import_module(_TRAINER_MODULE)


def install() -> dict[str, Any]:
    """Replace the Keras functions; return the originals by name."""
    module = _trainer_module()
    trainer = module.TensorFlowTrainer
    originals: dict[str, Any] = {
        f"TensorFlowTrainer.{name}": trainer.__dict__[name] for name in _METHODS
    }
    originals["reduce_per_replica"] = module.reduce_per_replica
    originals["TFEpochIterator.__init__"] = module.TFEpochIterator.__init__

    trainer._maybe_symbolic_build = _symbolic_build_from_local_replica(
        originals["TensorFlowTrainer._maybe_symbolic_build"]
    )
    for name in ("fit", "evaluate", "predict"):
        setattr(
            trainer,
            name,
            _checked_entry(originals[f"TensorFlowTrainer.{name}"], name),
        )
    module.reduce_per_replica = _mean_over_replicas(
        originals["reduce_per_replica"]
    )
    module.TFEpochIterator.__init__ = _shared_shuffle_seed(
        originals["TFEpochIterator.__init__"]
    )
    return originals


def uninstall(originals: dict[str, Any]) -> None:
    module = _trainer_module()
    for name in _METHODS:
        setattr(
            module.TensorFlowTrainer,
            name,
            originals[f"TensorFlowTrainer.{name}"],
        )
    module.reduce_per_replica = originals["reduce_per_replica"]
    module.TFEpochIterator.__init__ = originals["TFEpochIterator.__init__"]


def _mark(replacement: Any, original: Any) -> Any:
    replacement.__wrapped__ = original
    replacement.__doc__ = original.__doc__
    replacement.__name__ = original.__name__
    replacement.keras_mgpu_multi_worker_fit = True
    return replacement


# ----------------------------------------------------------------------
# The two fixes of keras#20585
# ----------------------------------------------------------------------
def _symbolic_build_from_local_replica(original: Any) -> Any:
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if (
            iterator is None
            or strategy is None
            or not is_multi_worker(strategy)
        ):
            return original(self, iterator=iterator, data_batch=data_batch)
        import tensorflow as tf
        from keras import tree

        if getattr(_STATE, "training_iterator_pending", False):
            _STATE.training_iterator_pending = False
            _warn_partial_batch(iterator)
        batch = None
        for _, _, distributed_iterator in iterator:
            batch = next(distributed_iterator)
            break
        # Shapes and dtypes are all the build needs: one local replica's
        # values give them without a collective over the data.
        local = tree.map_structure(
            lambda v: (
                strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v
            ),
            batch,
        )
        return original(self, iterator=None, data_batch=local)

    return _mark(_maybe_symbolic_build, original)


def _mean_over_replicas(original: Any) -> Any:
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
            return original(values, strategy, reduction)
        from keras import tree

        # Keras 3.15 passes axis=0 here, which fails on scalars; the mean
        # over replicas (every worker's) is axis=None.
        return tree.map_structure(
            lambda v: strategy.reduce("MEAN", v, axis=None), values
        )

    return _mark(reduce_per_replica, original)


# ----------------------------------------------------------------------
# Shuffling arrays: one seed for every worker
# ----------------------------------------------------------------------
def _shared_shuffle_seed(original: Any) -> Any:
    def __init__(self, distribute_strategy=None, *args, **kwargs):
        if not _shuffles_arrays(distribute_strategy, args, kwargs):
            return original(self, distribute_strategy, *args, **kwargs)
        seed = shared_seed(distribute_strategy)
        with _graph_seed(seed):
            return original(self, distribute_strategy, *args, **kwargs)

    return _mark(__init__, original)


def _shuffles_arrays(strategy: Any, args: tuple, kwargs: dict) -> bool:
    """Whether Keras will shuffle in-memory arrays for this iterator."""
    if strategy is None or not is_multi_worker(strategy):
        return False
    # EpochIterator(x, y, sample_weight, batch_size, steps_per_epoch,
    # shuffle, ...): Keras passes them by keyword.
    shuffle = kwargs.get("shuffle", args[5] if len(args) > 5 else False)
    if not shuffle:
        return False
    from keras.src.trainers.data_adapters import array_data_adapter

    x = kwargs.get("x", args[0] if args else None)
    y = kwargs.get("y", args[1] if len(args) > 1 else None)
    weights = kwargs.get("sample_weight", args[2] if len(args) > 2 else None)
    return bool(array_data_adapter.can_convert_arrays((x, y, weights)))


def shared_seed(strategy: Any) -> int:
    """A seed drawn on the chief and sent to every worker (one all-reduce).

    The chief's seed follows its global TensorFlow seed when one is set, so
    a seeded run stays reproducible; otherwise it is random.
    """
    import numpy as np
    from tensorflow.python.eager import context

    from keras_mgpu.distribute.collectives import sum_over_workers
    from keras_mgpu.distribute.strategy import worker_info

    info = worker_info(strategy)
    row = np.zeros((int(info["num_workers"]), 1), dtype=np.float64)
    if info["is_chief"]:
        base = context.global_seed()
        rng = random.Random(base) if base is not None else random.SystemRandom()
        # Below 2**31: exact in float64 and a valid TensorFlow seed.
        row[int(info["task_id"] or 0), 0] = rng.randrange(1, 2**31 - 1)
    return int(sum_over_workers(strategy, row).sum())


@contextlib.contextmanager
def _graph_seed(seed: int) -> Any:
    """The global TensorFlow seed is `seed` while Keras builds its dataset.

    The dataset's shuffle ops take their seeds from the graph seed at
    construction (`FuncGraph.seed = context.global_seed()`). The eager
    context's private `_seed` / `_rng` (TF 2.16-2.21) are set and restored
    directly: `tf.random.set_seed` would also clear the kernel cache and
    restart the user's own random streams.
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    saved = (ctx._seed, ctx.__dict__.get("_rng"))
    ctx._seed, ctx._rng = seed, random.Random(seed)
    try:
        yield
    finally:
        ctx._seed = saved[0]
        if saved[1] is None:
            ctx.__dict__.pop("_rng", None)
        else:
            ctx._rng = saved[1]


# ----------------------------------------------------------------------
# Checks at fit / evaluate / predict
# ----------------------------------------------------------------------
def _checked_entry(original: Any, name: str) -> Any:
    signature = inspect.signature(original)

    def entry(self, *args, **kwargs):
        if not is_multi_worker(self.distribute_strategy):
            return original(self, *args, **kwargs)
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        _check_steps_per_execution(self, name)
        if name == "fit":
            _check_callbacks(arguments.get("callbacks"))
            _STATE.training_iterator_pending = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _STATE.training_iterator_pending = False

    return _mark(entry, original)


def _check_steps_per_execution(model: Any, name: str) -> None:
    steps = int(getattr(model, "steps_per_execution", 1) or 1)
    if steps > 1 and name != "predict":
        raise ValueError(
            f"`model.{name}` with steps_per_execution={steps} under "
            "MultiWorkerMirroredStrategy fails in Keras itself ('You must "
            "feed a value for placeholder', keras-team/keras#19246: "
            "TensorFlow assigns collective keys at call time, and Keras runs "
            "its step inside a tf.while_loop). Compile with "
            "steps_per_execution=1. (TensorFlow's trace-time keys would run, "
            "but silently pair the wrong collectives if workers retrace at "
            "different times, so keras_mgpu does not switch them on.)"
        )


def _check_callbacks(callbacks: Any) -> None:
    import keras

    items = getattr(callbacks, "callbacks", callbacks) or []
    for callback in items:
        if type(callback) is keras.callbacks.BackupAndRestore:
            raise ValueError(
                "keras.callbacks.BackupAndRestore is not multi-worker safe in "
                f"Keras {keras.version()}: every worker creates and writes "
                "the same backup_dir (FileExistsError at on_train_begin, or "
                "a corrupt backup). Use keras_mgpu.callbacks."
                "BackupAndRestore(backup_dir, ...), a drop-in with the same "
                "arguments that keeps the chief's backup authoritative."
            )


def _warn_partial_batch(epoch_iterator: Any) -> None:
    adapter = getattr(epoch_iterator, "data_adapter", None)
    if adapter is None or not getattr(adapter, "has_partial_batch", False):
        return
    if getattr(epoch_iterator, "steps_per_epoch", None):
        return  # a fixed number of steps: the partial batch may never come
    warnings.warn(
        f"The training data end in a partial batch of "
        f"{adapter.partial_batch_size} samples (batch_size="
        f"{adapter.batch_size}). Keras averages each replica's mean loss, so "
        "that batch's samples are weighted per replica rather than per "
        "sample: the update differs from one process on the same batch "
        "(a Keras behaviour, under MirroredStrategy too). Use a batch_size "
        "that divides the number of samples, or a tf.data.Dataset batched "
        "with drop_remainder=True.",
        MultiWorkerFitWarning,
        stacklevel=4,
    )
