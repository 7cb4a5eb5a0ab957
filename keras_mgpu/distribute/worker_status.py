"""What each worker of a cluster is doing, shared through TensorFlow's
coordination service, and the message that names a missing worker.

`MultiWorkerMirroredStrategy` starts TensorFlow's coordination service (a
key-value store on the chief) in every worker. A `WorkerStatus` publishes
this worker's phase there (`step` n inside TensorFlow, or in Python at a
file and line) with a wall-clock heartbeat, reads its peers', and describes
which of them are missing when this worker has waited too long.

The key-value calls and collective abort are TensorFlow's private eager
context methods (TF 2.16-2.21): `set_config_key_value`,
`get_config_key_value`, `delete_config_key_value`, `abort_collective_ops`.
Every call runs with a time limit, so a dead chief (which hosts the store)
cannot hang the caller.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import sys
import threading
import time
from typing import Any

_KEY_PREFIX = "keras_mgpu/worker_status"
_TENSORFLOW_PATH = os.sep + "tensorflow" + os.sep


def describe_frame(thread_id: int) -> tuple[bool, str]:
    """(inside TensorFlow?, where) for the thread's innermost Python frame.

    A training thread blocked in a collective or computing a step sits in
    TensorFlow's Python bindings; one stuck in a callback, a Python data
    generator or user code sits elsewhere, and that place is named.
    """
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return False, "thread ended"
    code = frame.f_code
    inside = _TENSORFLOW_PATH in code.co_filename
    return inside, f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


class WorkerStatus:
    """This worker's status in the coordination service, and its peers'.

    Args:
        task_id: int, this worker's index.
        num_workers: int, workers in the cluster.
        address: str, this worker's address (for messages).
        kv_timeout: float, seconds any key-value call may take.
    """

    def __init__(
        self,
        task_id: int,
        num_workers: int,
        address: str = "",
        kv_timeout: float = 5.0,
    ) -> None:
        self.task_id = task_id
        self.num_workers = num_workers
        self.address = address or socket.gethostname()
        self.kv_timeout = kv_timeout
        # One thread runs every key-value call, so a call stuck on a dead
        # chief never blocks the caller beyond `kv_timeout`.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="keras_mgpu-kv"
        )
        self._lock = threading.Lock()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------
    def _call(self, function: Any, *args: Any) -> Any:
        future = self._executor.submit(function, *args)
        return future.result(timeout=self.kv_timeout)

    @staticmethod
    def _key(task_id: int) -> str:
        return f"{_KEY_PREFIX}/{task_id}"

    def publish(self, status: dict) -> None:
        """Replace this worker's status (the store does not overwrite)."""
        from tensorflow.python.eager import context

        ctx = context.context()
        key = self._key(self.task_id)
        value = json.dumps({**status, "address": self.address})

        def write():
            try:
                ctx.delete_config_key_value(key)
            except Exception:  # first publication: nothing to delete
                pass
            ctx.set_config_key_value(key, value)

        with self._lock:
            self._call(write)

    def read(self, task_id: int) -> dict | None:
        """A peer's last published status, or None (never published, or
        the store did not answer in time)."""
        from tensorflow.python.eager import context

        ctx = context.context()
        timeout_ms = int(self.kv_timeout * 500)
        try:
            text = self._call(
                ctx.get_config_key_value, self._key(task_id), timeout_ms
            )
        except Exception:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return None


def peer_is_gone(status: dict | None, stale_after: float) -> bool:
    """No status, or no heartbeat for `stale_after` seconds."""
    if status is None:
        return True
    return time.time() - float(status.get("beat", 0.0)) > stale_after


def describe_peer(
    task_id: int, status: dict | None, own_step: int, stale_after: float
) -> tuple[bool, str]:
    """(missing?, one line) for a peer seen while this worker waits."""
    now = time.time()
    name = f"worker {task_id}"
    if status is None:
        return True, (
            f"{name}: no status in the coordination service (never started "
            "training, or the chief that hosts the service is gone)"
        )
    name += f" ({status.get('address', '?')})"
    age = now - float(status.get("beat", 0.0))
    phase_for = now - float(status.get("since", now))
    if peer_is_gone(status, stale_after):
        return True, (
            f"{name}: no heartbeat for {age:.0f} s (process killed, "
            "crashed or frozen)"
        )
    step = int(status.get("step", -1))
    if not status.get("in_tensorflow", False):
        when = (
            f"in step {step}"
            if status.get("in_step")
            else (f"after step {step}")
        )
        return True, (
            f"{name}: stalled in Python for {phase_for:.0f} s at "
            f"{status.get('where', '?')} ({when})"
        )
    if step < own_step:
        return True, f"{name}: behind, still in step {step}"
    return False, (
        f"{name}: in step {step} inside TensorFlow for {phase_for:.0f} s "
        "(waiting too, or stuck computing)"
    )


def missing_workers_message(
    own: dict,
    peers: dict[int, dict | None],
    waited: float,
    stale_after: float,
) -> str:
    """The error message of a worker that waited `waited` s for its peers."""
    step = int(own.get("step", -1))
    lines = [
        describe_peer(task, status, step, stale_after)
        for task, status in sorted(peers.items())
    ]
    missing = [text for is_missing, text in lines if is_missing]
    shown = missing or [text for _, text in lines]
    head = (
        f"keras_mgpu WorkerWatchdog: worker {own.get('task_id')} waited "
        f"{waited:.0f} s in step {step} for "
        + ("missing worker(s)" if missing else "its peers (none is missing")
        + ("" if missing else "; a collective may be stuck)")
        + ": "
    )
    return (
        head
        + "; ".join(shown)
        + ". Restart every worker of the job: training resumes from the "
        "last BackupAndRestore backup."
    )


def abort_collectives(message: str) -> None:
    """Make this process's pending and future collectives fail with
    `message` (TensorFlow's own health check does the same)."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)
