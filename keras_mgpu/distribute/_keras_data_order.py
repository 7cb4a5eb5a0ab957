"""The data order of multi-worker `fit` (part of the private Keras hooks of
`_keras_trainer_patch`, whose replacements call these): one shuffle seed the
workers agree on, a new order every epoch, the same `PyDataset` order on
every worker, and the checks that a `tf.data` shuffle is seeded alike."""

from __future__ import annotations

import contextlib
import hashlib
import random
import warnings
from typing import Any

from keras_mgpu.distribute.fit_warnings import MultiWorkerFitWarning


def _shuffle_seeded_by_epoch(adapter: Any) -> bool:
    """Whether the array adapter seeds its shuffle with its `_epoch`
    (`ArrayDataAdapter._tf_shuffle`, Keras 3.16) rather than with the
    graph seed (3.10-3.15)."""
    return callable(getattr(type(adapter), "_tf_shuffle", None))


def _shuffles_arrays(args: tuple, kwargs: dict) -> bool:
    """Whether Keras is about to shuffle in-memory arrays."""
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


def epoch_seed(base: int, epoch: int) -> int:
    """The shuffle seed of one epoch: the same on every worker (same
    `base`), different for each epoch, below 2**31."""
    return random.Random(f"{base}:{epoch}").randrange(1, 2**31 - 1)


def shared_seed(strategy: Any) -> int:
    """A seed drawn on the chief and sent to every worker (one all-reduce).

    The chief's seed follows its global TensorFlow seed when one is set, so
    a seeded run stays reproducible; otherwise it is random.
    """
    import numpy as np
    from tensorflow.python.eager import context

    from keras_mgpu.distribute.collectives import gather_rows
    from keras_mgpu.distribute.strategy import worker_info

    value = 0.0
    if worker_info(strategy)["is_chief"]:
        base = context.global_seed()
        rng = random.Random(base) if base is not None else random.SystemRandom()
        # Below 2**31: exact in float64 and a valid TensorFlow seed.
        value = float(rng.randrange(1, 2**31 - 1))
    rows = gather_rows(strategy, np.array([value]))
    return int(rows.sum())


def _warn_order(what: str) -> None:
    warnings.warn(
        f"Multi-worker fit on {what}",
        MultiWorkerFitWarning,
        stacklevel=5,
    )


def _agree_on_py_dataset_order(adapter: Any, strategy: Any) -> None:
    """`PyDataset` with shuffle=True: Keras shuffles the batch indices with
    Python's global `random`, differently on each worker. Without an
    enqueuer (workers=1, the default) the adapter's index shuffle is
    replaced, on this adapter only, by one seeded per epoch from a seed
    every worker shares."""
    if adapter.enqueuer is not None or adapter.py_dataset.num_batches is None:
        _warn_order(
            "a keras.utils.PyDataset with shuffle=True and "
            + (
                "workers > 1 or use_multiprocessing"
                if adapter.enqueuer is not None
                else "no length"
            )
            + ": Keras shuffles its batch indices with Python's `random` on "
            "each worker separately, so an epoch repeats some batches and "
            "skips others across the workers. Use workers=1 (keras_mgpu "
            "then shares one shuffle per epoch), or shuffle=False and "
            "permute in on_epoch_end with a seed every worker shares."
        )
        return
    base = shared_seed(strategy)
    state = {"epoch": 0}

    # Keras 3.16 keeps one data shard's batches (`keras.distribution` with
    # `auto_shard_dataset`); one shard of all batches before.
    first = getattr(adapter, "_data_shard_id", 0)
    step = getattr(adapter, "_num_data_shards", 1)

    def _finite_generator():
        indices = list(range(adapter.py_dataset.num_batches))
        random.Random(epoch_seed(base, state["epoch"])).shuffle(indices)
        state["epoch"] += 1
        for i in indices[first::step]:
            yield adapter._standardize_batch(adapter.py_dataset[i])

    adapter._finite_generator = _finite_generator


def _check_dataset_shuffles(adapter: Any, strategy: Any, compare: bool) -> None:
    """Warn when a `tf.data` shuffle will differ between workers: unseeded
    (each worker draws its own seed), or (`compare`: one all-reduce)
    seeded differently per worker."""
    import numpy as np

    from keras_mgpu.distribute.collectives import gather_rows

    seeds = _shuffle_seeds(adapter.get_tf_dataset())
    unseeded = any(seed == (0, 0) for seed in seeds)
    digest = int(hashlib.sha256(repr(seeds).encode()).hexdigest()[:12], 16) % (
        2**40
    )
    rows = np.zeros((1, 1))
    if compare:
        rows = gather_rows(strategy, np.array([float(digest)]))
    if unseeded:
        _warn_order(
            "a tf.data.Dataset with an unseeded shuffle(): each worker "
            "shuffles with its own random seed, and auto-sharding then keeps "
            "each worker's share of a different order, so an epoch repeats "
            "some samples and skips others. Pass the same seed on every "
            "worker (dataset.shuffle(buffer, seed=...); it still reshuffles "
            "every epoch), or shard the files per worker."
        )
    elif len(set(rows[:, 0].tolist())) > 1:
        _warn_order(
            "a tf.data.Dataset whose shuffle() seeds differ between workers "
            "(e.g. a global seed set per worker): each worker keeps its share "
            "of a different order, so an epoch repeats some samples and skips "
            "others. Give shuffle() the same explicit seed on every worker, "
            "and the same global seed (or none): TensorFlow combines the "
            "two."
        )


def _shuffle_seeds(dataset: Any) -> list[tuple[int, int]]:
    """(seed, seed2) of every `shuffle` in the pipeline; (0, 0) when
    unseeded (TensorFlow then draws a random seed per process)."""
    seeds, stack, seen = [], [dataset], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if type(current).__name__ == "_ShuffleDataset":
            try:
                seeds.append(
                    (int(current._seed.numpy()), int(current._seed2.numpy()))
                )
            except (AttributeError, ValueError, TypeError):
                seeds.append((0, 0))  # not readable: assume the worst
        inputs = getattr(current, "_inputs", None)
        if callable(inputs):
            with contextlib.suppress(Exception):
                stack.extend(inputs())
    return seeds


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
