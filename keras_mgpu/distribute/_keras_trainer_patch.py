"""The private Keras hooks behind `enable_multi_worker_fit()`.

Everything that touches Keras internals for multi-worker `fit` is here, read
from Keras 3.10.0, 3.11.3, 3.12.0, 3.13.0, 3.14.0, 3.15.0, 3.15.1 and
keras-nightly 3.16.0.dev2026102704 (where `TensorFlowTrainer` is named
`Trainer`): `TensorFlowTrainer._maybe_symbolic_build`,
`TensorFlowTrainer.fit` / `evaluate` / `predict`, the module function
`reduce_per_replica` and `TFEpochIterator.__init__` / `_get_iterator` of
`keras/src/backend/tensorflow/trainer.py`, plus the data code whose
behaviour the replacements rely on (`EpochIterator._enumerate_iterator`,
`ArrayDataAdapter.get_tf_dataset`, `GeneratorDataAdapter.get_tf_dataset`,
and `PyDatasetAdapter.get_tf_dataset` / `_get_iterator` / its four batch
generators `_finite_generator`, `_infinite_generator`,
`_finite_enqueuer_generator`, `_infinite_enqueuer_generator`).
Each replacement calls Keras's original unless the model's strategy is a
multi-worker `MultiWorkerMirroredStrategy`. `structure_differences()` checks
the installed Keras against fingerprints of the code read (the version string
alone says nothing about a changed private function) and names every
function that differs or is gone; `install()` returns the originals;
`uninstall(originals)` puts them back.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

from keras_mgpu._code_fingerprint import (
    class_named,
    code_differences,
    function_fingerprint,
)
from keras_mgpu.distribute._keras_data_order import (
    _agree_on_py_dataset_order,
    _check_dataset_shuffles,
    _graph_seed,
    _shuffle_seeded_by_epoch,
    _shuffles_arrays,
    _warn_order,
    epoch_seed,
    shared_seed,
)
from keras_mgpu.distribute.fit_warnings import MultiWorkerFitWarning
from keras_mgpu.distribute.strategy import is_multi_worker

_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
# The TensorFlow backend's trainer class: `TensorFlowTrainer` up to Keras
# 3.15, `Trainer` from 3.16 (keras-nightly 3.16.0.dev2026102704). The
# fingerprint table keeps the old name for both.
TRAINER_CLASS_NAMES = ("TensorFlowTrainer", "Trainer")
_METHODS = ("_maybe_symbolic_build", "fit", "evaluate", "predict")
_STATE = threading.local()

# Fingerprints (`_fingerprint`: the function's AST without docstring,
# comments or layout) of the Keras code this module replaces or relies on,
# with the releases that have it. Measured with tools/keras_fingerprints.py
# on the wheels of Keras 3.10.0, 3.11.3, 3.12.0, 3.13.0, 3.14.0, 3.15.0 and
# 3.15.1 (identical on Python 3.10-3.13), and on keras-nightly
# 3.16.0.dev2026102704 (Python 3.11).
NIGHTLY = "3.16.0.dev2026102704"
_LATER = "3.11-3.15"
_ALL = f"3.10-3.15, {NIGHTLY}"
KNOWN_FINGERPRINTS: dict[str, dict[str, str]] = {
    # Replaced: we hand it one local replica's batch. (The class is
    # `Trainer` in 3.16; the method is unchanged.)
    "TensorFlowTrainer._maybe_symbolic_build": {
        "56fa1c6f0e28dfa5": "3.10",
        "51d8321613a24862": f"{_LATER}, {NIGHTLY}",
    },
    # Replaced in multi-worker mode (axis=None).
    "reduce_per_replica": {"bcd78e0928f53e77": _ALL},
    # Wrapped: builds and distributes the dataset once per fit.
    "TFEpochIterator.__init__": {"e86167fe76e447cf": _ALL},
    # Wrapped: returns the distributed dataset, iterated once per epoch.
    "TFEpochIterator._get_iterator": {"4180c4cf031ef71a": _ALL},
    # Relied on: a fresh `iter(_get_iterator())` per epoch; yields
    # (step, iterator) in 3.10, (begin, end, iterator) later.
    "EpochIterator._enumerate_iterator": {
        "0a8e7343b25dcdaf": "3.10",
        "7926cc678a88b4f1": f"{_LATER}, {NIGHTLY}",
    },
    # Relied on: the shuffle is one `tf.random.shuffle` seeded from the
    # graph seed at construction (3.10-3.15); from 3.16 a
    # `stateless_shuffle` seeded by the adapter's `_epoch` at construction
    # (`_tf_shuffle`), the same on every worker but, as the TensorFlow
    # trainer builds the dataset once per fit, the same every epoch.
    "ArrayDataAdapter.get_tf_dataset": {
        "6e5fa8ba2cacd27c": "3.10-3.15",
        "b387ead5cdfd86f3": NIGHTLY,
    },
    # Relied on: each iteration of its dataset calls `self.generator()`.
    "GeneratorDataAdapter.get_tf_dataset": {
        "567a350c0a34e704": "3.10-3.11",
        "4335dd58d1f758d2": f"3.12-3.15, {NIGHTLY}",
    },
    # Relied on: its dataset calls `self._get_iterator` afresh per epoch.
    "PyDatasetAdapter.get_tf_dataset": {"00690f138574376e": _ALL},
    # Relied on: picks the batch generator below, looked up on the instance.
    "PyDatasetAdapter._get_iterator": {"23bb3827a76421ad": _ALL},
    # Replaced per instance (shuffles batch indices with `random.shuffle`,
    # from 3.16 with `random.Random(self._epoch)` and keeping this data
    # shard's batches: `_data_shard_id::_num_data_shards`); relied on
    # unshuffled: each batch through `self._standardize_batch`.
    "PyDatasetAdapter._finite_generator": {
        "1b922f883b3c485f": "3.10-3.15",
        "42ed7159fd3d9b58": NIGHTLY,
    },
    # Relied on: each batch through `self._standardize_batch` (3.16:
    # this data shard's batches only).
    "PyDatasetAdapter._infinite_generator": {
        "45a2cf7b7785e6d3": "3.10-3.15",
        "323781156ca657bb": NIGHTLY,
    },
    # Relied on: each batch through `self._standardize_batch` (3.16: the
    # enqueuer is started with the epoch).
    "PyDatasetAdapter._finite_enqueuer_generator": {
        "526943d7ab2f62df": "3.10-3.15",
        "f1ed4a4e96592815": NIGHTLY,
    },
    # Relied on: each batch through `self._standardize_batch` (3.16: the
    # enqueuer is started with the epoch).
    "PyDatasetAdapter._infinite_enqueuer_generator": {
        "4d00c9c7afa49883": "3.10-3.15",
        "8a8a6ea3cf7f2bdc": NIGHTLY,
    },
}


# The PyDatasetAdapter methods every batch of the TensorFlow path goes
# through (`get_tf_dataset` -> `_get_iterator` -> one of four generators).
_PY_DATASET_METHODS = (
    "get_tf_dataset",
    "_get_iterator",
    "_finite_generator",
    "_infinite_generator",
    "_finite_enqueuer_generator",
    "_infinite_enqueuer_generator",
)


def _trainer_module() -> Any:
    import importlib

    return importlib.import_module(_TRAINER_MODULE)


def _trainer_class(module: Any = None) -> type:
    """The TensorFlow backend's trainer class, whichever name it has."""
    module = module if module is not None else _trainer_module()
    return class_named(module, TRAINER_CLASS_NAMES, "trainer class")


