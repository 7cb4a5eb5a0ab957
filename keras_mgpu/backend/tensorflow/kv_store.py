"""TensorFlow's coordination-service key-value store and collective abort:
what `WorkerWatchdog` needs from TensorFlow.

`MultiWorkerMirroredStrategy` starts TensorFlow's coordination service (a
key-value store on the chief) in every collective member. The calls are
TensorFlow's private eager context methods (TF 2.16-2.21):
`set_config_key_value`, `get_config_key_value`, `delete_config_key_value`,
`abort_collective_ops`. The context is looked up at each call.
"""

from __future__ import annotations


def _context():
    from tensorflow.python.eager import context

    return context.context()


def _is_missing_key(exc: BaseException) -> bool:
    import tensorflow as tf

    return isinstance(
        exc, (tf.errors.NotFoundError, tf.errors.DeadlineExceededError)
    )


class TFKeyValueStore:
    """`WorkerStatus`'s store on TensorFlow: set, get, delete."""

    service = "the coordination service"
    host = "on the chief"

    def set(self, key: str, value: str) -> None:
        """Set `key`, replacing any value. The store does not overwrite: a
        delete, then a set (`WorkerStatus` writes two slots in turn, so a
        reader never finds neither)."""
        ctx = _context()
        try:
            ctx.delete_config_key_value(key)
        except Exception:  # not set: nothing to delete
            pass
        ctx.set_config_key_value(key, value)

    def get(self, key: str, timeout: float) -> str | None:
        """The value of `key`, or None when it is not set within `timeout`
        seconds. Raises when the service fails."""
        try:
            return _context().get_config_key_value(
                key, max(int(timeout * 1000), 1)
            )
        except Exception as exc:
            if _is_missing_key(exc):
                return None
            raise

    def delete(self, key: str) -> None:
        """Delete `key` (a folder deletes its keys); nothing when unset."""
        try:
            _context().delete_config_key_value(key)
        except Exception:  # gone already
            pass


def abort_collectives(message: str) -> None:
    """Make this process's pending and future collectives fail with
    `message` (TensorFlow's own health check does the same): `fit` raises
    `tf.errors.UnavailableError` carrying it."""
    import tensorflow as tf

    _context().abort_collective_ops(tf.errors.UNAVAILABLE, message)
