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

import itertools
import sys
import threading
import types
from typing import Any

_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}
# Each user of the hook: token -> (thread id, id of its frame, frame code)
# or None (no frame to watch). Ids, not frames: a frame kept alive would
# keep the whole `fit` call (model, data) alive after it raised.
_USERS: dict[int, tuple[int, int, Any] | None] = {}
_TOKENS = itertools.count(1)
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
        if not _live():  # every user left without uninstalling (it raised)
            return original(self, input_tensor, *args, **kwargs)
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


def install(watch_frame: types.FrameType | None = None) -> int | None:
    """Time every collective traced from now on.

    Returns a token for `uninstall`, or None when this TensorFlow has no
    hook. The hook stays while a user holds a token. `watch_frame` (the
    frame of the `fit` call, `monitoring.sampler.training_frame()`) ends
    the user's hold by itself once that frame has left its thread's stack:
    Keras calls no `on_train_end` when `fit` raises, so without it the hook
    would outlive the run. That is checked whenever the hook is used (a
    collective traced), installed or read.
    """
    global _WAIT, _COUNT
    launcher = _launcher_class()
    if launcher is None:
        return None
    import tensorflow as tf

    with _LOCK:
        _prune()
        if _WAIT is None:
            # Local, outside any strategy: one per process.
            with tf.init_scope(), tf.device("/cpu:0"):
                _WAIT = tf.Variable(
                    0.0, dtype=tf.float64, trainable=False, name="wait"
                )
                _COUNT = tf.Variable(
                    0, dtype=tf.int64, trainable=False, name="count"
                )
        if not _INSTALLED:
            for name in ("all_reduce", "_all_gather"):
                original = getattr(launcher, name)
                _INSTALLED[name] = original
                setattr(launcher, name, _timed(original))
        token = next(_TOKENS)
        _USERS[token] = (
            None
            if watch_frame is None
            else (
                threading.get_ident(),
                id(watch_frame),
                watch_frame.f_code,
            )
        )
    return token


def uninstall(token: int | None) -> None:
    """Drop the hold of `token` (from `install`; None and tokens already
    dropped are ignored); the hook goes when no user is left."""
    with _LOCK:
        _USERS.pop(token, None)
        _prune()


def installed() -> bool:
    """Whether the hook is in place (after dropping users that are gone)."""
    with _LOCK:
        _prune()
        return bool(_INSTALLED)


def _frame_alive(thread_id: int, frame_id: int, code: Any) -> bool:
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if id(frame) == frame_id and frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _prune() -> None:
    """Forget users whose frame is gone; restore TensorFlow's launcher when
    none is left. Call with `_LOCK` held."""
    for token, owner in list(_USERS.items()):
        if owner is not None and not _frame_alive(*owner):
            del _USERS[token]
    if not _USERS and _INSTALLED:
        launcher = _launcher_class()
        for name, original in _INSTALLED.items():
            setattr(launcher, name, original)
        _INSTALLED.clear()


def _live() -> bool:
    with _LOCK:
        _prune()
        return bool(_USERS)


def read() -> tuple[float, int]:
    """(seconds waited, collectives timed) since the process started."""
    if _WAIT is None:
        return 0.0, 0
    return float(_WAIT.numpy()), int(_COUNT.numpy())