def _lookups() -> dict[str, Any]:
    """For each name of `KNOWN_FINGERPRINTS`, a function without arguments
    that returns the live Keras function (and raises when it is gone)."""

    def trainer() -> Any:
        return _trainer_module()

    def data(module: str, attribute: str) -> Any:
        import importlib

        return getattr(
            importlib.import_module(
                f"keras.src.trainers.data_adapters.{module}"
            ),
            attribute,
        )

    def py_dataset(name: str) -> Any:
        return lambda: getattr(
            data("py_dataset_adapter", "PyDatasetAdapter"), name
        )

    def epoch_iterator() -> Any:
        from keras.src.trainers import epoch_iterator as module

        return module.EpochIterator._enumerate_iterator

    return {
        "TensorFlowTrainer._maybe_symbolic_build": lambda: vars(
            _trainer_class()
        )["_maybe_symbolic_build"],
        "reduce_per_replica": lambda: trainer().reduce_per_replica,
        "TFEpochIterator.__init__": lambda: trainer().TFEpochIterator.__init__,
        "TFEpochIterator._get_iterator": lambda: (
            trainer().TFEpochIterator._get_iterator
        ),
        "EpochIterator._enumerate_iterator": epoch_iterator,
        "ArrayDataAdapter.get_tf_dataset": lambda: (
            data("array_data_adapter", "ArrayDataAdapter").get_tf_dataset
        ),
        "GeneratorDataAdapter.get_tf_dataset": lambda: (
            data(
                "generator_data_adapter", "GeneratorDataAdapter"
            ).get_tf_dataset
        ),
        **{
            f"PyDatasetAdapter.{name}": py_dataset(name)
            for name in _PY_DATASET_METHODS
        },
    }


