"""How long this worker waits in collectives: the straggler's signature.

In synchronous data parallelism every worker leaves each collective at the
same moment, so wall-clock step times are equal on every worker whoever is
slow; what differs is how long each one *waited* inside the collectives for
the last to arrive. `CollectiveWaitTimer` adds two `tf.timestamp()` ops
around every all-reduce and all-gather traced while it is installed (one
when the input is ready, one when the result is), and sums their
difference into a local float64 variable. A worker's own work per step is
then its step time minus that wait; the slowest worker waits least.

The hook is TensorFlow's private `CollectiveReplicaLauncher` (TF 2.16-2.21,
`tensorflow/python/distribute/cross_device_utils.py`), through which
`MultiWorkerMirroredStrategy` and `MirroredStrategy`'s collective ops launch
every collective. Only collectives traced while installed are timed: a
train function traced earlier is not (the timer's `count` then stays 0).
On GPUs the timestamps are taken on the host when the executor sees the
input and output ready, which was not verified against device timelines.
"""

from __future__ import annotations

import threading
from typing import Any

_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}
_USERS = 0
_WAIT = None  # float64 seconds
_COUNT = None  # collectives timed


def _launcher_class() -> Any | None:
    try:
        from tensorflow.python.distribute import cross_device_utils
    except ImportError:  # pragma: no cover - TensorFlow layout changed
        return None
    launcher = getattr(cross_device_utils, "CollectiveReplicaLauncher", None)
    if launcher is None or not all(
        callable(getattr(launcher, name, None))
        for name in ("all_reduce", "_all_gather")
    ):
        return None
    return launcher


def available() -> bool:
    """Whether this TensorFlow has the hook the timer needs."""
    return _launcher_class() is not None


def _timed(original: Any) -> Any:
    import tensorflow as tf

    def launch(self, input_tensor, *args, **kwargs):
        with tf.device("/cpu:0"):
            with tf.control_dependencies([input_tensor]):
                start = tf.timestamp()
        # The collective starts after `start` is taken.
        with tf.control_dependencies([start]):
            input_tensor = tf.identity(input_tensor)
        output = original(self, input_tensor, *args, **kwargs)
        with tf.device("/cpu:0"):
            with tf.control_dependencies([output]):
                waited = tf.timestamp() - start
            updates = [_WAIT.assign_add(waited), _COUNT.assign_add(1)]
        with tf.control_dependencies(updates):
            return tf.identity(output)

    launch.__wrapped__ = original
    return launch


def install() -> bool:
    """Time every collective traced from now on (reference counted)."""
    global _USERS, _WAIT, _COUNT
    launcher = _launcher_class()
    if launcher is None:
        return False
    import tensorflow as tf

    with _LOCK:
        if _WAIT is None:
            # Local, outside any strategy: one per process.
            with tf.init_scope(), tf.device("/cpu:0"):
                _WAIT = tf.Variable(
                    0.0, dtype=tf.float64, trainable=False, name="wait"
                )
                _COUNT = tf.Variable(
                    0, dtype=tf.int64, trainable=False, name="count"
                )
        if _USERS == 0:
            for name in ("all_reduce", "_all_gather"):
                original = getattr(launcher, name)
                _INSTALLED[name] = original
                setattr(launcher, name, _timed(original))
        _USERS += 1
    return True


def uninstall() -> None:
    """Undo one `install()`; the hook goes when the last user leaves."""
    global _USERS
    with _LOCK:
        if _USERS == 0:
            return
        _USERS -= 1
        if _USERS == 0:
            launcher = _launcher_class()
            for name, original in _INSTALLED.items():
                setattr(launcher, name, original)
            _INSTALLED.clear()


def read() -> tuple[float, int]:
    """(seconds waited, collectives timed) since the process started."""
    if _WAIT is None:
        return 0.0, 0
    return float(_WAIT.numpy()), int(_COUNT.numpy())
