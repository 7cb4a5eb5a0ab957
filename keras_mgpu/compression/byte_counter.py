"""Count, as they run, the bytes a strategy's reductions take from each
replica: what gradient compression saves, measured rather than assumed."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from keras_mgpu._flavour import tf
from keras_mgpu.backend import require_backend


def _distributed_value_classes() -> tuple[type, type]:
    """`PerReplica` and `Mirrored` (TensorFlow 2.16-2.21, private module
    `tensorflow.python.distribute.values`): the public API has only their
    base class, which both share."""
    from tensorflow.python.distribute import values

    return values.PerReplica, values.Mirrored


def _strategy_reductions() -> tuple[str, str]:
    """The two `StrategyExtended` methods every cross-device reduction of a
    `merge_call` goes through (private, TensorFlow 2.16-2.21):
    `ReplicaContext.all_reduce` calls `batch_reduce_to`, `strategy.reduce`
    and on-read variables call `reduce_to`."""
    return "_reduce_to", "_batch_reduce_to"


class CrossDeviceByteCounter:
    """Counts the bytes each replica hands to a strategy's reductions.

    Once created, every all-reduce (`ReplicaContext.all_reduce`,
    `strategy.reduce`, `extended.reduce_to` / `batch_reduce_to`) the
    strategy performs adds, when it runs, the size of one replica's
    contribution to a record keyed by kind, dtype and shape: a reduction in
    an untaken `tf.cond` branch counts nothing. Sparse values
    (`tf.IndexedSlices`) count their values and indices at run time. This is
    the payload each replica sends; a ring all-reduce moves about
    `2·(R−1)/R` times that over each link.

    Create it before the training step is traced (before `fit` or the first
    `strategy.run`), outside `strategy.scope()` (its counters are plain
    host variables). Reductions of values already mirrored (no
    communication) and of plain tensors on a single worker are not
    counted. XLA-compiled steps on all-GPU `MirroredStrategy` reduce without
    `merge_call` and are not seen.

    Args:
        strategy: the `tf.distribute.Strategy` to watch.
        capacity: int, the most distinct (kind, dtype, shape) records.

    Example:

    ```python
    counter = keras_mgpu.compression.CrossDeviceByteCounter(strategy)
    model.fit(x, y, epochs=1)
    print(counter.summary())
    counter.remove()
    ```
    """

    def __init__(self, strategy: tf.distribute.Strategy, capacity: int = 512):
        require_backend("CrossDeviceByteCounter", ("tensorflow",))
        if tf.distribute.has_strategy():
            raise ValueError(
                "Create the CrossDeviceByteCounter outside `strategy.scope()`:"
                " its counters must be plain host variables, not mirrored."
            )
        self.strategy = strategy
        self._capacity = int(capacity)
        self._calls = tf.Variable(
            tf.zeros([self._capacity], tf.int64), trainable=False
        )
        self._bytes = tf.Variable(
            tf.zeros([self._capacity], tf.int64), trainable=False
        )
        self._keys: dict = {}
        self._lock = threading.Lock()
        self._installed: dict = {}
        self._install()

    # ------------------------------------------------------------------
    def _install(self) -> None:
        extended = self.strategy.extended
        for name in _strategy_reductions():
            original = getattr(extended, name)
            self._installed[name] = original
            vars(extended)[name] = self._wrap(name, original)

    def remove(self) -> None:
        """Stop counting new traces (already traced steps keep counting)."""
        extended = self.strategy.extended
        for name in self._installed:
            vars(extended).pop(name, None)
        self._installed = {}

    def _wrap(self, name: str, original: Any) -> Any:
        def reduce_to(reduce_op, value, destinations, options):
            with tf.control_dependencies(self._count(tf.nest.flatten(value))):
                return original(reduce_op, value, destinations, options)

        def batch_reduce_to(reduce_op, value_destination_pairs, options):
            pairs = list(value_destination_pairs)
            values = [v for value, _ in pairs for v in tf.nest.flatten(value)]
            with tf.control_dependencies(self._count(values)):
                return original(reduce_op, pairs, options)

        return reduce_to if name == "_reduce_to" else batch_reduce_to

    def _contribution(self, value: Any) -> Any:
        """One replica's part of `value`, or None if it is not sent."""
        per_replica, mirrored = _distributed_value_classes()
        if isinstance(value, mirrored):
            return None
        if isinstance(value, per_replica):
            return value.values[0]
        devices = len(self.strategy.extended.worker_devices)
        if self.strategy.num_replicas_in_sync > devices:  # several workers
            return value
        return None

    def _count(self, values: list) -> list:
        ops = []
        for value in values:
            part = self._contribution(value)
            if part is None:
                continue
            slot = self._slot(part)
            size = _byte_size(part)
            ops.append(self._calls.scatter_nd_add([[slot]], [1]))
            ops.append(self._bytes.scatter_nd_add([[slot]], [size]))
        return ops

    def _slot(self, part: Any) -> int:
        sparse = isinstance(part, tf.IndexedSlices)
        tensor = part.values if sparse else part
        shape = tuple(tensor.shape.as_list()) if tensor.shape.rank else ()
        key = ("sparse" if sparse else "dense", tensor.dtype.name, shape)
        with self._lock:
            if key not in self._keys:
                if len(self._keys) >= self._capacity:
                    raise RuntimeError(
                        f"CrossDeviceByteCounter holds {self._capacity} "
                        "records; create it with a larger `capacity`."
                    )
                self._keys[key] = len(self._keys)
            return self._keys[key]

    # ------------------------------------------------------------------
    def reset(self) -> None:
        """Set every count back to 0."""
        self._calls.assign(tf.zeros_like(self._calls))
        self._bytes.assign(tf.zeros_like(self._bytes))

    def records(self) -> list[dict]:
        """One dict per (kind, dtype, shape) sent since the last `reset`:
        `kind` ("dense" / "sparse"), `dtype`, `shape`, `calls`, `bytes`
        (one replica's contribution, all calls together), largest first."""
        calls = self._calls.numpy()
        sizes = self._bytes.numpy()
        records = [
            {
                "kind": kind,
                "dtype": dtype,
                "shape": shape,
                "calls": int(calls[slot]),
                "bytes": int(sizes[slot]),
            }
            for (kind, dtype, shape), slot in self._keys.items()
            if calls[slot]
        ]
        return sorted(records, key=lambda r: (-r["bytes"], r["shape"]))

    def total_bytes(self) -> int:
        """Bytes one replica handed to the reductions since `reset`."""
        return int(np.sum(self._bytes.numpy()))

    def summary(self) -> str:
        """The records as a text table, and the total."""
        lines = [f"{'kind':6} {'dtype':8} {'shape':>16} {'calls':>6} bytes"]
        for r in self.records():
            shape = "x".join(str(d) for d in r["shape"]) or "scalar"
            lines.append(
                f"{r['kind']:6} {r['dtype']:8} {shape:>16} {r['calls']:>6} "
                f"{r['bytes']}"
            )
        lines.append(f"total bytes: {self.total_bytes()}")
        return "\n".join(lines)


def _byte_size(part: Any) -> Any:
    """Bytes of a tensor or `tf.IndexedSlices` (values and indices), as an
    int64 tensor (sparse row counts are known at run time only)."""
    if isinstance(part, tf.IndexedSlices):
        return _byte_size(part.values) + _byte_size(part.indices)
    itemsize = np.int64(part.dtype.size)
    if part.shape.is_fully_defined():
        return tf.constant(part.shape.num_elements() * itemsize, tf.int64)
    return tf.cast(tf.size(part), tf.int64) * itemsize