def _relied_on() -> dict[str, Any]:
    """The live Keras functions named in `KNOWN_FINGERPRINTS` (raises
    when one is gone: `structure_differences()` names each)."""
    return {name: lookup() for name, lookup in _lookups().items()}


def _fingerprint(function: Any) -> str:
    """A hash of the function's code, blind to docstring, comments and
    layout (its AST without line numbers), the same on every Python."""
    return function_fingerprint(function)


def structure_differences() -> list[str]:
    """What differs between the installed Keras and the code this patch was
    read from: one line per function, every one of them (a missing class
    names each function looked up on it), empty when everything matches."""
    differences = code_differences(_lookups(), KNOWN_FINGERPRINTS)
    try:
        trainer = _trainer_class()
    except (ImportError, AttributeError) as exc:
        return [*differences, f"TensorFlowTrainer is gone ({exc!r})"]
    for name in ("fit", "evaluate", "predict"):
        method = vars(trainer).get(name)
        wanted = ("callbacks",) if name == "fit" else ()
        parameters = inspect.signature(method).parameters if method else {}
        missing = [p for p in wanted if p not in parameters]
        if method is None or missing:
            differences.append(
                f"{trainer.__name__}.{name} is missing or has no argument "
                f"{missing}"
            )
    return differences


def _releases(label: str) -> set[str]:
    """The releases a label of `KNOWN_FINGERPRINTS` names: "3.11-3.15,
    3.16.0.dev2026102704" -> {"3.11", ..., "3.15", "3.16.0.dev2026102704"}."""
    releases = set()
    for item in label.split(", "):
        first, _, last = item.partition("-")
        if not last:
            releases.add(first)
            continue
        major, low = first.split(".")
        releases.update(
            f"{major}.{minor}" for minor in range(int(low), int(last[2:]) + 1)
        )
    return releases


def _label(releases: set[str]) -> str:
    """The inverse of `_releases` for one run of minors plus the rest."""
    minors = sorted(int(r.split(".")[1]) for r in releases if r.count(".") == 1)
    others = sorted(r for r in releases if r.count(".") != 1)
    parts = []
    if minors:
        run = f"3.{minors[0]}"
        if len(minors) > 1:
            run += f"-3.{minors[-1]}"
        parts.append(run)
    return ", ".join(parts + others)


def release_of(found: dict[str, str]) -> str | None:
    """The Keras release(s) whose code has every fingerprint in `found`
    ({name: fingerprint}, all of `KNOWN_FINGERPRINTS`): "3.10",
    "3.11", "3.12-3.15" or `NIGHTLY`; None when one is unknown or no
    single release has them all."""
    common: set[str] | None = None
    for name, known in KNOWN_FINGERPRINTS.items():
        label = known.get(found.get(name, ""))
        if label is None:
            return None
        releases = _releases(label)
        common = releases if common is None else common & releases
    return _label(common) if common else None


