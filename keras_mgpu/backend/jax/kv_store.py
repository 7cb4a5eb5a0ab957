"""JAX's distributed key-value store: the one place keras_mgpu reaches the
private client of `jax.distributed`.

`jax.distributed.initialize()` (through `keras_mgpu.distribute.
start_cluster()` or `keras.distribution.initialize()`) starts a coordination
service on process 0 and connects every process to it. Its client keeps a
key-value store every process reads and writes without any collective: a
process blocked in a gloo all-reduce never delays another's key-value call.
`WorkerWatchdog` publishes each process's status there.

JAX exports no public API for it (jax 0.10.2): the client is
`jax._src.distributed.global_state.client`, an `xla` `DistributedRuntimeClient`
with `key_value_set(key, value, allow_overwrite=False)`,
`key_value_try_get(key)` (raises NOT_FOUND at once for a missing key),
`blocking_key_value_get(key, timeout_in_ms)`, `key_value_dir_get(prefix)` and
`key_value_delete(key)` (a key or a whole folder). `client()` checks each of
them, and `allow_overwrite`, and refuses clearly when a JAX release changes
them (tests/distribute/test_jax_monitors_jax.py fails then too).
"""

from __future__ import annotations

from typing import Any

#: The client methods keras_mgpu calls, and a fragment of each one's
#: signature as pybind11 documents it (jax 0.10.2).
REQUIRED_METHODS = {
    "key_value_set": "allow_overwrite: bool",
    "key_value_try_get": "key: str",
    "blocking_key_value_get": "timeout_in_ms: int",
    "key_value_dir_get": "key: str",
    "key_value_delete": "key: str",
}
CHECKED_WITH = "jax 0.10.2"


class KeyValueStoreUnavailable(RuntimeError):
    """JAX's distributed key-value store cannot be used in this process."""


def missing_methods(client_type: Any) -> list[str]:
    """The required methods `client_type` lacks or whose signature changed
    (empty when it has them all)."""
    missing = []
    for name, fragment in REQUIRED_METHODS.items():
        method = getattr(client_type, name, None)
        if not callable(method) or fragment not in (method.__doc__ or ""):
            missing.append(name)
    return missing


def client() -> Any:
    """The key-value client of `jax.distributed` in this process.

    Raises:
        KeyValueStoreUnavailable: `jax.distributed` is not initialized, or
            this JAX keeps its client elsewhere or changed its methods.
    """
    import jax

    try:
        from jax._src import distributed
    except ImportError as exc:  # a JAX that moved the module
        raise _changed(
            jax.__version__, f"no jax._src.distributed ({exc})"
        ) from exc
    state = getattr(distributed, "global_state", None)
    if state is None or not hasattr(state, "client"):
        raise _changed(
            jax.__version__, "no jax._src.distributed.global_state.client"
        )
    found = state.client
    if found is None:
        raise KeyValueStoreUnavailable(
            "JAX's distributed key-value store needs jax.distributed: call "
            "keras_mgpu.distribute.start_cluster() (or "
            "keras.distribution.initialize()) first in every process."
        )
    missing = missing_methods(type(found))
    if missing:
        raise _changed(
            jax.__version__,
            f"its client lacks (or changed) {', '.join(missing)}",
        )
    return found


def _changed(version: str, what: str) -> KeyValueStoreUnavailable:
    return KeyValueStoreUnavailable(
        f"This JAX ({version}) does not offer the distributed key-value "
        f"store keras_mgpu uses (checked with {CHECKED_WITH}): {what}. "
        "Use the JAX release keras_mgpu supports, or leave WorkerWatchdog "
        "out (JAX's own heartbeat, start_cluster(heartbeat_timeout=...), "
        "still stops the processes when one dies)."
    )


def _is_missing_key(exc: BaseException) -> bool:
    text = str(exc)
    return text.startswith(("NOT_FOUND", "DEADLINE_EXCEEDED"))


class JaxKeyValueStore:
    """`WorkerStatus`'s store on JAX: set (overwriting), get, delete.

    Args:
        kv_client: the client to use; defaults to `client()`.
    """

    service = "JAX's distributed service"
    host = "on process 0"

    def __init__(self, kv_client: Any = None) -> None:
        self._client = client() if kv_client is None else kv_client

    def set(self, key: str, value: str) -> None:
        """Set `key`, replacing any value."""
        self._client.key_value_set(key, value, allow_overwrite=True)

    def get(self, key: str, timeout: float) -> str | None:
        """The value of `key`, or None when it is not set (at once: a key
        is never waited for). Raises when the service fails."""
        del timeout  # try_get answers at once
        try:
            return self._client.key_value_try_get(key)
        except Exception as exc:
            if _is_missing_key(exc):
                return None
            raise

    def delete(self, key: str) -> None:
        """Delete `key`, or every key under the folder `key`; nothing when
        there is none."""
        try:
            self._client.key_value_delete(key)
        except Exception as exc:
            if not _is_missing_key(exc):
                raise

    def items(self, folder: str) -> list[tuple[str, str]]:
        """Every `(key, value)` under `folder`."""
        return list(self._client.key_value_dir_get(folder))
