"""`WorkerWatchdog`: a lost or stalled worker makes the others fail, in
bounded time, with an error that names it."""

from __future__ import annotations

import threading
import time
from typing import Any

from keras_mgpu._flavour import callback_bases
from keras_mgpu._validation import check_number
from keras_mgpu.monitoring.notices import Notices
from keras_mgpu.monitoring.sampler import _frame_on_stack, training_frame


class WorkerWatchdog(*callback_bases()):
    """Fail every surviving worker, within `timeout` seconds, when a worker
    of a `MultiWorkerMirroredStrategy` cluster dies or stalls, with an error
    that names the missing worker and what it was doing.

    In synchronous multi-worker training a worker that is killed, frozen or
    stuck (in a data generator, a callback, a deadlock) leaves the others
    waiting in their next collective, possibly forever: TensorFlow detects a
    dead process after a while, with an error that names nobody, and never
    detects a live but stalled one. This callback runs a small thread on
    every worker that

    - publishes, every `heartbeat_interval` seconds, what this worker does
      (the step it is in, whether its training thread is inside TensorFlow
      or in Python, and where) to TensorFlow's coordination service, the
      key-value store every `MultiWorkerMirroredStrategy` worker already
      shares;
    - when its own training thread has been inside one step for `timeout`
      seconds, or a peer's heartbeat stopped for `3 x heartbeat_interval`
      (at least 5 s) while this worker waits, reads its peers' status and
      aborts this worker's collectives with a message such as "worker 1
      (host:port): stalled in Python for 31 s at data.py:40 in
      __getitem__ (step 12)". `fit` then raises
      `tf.errors.UnavailableError` carrying that message, so the launcher
      (Slurm, Kubernetes, Ray) restarts the job, and `BackupAndRestore`
      resumes it.

    A killed worker may also be caught first by TensorFlow's own peer
    health check (`MultiWorkerMirroredStrategy` pings every peer every 30 s):
    the error then reads "cluster check alive failed,
    /job:worker/replica:0/task:1 is down", naming the task as well. A
    stalled worker answers those pings: only this callback names it.

    Outside multi-worker training it does nothing. It reads no tensor and
    adds no collective: its cost is one key-value write per heartbeat and a
    Python frame lookup. `timeout` must exceed the longest legitimate step
    (including the first one, which traces the graph, and a validation
    pass).

    Args:
        timeout: float > 0, seconds a step may wait before the peers are
            examined and training is aborted. Defaults to 300.
        heartbeat_interval: float > 0, seconds between status updates.
            Defaults to 1.0.

    Example:

    ```python
    keras_mgpu.distribute.enable_multi_worker_fit()
    model.fit(dataset, epochs=10, callbacks=[
        keras_mgpu.callbacks.WorkerWatchdog(timeout=120),
        keras_mgpu.callbacks.BackupAndRestore("/shared/backup"),
    ])
    ```
    """

    def __init__(
        self, timeout: float = 300.0, heartbeat_interval: float = 1.0
    ) -> None:
        super().__init__()
        self.timeout = check_number(
            timeout, "timeout", minimum=0.0, exclusive_minimum=True
        )
        self.heartbeat_interval = check_number(
            heartbeat_interval,
            "heartbeat_interval",
            minimum=0.0,
            exclusive_minimum=True,
        )
        if self.heartbeat_interval >= self.timeout:
            raise ValueError(
                "Argument `heartbeat_interval` must be smaller than "
                f"`timeout`. Received: heartbeat_interval={heartbeat_interval}"
                f", timeout={timeout}"
            )
        self.stale_after = max(3.0 * self.heartbeat_interval, 5.0)
        self.report: str | None = None  # the message of the last abort
        self._notices = Notices()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._status: Any = None
        self._step = 0
        self._in_step = False
        self._phase_since = time.time()

    # ------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        self.stop()
        from keras_mgpu.distribute.strategy import is_multi_worker, worker_info
        from keras_mgpu.distribute.worker_status import WorkerStatus

        strategy = getattr(self.model, "distribute_strategy", None)
        if strategy is None or not is_multi_worker(strategy):
            return
        info = worker_info(strategy)
        task = int(info["rank"] or 0)
        self._status = WorkerStatus(
            task, int(info["num_workers"]), _address(strategy, task)
        )
        self.report = None
        self._step = 0
        self._in_step = False
        self._phase_since = time.time()
        self._stop = threading.Event()
        owner = (threading.get_ident(), training_frame())
        self._publish(owner[0])  # peers can read us from the start
        self._thread = threading.Thread(
            target=self._run,
            args=(self._stop, owner),
            name="keras_mgpu-watchdog",
            daemon=True,
        )
        self._thread.start()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None):
        self._step += 1
        self._in_step, self._phase_since = True, time.time()

    def on_train_batch_end(self, batch: int, logs: dict | None = None):
        self._in_step, self._phase_since = False, time.time()

    def on_train_end(self, logs: dict | None = None) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the watchdog thread (idempotent)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.heartbeat_interval + 6.0)
        self._thread = None
        if self._status is not None:
            self._status.close()
            self._status = None

    # ------------------------------------------------------------------
    def _own_status(self, thread_id: int) -> dict:
        from keras_mgpu.distribute.worker_status import describe_frame

        in_tensorflow, where = describe_frame(thread_id)
        in_step = self._in_step
        return {
            "task_id": self._status.task_id,
            "step": self._step,
            "in_step": in_step,
            "in_tensorflow": in_tensorflow and in_step,
            "where": where,
            "since": self._phase_since,
            "beat": time.time(),
        }

    def _publish(self, thread_id: int) -> dict:
        own = self._own_status(thread_id)
        try:
            self._status.publish(own)
        except Exception:  # the chief's store is gone: peers notice us
            pass
        return own

    def _run(self, stop: threading.Event, owner: tuple) -> None:
        thread_id, frame = owner
        try:
            while not stop.wait(self.heartbeat_interval):
                if frame is not None and not _frame_on_stack(thread_id, frame):
                    return  # fit raised: Keras calls no on_train_end
                own = self._publish(thread_id)
                if own["in_step"] and self._should_abort(own):
                    return
        finally:
            frame = owner = None

    def _should_abort(self, own: dict) -> bool:
        """Examine the peers once this step has lasted `stale_after`; abort
        this worker's collectives if one is gone, or the wait passed
        `timeout`."""
        from keras_mgpu.distribute.worker_status import (
            abort_collectives,
            missing_workers_message,
            peer_is_gone,
        )

        waited = time.time() - float(own["since"])
        if waited < self.stale_after:
            return False
        peers = {
            task: self._status.read(task)
            for task in range(self._status.num_workers)
            if task != self._status.task_id
        }
        gone = any(peer_is_gone(s, self.stale_after) for s in peers.values())
        if waited < self.timeout and not gone:
            return False
        self.report = missing_workers_message(
            own, peers, waited, self.stale_after
        )
        abort_collectives(self.report)
        return True


def _address(strategy: Any, rank: int) -> str:
    """This worker's task and address ("chief:0 (host:port)")."""
    from keras_mgpu.distribute.strategy import member_names

    names = member_names(strategy)
    return names[rank] if rank < len(names) else ""