def keras_release_of_installed_code() -> str | None:
    """The releases whose code the installed Keras matches ("3.10", "3.11",
    "3.12-3.15" or `NIGHTLY`), None if it matches none."""
    if structure_differences():
        return None
    return release_of(
        {name: _fingerprint(f) for name, f in _relied_on().items()}
    )


def install() -> dict[str, Any]:
    """Replace the Keras functions; return the originals by name.

    Call only after `structure_differences()` came back empty.
    """
    module = _trainer_module()
    trainer = _trainer_class(module)
    originals: dict[str, Any] = {
        f"TensorFlowTrainer.{name}": vars(trainer)[name] for name in _METHODS
    }
    originals["reduce_per_replica"] = module.reduce_per_replica
    originals["TFEpochIterator.__init__"] = module.TFEpochIterator.__init__
    originals["TFEpochIterator._get_iterator"] = (
        module.TFEpochIterator._get_iterator
    )

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
    module.TFEpochIterator.__init__ = _agreed_order_init(
        originals["TFEpochIterator.__init__"]
    )
    module.TFEpochIterator._get_iterator = _agreed_order_per_epoch(
        originals["TFEpochIterator._get_iterator"]
    )
    return originals


def uninstall(originals: dict[str, Any]) -> None:
    module = _trainer_module()
    trainer = _trainer_class(module)
    for name in _METHODS:
        setattr(trainer, name, originals[f"TensorFlowTrainer.{name}"])
    module.reduce_per_replica = originals["reduce_per_replica"]
    module.TFEpochIterator.__init__ = originals["TFEpochIterator.__init__"]
    module.TFEpochIterator._get_iterator = originals[
        "TFEpochIterator._get_iterator"
    ]


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
        first = getattr(iterator.data_adapter, "_first_batches", None)
        if type(iterator.data_adapter).__name__ == "GeneratorDataAdapter" and (
            first
        ):
            # A generator is read once: a batch drawn here (and the ones
            # tf.data prefetches behind it) would be lost to training, by a
            # different count on each worker. Keras kept the batches it
            # peeked at for the input signature; they give the shapes.
            return original(self, iterator=None, data_batch=first[0])
        batch = None
        # Keras 3.10 yields (step, iterator), later (begin, end, iterator).
        for item in iterator:
            batch = next(item[-1])
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
# Data order: every worker agrees, and a new order every epoch
# ----------------------------------------------------------------------
# Under MultiWorkerMirroredStrategy each worker builds the whole input
# pipeline and auto-sharding keeps its share of the batches (policy DATA:
# batch i goes to the worker of rank i % num_workers). An epoch covers every
# sample exactly once only if every worker produces the same batches in the
# same order; a shuffle must therefore draw the same permutation on every
# worker, and a new one each epoch.
def _agreed_order_init(original: Any) -> Any:
    def __init__(self, distribute_strategy=None, *args, **kwargs):
        self._keras_mgpu_order = None
        if distribute_strategy is None or not is_multi_worker(
            distribute_strategy
        ):
            return original(self, distribute_strategy, *args, **kwargs)
        if _shuffles_arrays(args, kwargs):
            base = shared_seed(distribute_strategy)
            with _graph_seed(epoch_seed(base, 0)):
                original(self, distribute_strategy, *args, **kwargs)
            self._keras_mgpu_order = {"base": base, "calls": 0}
            return None
        original(self, distribute_strategy, *args, **kwargs)
        adapter = self.data_adapter
        kind = type(adapter).__name__
        if kind in ("PyDatasetAdapter", "GeneratorDataAdapter"):
            _copy_python_batches(adapter)
        if kind == "PyDatasetAdapter" and adapter.shuffle:
            _agree_on_py_dataset_order(adapter, distribute_strategy)
        elif kind == "GeneratorDataAdapter":
            _warn_order(
                "a Python generator: Keras cannot shard it, so every worker "
                "runs its own generator and keeps its share of each batch. An "
                "epoch covers each sample once only if the generator yields "
                "the same batches in the same order on every worker (seed its "
                "randomness alike on every worker); keras_mgpu cannot check "
                "that. A keras.utils.PyDataset (shuffle=True, workers=1) or "
                "a tf.data.Dataset with a seeded shuffle lets keras_mgpu "
                "keep the workers in step."
            )
        elif kind == "TFDatasetAdapter":
            # Comparing seeds takes a collective: only for the training
            # data, which every worker adapts at the same point of `fit`
            # (a chief-only `predict` must not wait for its peers).
            _check_dataset_shuffles(
                adapter,
                distribute_strategy,
                compare=getattr(_STATE, "training_iterator_pending", False),
            )
        return None

    return _mark(__init__, original)


