"""`WorkerWatchdog`: a lost or stalled worker makes the others fail, in
bounded time, with an error that names it."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from keras_mgpu import backend
from keras_mgpu._flavour import callback_bases
from keras_mgpu._frames import frame_on_stack
from keras_mgpu._validation import check_number
from keras_mgpu.backend import require_backend
from keras_mgpu.monitoring.notices import Notices
from keras_mgpu.monitoring.sampler import training_frame


class WorkerWatchdog(*callback_bases()):
    """Fail every surviving worker, within `timeout` seconds, when a worker
    of a `MultiWorkerMirroredStrategy` cluster (or a process of a JAX
    cluster) dies or stalls, with an error
    that names the missing task and what it was doing.

    In synchronous multi-worker training a worker that is killed, frozen or
    stuck (in a data generator, a callback, a deadlock) leaves the others
    waiting in their next collective, possibly forever: TensorFlow detects a
    dead process after a while, with an error that names a task, and never
    detects a live but stalled one. This callback watches `fit` (its
    validation passes included), and `evaluate` and `predict` when passed
    to them. On every worker it runs two small threads:

    - a heartbeat, which publishes every `heartbeat_interval` seconds what
      this worker does (the train, validation, evaluate or predict step it
      is in, whether its thread is inside TensorFlow or in Python, and
      where) to TensorFlow's coordination service, the key-value store
      every `MultiWorkerMirroredStrategy` worker already shares;
    - a checker, which reads the peers' status while this worker is blocked
      in TensorFlow (a step, or a collective in a callback) and aborts this
      worker's collectives when a peer is gone: its heartbeat stopped for
      `stale_after` seconds (`3 x heartbeat_interval`, at least 5 s, at
      most `timeout`), it left the run (its call raised, or it aborted), or
      it never showed up within `timeout` seconds of this worker's start;
      or when this worker has waited `timeout` seconds. The message reads,
      e.g., "keras_mgpu WorkerWatchdog: chief:0 (host:port) waited 31 s in
      validation step 3 (epoch 1) for missing worker(s): worker:1
      (host:port): stalled in Python for 31 s at data.py:40 in __getitem__
      (after validation step 2 (epoch 1))". `fit` then raises
      `tf.errors.UnavailableError` carrying it, so the launcher (Slurm,
      Kubernetes, Ray) restarts the job, and `BackupAndRestore` resumes it.

    A worker slower to start than its peers (a long dataset build, a
    callback listed before this one) is waited for up to `timeout` seconds.
    Reading peers never delays this worker's own heartbeat. Each run (each
    `fit`, `evaluate` or `predict` call) uses keys of its own, deleted when
    it ends, so an earlier run's status is never read as live; the n-th run
    of every worker is the same run (the workers run the same program).
    Tasks are named as in `TF_CONFIG` ("chief:0", "worker:1") with their
    address. A killed worker may also be caught first by TensorFlow's
    coordination service, whose error names the task too
    ("/job:worker/replica:0/task:1"). On an `evaluator` task, outside
    multi-worker training, or on one machine it does nothing.

    **On Keras's JAX backend** it watches the processes of a
    `jax.distributed` cluster (`keras_mgpu.distribute.start_cluster()`,
    `DataParallel` over every process's devices) the same way, through
    JAX's distributed key-value store (the coordination service on
    process 0, `keras_mgpu.backend.jax.kv_store`), with the same message;
    processes are named "process:1", with host and process id once their
    first status is read ("process:1 (host, pid 4242)"). What differs is
    the end: no JAX or XLA call can make a gloo (or NCCL) collective that
    waits for a missing process return, so instead of raising, the process
    logs the message (logger "keras_mgpu", or stderr when logging is not
    configured) and exits at once with status 75 (`os._exit`;
    `keras_mgpu.backend.jax.processes.EXIT_CODE`), and the launcher
    restarts the job. Once process 0 exits, JAX's coordination service is
    gone and JAX ends every other process (SIGABRT, "Connection reset by
    peer"); a process that exits first is named "left the run" by its
    peers, which exit too. Without the watchdog the survivors of a killed
    process end when gloo notices (SIGABRT; at once in some runs) or when
    JAX's heartbeat declares it dead
    (`start_cluster(heartbeat_timeout=...)`, 60 s by default), and a
    stalled process is waited for forever. A SIGKILLed process may still
    end its peers through gloo before the watchdog names it. On one JAX
    process it does nothing.

    It reads no tensor and adds no collective: its cost is one key-value
    write per heartbeat, and reads of every peer only while this worker
    waits. Its batch hooks touch only host state (`async_safe`: Keras's
    asynchronous batch dispatch stays on).

    `timeout` must exceed the longest legitimate step (including
    the first one, which traces the graph) and any TensorFlow work a
    callback does between steps.

    Args:
        timeout: float > 0, seconds a step may wait before the peers are
            examined and training is aborted, and how late a peer may
            start. Defaults to 300.
        heartbeat_interval: float > 0, smaller than `timeout`, seconds
            between status updates. Defaults to 1.0.

    Example:

    ```python
    keras_mgpu.distribute.enable_multi_worker_fit()
    model.fit(dataset, epochs=10, validation_data=val, callbacks=[
        keras_mgpu.callbacks.WorkerWatchdog(timeout=120),
        keras_mgpu.callbacks.BackupAndRestore("/shared/backup"),
    ])
    ```
    """

    # Batch hooks read clocks and counters only (never `logs`).
    async_safe = True

    def __init__(
        self, *, timeout: float = 300.0, heartbeat_interval: float = 1.0
    ) -> None:
        require_backend("WorkerWatchdog")
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
        self.stale_after = min(
            max(3.0 * self.heartbeat_interval, 5.0), self.timeout
        )
        self.report: str | None = None  # the message of the last abort
        self._notices = Notices()
        self._run: _Run | None = None
        self._state = _initial_state()

    # ------------------------------------------------------------------
    # The calls Keras makes: `fit` (validation included), or `evaluate` /
    # `predict` called directly, each a run of its own.
    def on_train_begin(self, logs: dict | None = None) -> None:
        self._begin("fit")

    def on_train_end(self, logs: dict | None = None) -> None:
        self.stop()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._state["epoch"] = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None):
        self._state["train_steps"] += 1
        self._step_begin("train", self._state["train_steps"], batch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None):
        self._step_end("train", batch)

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._pass_begin("evaluate", "validation")

    def on_test_batch_begin(self, batch: int, logs: dict | None = None):
        self._step_begin(self._state["pass"], batch + 1, batch)

    def on_test_batch_end(self, batch: int, logs: dict | None = None):
        self._step_end(self._state["pass"], batch)

    def on_test_end(self, logs: dict | None = None) -> None:
        self._pass_end()

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._pass_begin("predict", "predict")

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None):
        self._step_begin("predict", batch + 1, batch)

    def on_predict_batch_end(self, batch: int, logs: dict | None = None):
        self._step_end("predict", batch)

    def on_predict_end(self, logs: dict | None = None) -> None:
        self._pass_end()

    def stop(self) -> None:
        """End the current run (idempotent): stop the threads and delete
        this worker's status."""
        run, self._run = self._run, None
        if run is not None:
            run.finish(remove=True)

    # ------------------------------------------------------------------
    def _begin(self, kind: str) -> None:
        from keras_mgpu.distribute.strategy import (
            is_multi_worker,
            member_names,
            worker_info,
        )
        from keras_mgpu.distribute.worker_status import WorkerStatus

        self.stop()
        self._state = _initial_state()
        self._state["phase"] = self._state["pass"] = (
            "train" if kind == "fit" else kind
        )
        if backend.is_jax():
            from keras_mgpu.backend.jax.processes import process_name

            info = worker_info()
            if info["num_workers"] < 2:
                return
            rank = int(info["rank"])
            names = [
                process_name(r, own=r == rank)
                for r in range(int(info["num_workers"]))
            ]
        else:
            strategy = getattr(self.model, "distribute_strategy", None)
            if strategy is None or not is_multi_worker(strategy):
                return
            info = worker_info(strategy)
            rank, names = int(info["rank"]), member_names(strategy)
        # The n-th watched run of each process is the same run on every
        # worker (they run the same program): its keys are apart from any
        # earlier run's, whose statuses may linger.
        status = WorkerStatus(rank, names, f"run{next(_RUNS)}")
        self.report = None
        self._run = _Run(
            self, kind, status, threading.get_ident(), training_frame()
        )

    def _pass_begin(self, kind: str, within_fit: str) -> None:
        if self._run is not None and self._run.kind == "fit":
            self._state["pass"] = within_fit  # validation inside `fit`
            self._state["phase"] = within_fit
            self._state["since"] = time.monotonic()
        else:
            self._begin(kind)

    def _pass_end(self) -> None:
        if self._run is not None and self._run.kind == "fit":
            self._state["pass"] = self._state["phase"] = "train"
            self._state["step"] = self._state["train_steps"]
            self._state["since"] = time.monotonic()
        else:
            self.stop()

    def _step_begin(self, phase: str, step: int, batch: int) -> None:
        state = self._state
        state["progress"] += 1
        state["phase"], state["step"], state["batch"] = phase, step, batch
        state["in_step"], state["since"] = True, time.monotonic()

    def _step_end(self, phase: str, batch: int) -> None:
        # Under Keras's asynchronous dispatch (JAX) this end hook runs on
        # Keras's dispatch thread once the step's results are ready, maybe
        # after the next step began: it ends only the step it belongs to.
        # (With `steps_per_execution` an execution begins at its first batch
        # and ends at its last.)
        state = self._state
        if state["phase"] == phase and batch >= state["batch"]:
            state["in_step"] = False
            state["since"] = time.monotonic()


_RUNS = itertools.count()


def _initial_state() -> dict:
    return {
        "phase": "train",
        "pass": "train",
        "step": 0,
        "train_steps": 0,
        "epoch": 0,
        "progress": 0,
        "in_step": False,
        "batch": -1,
        "since": time.monotonic(),
    }


class _Run:
    """One watched run: a heartbeat thread that publishes this worker's
    status, and a checker thread that reads the peers' while this worker
    waits, and aborts its collectives when one is missing.

    Two threads: reading peers (up to a second per missing key, longer when
    the chief's store is gone) never delays this worker's heartbeat.
    """

    def __init__(
        self,
        owner: WorkerWatchdog,
        kind: str,
        status: Any,
        thread_id: int,
        frame: Any,
    ) -> None:
        self.kind = kind
        self.status = status
        self._owner = owner
        self._thread_id = thread_id
        self._frame = frame  # the `fit` (evaluate, predict) call's frame
        self._framework = "JAX" if backend.is_jax() else "TensorFlow"
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._ended: str | None = None
        self._threads = [
            threading.Thread(target=target, name=name, daemon=True)
            for target, name in (
                (self._heartbeats, "keras_mgpu-watchdog-heartbeat"),
                (self._check, "keras_mgpu-watchdog"),
            )
        ]
        for thread in self._threads:
            thread.start()

    def finish(self, remove: bool) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.status.kv_timeout + 2.0)
        if remove:
            self.status.remove()
        self.status.close()
        self._frame = None

    def _call_ended(self) -> bool:
        """Whether the watched call has left its thread (it raised: Keras
        then calls no on_train_end / on_test_end / on_predict_end)."""
        frame = self._frame
        return frame is not None and not frame_on_stack(self._thread_id, frame)

    def own_status(self, seq: int) -> dict:
        from keras_mgpu.distribute.worker_status import describe_frame

        state = dict(self._owner._state)
        in_tensorflow, where = describe_frame(self._thread_id)
        return {
            "name": self.status.name,
            "seq": seq,
            "phase": state["phase"],
            "step": state["step"],
            "epoch": state["epoch"],
            "progress": state["progress"],
            "in_step": state["in_step"],
            "in_tensorflow": in_tensorflow,
            "framework": self._framework,
            "where": where,
            "for": time.monotonic() - state["since"],
            "since": state["since"],
            "ended": self._ended,
        }

    def _publish(self, seq: int) -> None:
        try:
            self.status.publish(self.own_status(seq))
        except Exception:  # the chief's store is gone: peers notice us
            pass

    def _publish_final(self) -> None:
        """Publish the status that says why this worker leaves, retrying
        while a heartbeat's write is still under way (for up to 2 s)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.status.publish(self.own_status(-1))
                return
            except Exception:  # a write in flight, or the store is gone
                time.sleep(0.05)

    def _heartbeats(self) -> None:
        seq = 0
        while True:
            if self._ended is None and self._call_ended():
                self._ended = f"its {self.kind} call raised"
            seq += 1
            self._publish(seq)  # the first one at once: peers see us start
            if self._ended is not None:
                return  # the last status stays: peers learn why we left
            if self._stop.wait(self._owner.heartbeat_interval):
                return

    def _check(self) -> None:
        from keras_mgpu.distribute.worker_status import PeerRecord

        owner = self._owner
        records = {
            rank: PeerRecord(self.status.names[rank])
            for rank in self.status.peers
        }
        interval = owner.heartbeat_interval
        while not self._stop.wait(interval):
            if self._ended is not None or self._call_ended():
                return
            own = self.own_status(0)
            waited = float(own["for"])
            # Only a worker blocked in TensorFlow (a step, or a collective
            # in a callback) waits for its peers; one in its own Python
            # code is the slow one, and the peers name it.
            blocked = own["in_step"] or own["in_tensorflow"]
            if not blocked or waited < 2 * interval:
                continue
            for rank, (status, error) in self.status.read_peers().items():
                records[rank].observe(status, error, time.monotonic())
            now = time.monotonic()
            lines = [
                record.describe(
                    own,
                    now,
                    now - self._started,
                    owner.stale_after,
                    owner.timeout,
                    self.status.service,
                )
                for record in records.values()
            ]
            gone = any(kind == "gone" for kind, _ in lines)
            if not gone and waited < owner.timeout:
                continue
            self._abort(own, lines, waited)
            return

    def _abort(self, own: dict, lines: list, waited: float) -> None:
        from keras_mgpu.distribute.worker_status import (
            abort_collectives,
            missing_workers_message,
        )

        report = missing_workers_message(own, lines, waited)
        self._owner.report = report
        if backend.is_jax():
            from keras_mgpu.backend.jax.processes import EXIT_CODE, exit_process

            # Peers learn at once that we leave, and why; then this
            # process ends (nothing aborts a JAX collective).
            self._ended = (
                f"it exited with status {EXIT_CODE} after waiting "
                f"{waited:.0f} s"
            )
            self._publish_final()
            exit_process(report)
            return
        abort_collectives(report)
        # Peers waiting for us learn at once that we left, and why.
        self._ended = f"it aborted its collectives after waiting {waited:.0f} s"
