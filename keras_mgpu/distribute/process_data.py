"""Feed a multi-process JAX `fit` exactly: every process holds the same
full data and keeps its slice of each global batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from keras_mgpu.backend import require_backend


def _keras():
    import keras

    return keras


def _nest_rows(data: Any) -> int | None:
    import numpy as np

    if data is None:
        return None
    if isinstance(data, dict):
        sizes = {_nest_rows(v) for v in data.values()}
    elif isinstance(data, (list, tuple)):
        sizes = {_nest_rows(v) for v in data}
    else:
        return int(np.shape(data)[0])
    sizes.discard(None)
    if len(sizes) > 1:
        raise ValueError(
            "The arrays given to shard_across_processes must all have the "
            f"same number of rows. Received row counts: {sorted(sizes)}"
        )
    return sizes.pop() if sizes else None


def _map_leaves(data: Any, fn: Callable[[Any], Any]) -> Any:
    """`fn` applied to each array of a nest of dicts, lists and tuples
    (None stays None): one walk for taking a process's rows and cutting
    its local batch."""
    if data is None:
        return None
    if isinstance(data, dict):
        return {k: _map_leaves(v, fn) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_map_leaves(v, fn) for v in data)
    return fn(data)


class _Layout:
    """How a global batch splits: `num_processes` contiguous slices, each a
    multiple of the devices one process holds."""

    def __init__(self, distribution: Any) -> None:
        import jax

        from keras_mgpu.backend.jax.distribution import (
            current_distribution,
            data_parallel_size,
        )

        distribution = current_distribution(distribution)
        self.num_processes = int(jax.process_count())
        self.index = int(jax.process_index())
        # A batch is split over the devices of the batch axis; in a
        # multi-process mesh each process feeds its devices' share.
        self.parallel = max(data_parallel_size(distribution), 1)
        self.unit = math.lcm(self.num_processes, self.parallel)
        if (
            self.num_processes > 1
            and distribution is not None
            and getattr(distribution, "auto_shard_dataset", False)
        ):
            raise ValueError(
                "shard_across_processes gives each process its slice of "
                "every global batch already: set "
                "`distribution.auto_shard_dataset = False` on the "
                "distribution in force (Keras would refuse the data "
                "otherwise). Received: auto_shard_dataset=True"
            )

    def check(self, rows: int, what: str) -> None:
        if rows % self.unit:
            raise ValueError(
                f"{what} of {rows} samples cannot be split exactly over "
                f"{self.num_processes} process(es) and {self.parallel} "
                f"data-parallel device(s): it must be a multiple of "
                f"{self.unit}. Choose a batch size that is one (and that "
                "divides the samples, or pass drop_remainder=True)."
            )

    def local(self, rows: int) -> slice:
        share = rows // self.num_processes
        return slice(self.index * share, (self.index + 1) * share)


def _agreed_seed(seed: int | None) -> int:
    """A seed every process shares: `seed`, else Keras's global seed (set by
    `keras.utils.set_random_seed`, or agreed by `start_cluster`), else one
    drawn on process 0 and broadcast."""
    import numpy as np

    from keras_mgpu.backend.jax import cluster

    if seed is not None:
        return int(seed)
    global_seed = cluster._keras_global_seed()
    if global_seed is not None:
        return int(global_seed)
    return cluster.broadcast_int(int(np.random.randint(0, 2**31 - 1)))


def _array_dataset_class():
    keras = _keras()

    class ProcessArrayBatches(keras.utils.PyDataset):
        """This process's slice of each global batch of in-memory arrays,
        in a new agreed order every epoch."""

        def __init__(self, arrays, rows, batch_size, layout, shuffle, seed):
            super().__init__()
            self._arrays = arrays
            self._rows = rows
            self._batch = batch_size
            self._layout = layout
            self._shuffle = shuffle
            self._seed = seed
            self._served = 0  # batches served since the first epoch began
            self._rewound = False
            self._cached = (None, None)

        def _order_of(self, epoch):
            import numpy as np

            if self._cached[0] != epoch:
                if self._shuffle:
                    rng = np.random.default_rng([self._seed, epoch])
                    order = rng.permutation(self._rows)
                else:
                    order = np.arange(self._rows)
                self._cached = (epoch, order)
            return self._cached[1]

        @property
        def epoch(self):
            """The data epoch the next batch belongs to (from 0)."""
            return self._served // self.num_batches

        @property
        def num_batches(self):
            return self._rows // self._batch + (
                1 if self._rows % self._batch else 0
            )

        def __len__(self):
            return self.num_batches

        def __getitem__(self, index):
            # The batch asked for is ignored: `fit(shuffle=True)` (its
            # default) reorders a PyDataset's batch indices with each
            # process's own `random` state, which would join different
            # global batches' slices. The next batch in the agreed order is
            # served instead; a new order begins every `num_batches`
            # batches (so `steps_per_epoch` shorter than an epoch goes on
            # where the last epoch stopped, as Keras does with arrays).
            del index
            epoch, position = divmod(self._served, self.num_batches)
            self._served += 1
            start = position * self._batch
            rows = self._order_of(epoch)[start : start + self._batch]
            mine = rows[self._layout.local(len(rows))]
            return _map_leaves(self._arrays, lambda array: array[mine])

        def on_epoch_end(self):
            # Keras 3.15's `fit` takes one batch to build the model, then
            # resets its iterator (`on_epoch_end`) before the first epoch:
            # that batch is served again.
            if not self._rewound and self._served < self.num_batches:
                self._served = 0
            self._rewound = True

    return ProcessArrayBatches


def _batch_rows(batch: Any) -> int:
    rows = _nest_rows(batch)
    if rows is None:
        raise ValueError(
            "A batch given to shard_across_processes holds no arrays. "
            f"Received: {type(batch).__name__}"
        )
    return rows


def _local_batch(batch: Any, layout: _Layout, where: str) -> Any:
    import numpy as np

    rows = _batch_rows(batch)
    layout.check(rows, f"Batch {where}")
    mine = layout.local(rows)

    def cut(a):
        return np.asarray(a)[mine]

    # A None at the top never gets here: `_batch_rows` found arrays.
    return _map_leaves(batch, cut)


def _py_dataset_wrapper_class():
    keras = _keras()

    class ProcessPyDatasetSlices(keras.utils.PyDataset):
        """This process's slice of each batch of a `PyDataset` that yields
        global batches (every process runs the same `PyDataset`)."""

        def __init__(self, dataset, layout):
            super().__init__()
            self._dataset = dataset
            self._layout = layout
            self._served = 0  # batches served since the first pass began
            self._rewound = False

        def __len__(self):
            return len(self._dataset)

        @property
        def num_batches(self):
            return self._dataset.num_batches

        def __getitem__(self, index):
            # As for arrays: served in the wrapped dataset's order, whatever
            # index `fit(shuffle=True)` asks for (see ProcessArrayBatches).
            # Keras goes through all of a PyDataset's batches before it
            # starts again, across epochs when `steps_per_epoch` is shorter
            # (the next epoch goes on where the last stopped): so does the
            # position here, counted over every batch served.
            del index
            position = self._served
            if self.num_batches is not None:
                position %= self.num_batches
            self._served += 1
            return _local_batch(
                self._dataset[position], self._layout, f"{position}"
            )

        def on_epoch_begin(self):
            self._dataset.on_epoch_begin()

        def on_epoch_end(self):
            # Keras 3.15's `fit` takes one batch to build the model, then
            # ends that pass (see ProcessArrayBatches).
            if not self._rewound and (
                self.num_batches is None or self._served < self.num_batches
            ):
                self._served = 0
            self._rewound = True
            self._dataset.on_epoch_end()

    return ProcessPyDatasetSlices


def _generator_slices(iterable: Iterable, layout: _Layout):
    for index, batch in enumerate(iterable):
        yield _local_batch(batch, layout, f"{index}")


def shard_across_processes(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: int | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    drop_remainder: bool = False,
    distribution: Any = None,
) -> Any:
    """Give a multi-process `fit` on JAX exactly the global batches one
    process would train on: each process keeps its slice of every global
    batch.

    Every process calls it with the same full data (as on TensorFlow under
    `MultiWorkerMirroredStrategy`). Keras then assembles each global batch
    from the processes' slices (`jax.make_array_from_process_local_data`),
    so step `s` trains on global batch `s` whatever the number of processes.
    Set `distribution.auto_shard_dataset = False` (or
    `start_cluster(auto_shard_dataset=False)`): Keras refuses anything but
    `tf.data` otherwise, and with the flag it splits nothing itself.

    - NumPy arrays (`x`, `y`, `sample_weight`; arrays, tuples, lists or
      dicts of them) with the global `batch_size`: a `PyDataset`. With
      `shuffle=True` the order is a permutation of the samples drawn from
      `seed` and the epoch, the same in every process: each sample once
      per epoch across processes, a new order each epoch, the same orders
      in a re-run with the same seed (`seed=None`: Keras's global seed,
      which `keras.utils.set_random_seed` or `start_cluster` sets the same
      everywhere; else one process 0 draws and broadcasts).
    - A `keras.utils.PyDataset` or a Python generator/iterable yielding
      global batches: each batch is cut; the processes must produce the
      same batches (seed any shuffling identically).

    The `PyDataset`s returned serve their batches in their own agreed order,
    whatever batch index `fit` asks for: `fit(shuffle=True)`, its default,
    reorders a `PyDataset`'s batch indices with each process's own Python
    `random` state, which would join slices of different global batches
    (measured: 0.03-0.06 off one process after one epoch, differing from
    run to run). Use them with the default `workers=1`.
    - A `tf.data.Dataset` of global batches: re-batched into per-process
      slices, keeping this process's (what Keras does with
      `auto_shard_dataset=True`). Every process must build the same
      pipeline and draw the same order: seed every `shuffle` (nothing
      checks it: comparing a first batch across processes would draw one
      order of a reshuffling pipeline, and the run would no longer equal
      one process's).

    A global batch must be a multiple of the number of processes and of the
    devices along the batch axis (each process feeds its devices equally):
    any other batch, the last one of the arrays included, is a `ValueError`
    (for arrays at the call; pass `drop_remainder=True` to drop a short
    last batch).

    JAX only (on TensorFlow, `enable_multi_worker_fit()` gives the same
    guarantees for data passed straight to `fit`). In one process it
    returns the batches whole.

    Args:
        x: arrays, a `PyDataset`, a generator/iterable or a `tf.data`
            dataset of global batches.
        y: arrays of targets (with arrays `x` only).
        sample_weight: arrays of sample weights (with arrays `x` only).
        batch_size: int, the global batch size (arrays only; required).
        shuffle: bool, reshuffle the arrays every epoch. Defaults to True.
        seed: int, the shuffling seed shared by every process.
        drop_remainder: bool, drop a last batch shorter than `batch_size`
            (arrays only). Defaults to False.
        distribution: the `keras.distribution` the model trains under.
            Defaults to the one in force.

    Returns:
        What to pass to `fit` as `x` (without `y`).

    Example:

    ```python
    distribution = keras_mgpu.distribute.start_cluster(
        auto_shard_dataset=False)
    with distribution.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="mse")
        data = keras_mgpu.distribute.shard_across_processes(
            x, y, batch_size=64, seed=0)
        model.fit(data, epochs=3)
    ```
    """
    require_backend(
        "keras_mgpu.distribute.shard_across_processes",
        ("jax",),
        instead=(
            "keras_mgpu.distribute.enable_multi_worker_fit(), then pass the "
            "data to fit as on one process"
        ),
    )
    if not isinstance(shuffle, bool):
        raise TypeError(
            f"Argument `shuffle` must be a bool. Received: shuffle={shuffle!r}"
        )
    layout = _Layout(distribution)
    keras = _keras()
    is_arrays = _is_arrays(x)
    if not is_arrays:
        for name, value in (
            ("y", y),
            ("sample_weight", sample_weight),
            ("batch_size", batch_size),
        ):
            if value is not None:
                raise ValueError(
                    f"Argument `{name}` is for NumPy arrays only: a "
                    f"{type(x).__name__} yields whole batches. Received: "
                    f"{name}={value!r}"
                )
    if isinstance(x, keras.utils.PyDataset):
        return _py_dataset_wrapper_class()(x, layout)
    if _is_tf_dataset(x):
        return _tf_dataset_slices(x, layout)
    if not is_arrays:
        if isinstance(x, Iterable) and not isinstance(x, (str, bytes)):
            return _generator_slices(x, layout)
        raise TypeError(
            "Argument `x` must be NumPy arrays (or tuples, lists, dicts of "
            "them), a keras.utils.PyDataset, a generator or a "
            f"tf.data.Dataset. Received: x of type {type(x).__name__}"
        )
    if (
        not isinstance(batch_size, int)
        or isinstance(batch_size, bool)
        or batch_size < 1
    ):
        raise ValueError(
            "Argument `batch_size` (the global batch) must be an integer "
            f">= 1 with arrays. Received: batch_size={batch_size!r}"
        )
    arrays = tuple(a for a in (x, y, sample_weight))
    while arrays and arrays[-1] is None:
        arrays = arrays[:-1]
    rows = _nest_rows(arrays)
    if not rows:
        raise ValueError(f"Argument `x` holds no samples. Received: {rows}")
    layout.check(batch_size, "The global batch (`batch_size`)")
    if drop_remainder:
        rows -= rows % batch_size
        if not rows:
            raise ValueError(
                f"drop_remainder=True with batch_size={batch_size} leaves "
                f"no batch of {_nest_rows(arrays)} samples"
            )
    elif rows % batch_size:
        layout.check(rows % batch_size, "The last batch")
    if len(arrays) == 1:
        # As Keras packs `fit(x=...)` alone: a list or tuple `x` is the
        # model's inputs, served as `(x,)`; served bare, Keras would read
        # `[x1, x2]` as `(x, y)`.
        arrays = arrays if isinstance(x, (list, tuple)) else arrays[0]
    return _array_dataset_class()(
        arrays,
        rows,
        batch_size,
        layout,
        shuffle,
        _agreed_seed(seed) if shuffle else 0,
    )


def _is_arrays(x: Any) -> bool:
    import numpy as np

    if isinstance(x, dict):
        return bool(x) and all(_is_arrays(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return bool(x) and all(_is_arrays(v) for v in x)
    if isinstance(x, np.ndarray):
        return True
    # jax arrays and the like: shaped, indexable, not iterators
    return hasattr(x, "shape") and hasattr(x, "dtype") and not _is_tf_dataset(x)


def _is_tf_dataset(x: Any) -> bool:
    return type(x).__module__.startswith("tensorflow") and hasattr(
        x, "element_spec"
    )


def _tf_dataset_slices(dataset: Any, layout: _Layout) -> Any:
    """Each global batch re-batched into `num_processes` slices, this
    process keeping slice `index` of every batch."""
    import tensorflow as tf  # the user gave tf.data: TensorFlow is loaded

    if layout.num_processes == 1:
        return dataset

    def cut(*batch):
        batch = batch[0] if len(batch) == 1 else batch
        rows = tf.shape(tf.nest.flatten(batch)[0])[0]
        tf.debugging.assert_equal(
            rows % layout.unit,
            0,
            message=(
                "a tf.data batch cannot be split exactly over "
                f"{layout.num_processes} processes and {layout.parallel} "
                f"devices (must be a multiple of {layout.unit})"
            ),
        )
        share = rows // layout.num_processes
        start = layout.index * share
        return tf.nest.map_structure(lambda t: t[start : start + share], batch)

    return dataset.map(cut)