def _agreed_order_per_epoch(original: Any) -> Any:
    def _get_iterator(self):
        order = getattr(self, "_keras_mgpu_order", None)
        if order is None:
            return original(self)
        # Keras iterates the dataset built in __init__ afresh every epoch,
        # and its shuffle op, seeded at construction (3.10-3.15: from the
        # graph seed; 3.16: from the adapter's `_epoch`), then draws the
        # same permutation every time: rebuild it under the next epoch's
        # seed. (3.16 built the first one with `_epoch` 0, whatever the
        # seed: rebuilt too.)
        calls = order["calls"]
        order["calls"] += 1
        adapter = self.data_adapter
        seeded_by_epoch = _shuffle_seeded_by_epoch(adapter)
        if calls > 0 or seeded_by_epoch:
            seed = epoch_seed(order["base"], calls)
            with _graph_seed(seed):
                if seeded_by_epoch:
                    adapter._epoch = seed
                dataset = adapter.get_tf_dataset()
            strategy = self._distribute_strategy
            self._distributed_dataset = (
                strategy.experimental_distribute_dataset(dataset)
            )
        return original(self)

    return _mark(_get_iterator, original)


# Whether batches from Python (a generator, a PyDataset) are copied before
# TensorFlow sees them; False only to show what TensorFlow does without
# (tests/distribute/test_mw_data_order.py).
COPY_PYTHON_BATCHES = True


def _copied(batch: Any) -> Any:
    import numpy as np
    from keras import tree

    return tree.map_structure(
        lambda v: np.array(v, copy=True) if isinstance(v, np.ndarray) else v,
        batch,
    )


def _copy_python_batches(adapter: Any) -> None:
    """Copy every NumPy array a generator or PyDataset yields, on this
    adapter only.

    Measured (TensorFlow 2.21, Keras 3.15, 2 workers, oneDNN on or off):
    `tf.data.Dataset.from_generator` wraps a 64-byte-aligned NumPy array
    without copying it, the multi-worker input pipeline slices each global
    batch into the workers' shares, and the first share, which starts at
    the buffer's start, still aliases it; a kernel of the train step then
    reuses that buffer for its output. So the labels of a batch that is a
    view of the user's array (`y[i:i + batch]`) were overwritten in the
    user's array, on the chief's share of every other batch: later epochs
    and later fits trained on corrupted labels. A copy of each array is
    TensorFlow's to overwrite. One process (no slicing) is not affected.
    """
    if not COPY_PYTHON_BATCHES:
        return
    if type(adapter).__name__ == "GeneratorDataAdapter":
        generator = adapter.generator

        def copying_generator():
            for batch in generator():
                yield _copied(batch)

        adapter.generator = copying_generator
        return
    # Every path of PyDatasetAdapter (with or without an enqueuer, finite
    # or not) passes each batch through `_standardize_batch`, looked up on
    # the instance when the batch is drawn (the dataset may already exist).
    standardize = adapter._standardize_batch

    def _standardize_batch(batch: Any) -> Any:
        return _copied(standardize(batch))

    adapter._standardize_batch = _standardize_batch


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
    try:
        partial = bool(adapter is not None and adapter.has_partial_batch)
    except NotImplementedError:
        # PyDataset, generator and tf.data adapters do not know.
        partial = False
    if not partial:
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
