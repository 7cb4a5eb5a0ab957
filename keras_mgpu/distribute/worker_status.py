"""What each worker of a cluster is doing, shared through the cluster's
key-value store, and the message that names a missing worker.

Both backends' clusters keep a key-value store every process reaches
without a collective: TensorFlow's coordination service (on the chief of a
`MultiWorkerMirroredStrategy` cluster,
`keras_mgpu.backend.tensorflow.kv_store`) and JAX's distributed service (on
process 0 of a `jax.distributed` cluster, `keras_mgpu.backend.jax.kv_store`).
A `WorkerStatus` publishes this worker's phase there (a train, validation,
evaluate or predict step, inside the framework or in Python at a file and
line) with a heartbeat counter, and reads its peers'. Keys are namespaced by
run (each watched `fit`, `evaluate` or `predict` call), so a status left by
an earlier run is never read as live. `PeerRecord` follows one peer's
heartbeats by this worker's own clock (hosts' clocks may differ) and says
whether it is missing.

Every store call runs on a daemon thread with a time limit, so a dead
service cannot hang the caller; writes and reads use separate threads, so
reading peers never delays this worker's own heartbeat.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
import time
from typing import Any, Protocol

_KEY_PREFIX = "keras_mgpu/worker_status"
# Where a thread is "inside the framework": TensorFlow's or JAX's own
# Python code, or Keras's (both flavours) driving it; a thread elsewhere
# runs user code.
_FRAMEWORK_PATHS = tuple(
    os.sep + name + os.sep
    for name in ("tensorflow", "keras", "tf_keras", "jax", "jaxlib")
)
# Python's own library (threading, multiprocessing, ...): skipped when
# naming where a thread is.
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _is_stdlib(filename: str) -> bool:
    return filename.startswith("<frozen") or (
        filename.startswith(_STDLIB)
        and "site-packages" not in filename
        and "dist-packages" not in filename
    )


def describe_frame(thread_id: int) -> tuple[bool, str]:
    """(inside the framework?, where) for the thread's innermost frame
    outside Python's standard library.

    A training thread blocked in a collective or computing a step sits in
    TensorFlow's, JAX's (or Keras's) Python code, or below it in the standard
    library (an eager all-reduce waits on a `multiprocessing` thread pool);
    one stuck in a callback, a Python data generator or user code sits
    elsewhere, and that place is named.
    """
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return False, "thread ended"
    innermost = frame
    while frame is not None and _is_stdlib(frame.f_code.co_filename):
        frame = frame.f_back
    frame = frame or innermost
    code = frame.f_code
    inside = any(path in code.co_filename for path in _FRAMEWORK_PATHS)
    return inside, f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


class KeyValueStore(Protocol):
    """What `WorkerStatus` needs from a cluster's key-value store (one per
    backend, under `keras_mgpu/backend/<name>/kv_store.py`)."""

    service: str  # "the coordination service"
    host: str  # "on the chief"

    def set(self, key: str, value: str) -> None:
        """Set `key`, replacing any value."""

    def get(self, key: str, timeout: float) -> str | None:
        """The value of `key`, None when it is not set; raises when the
        store fails."""

    def delete(self, key: str) -> None:
        """Delete `key` or the folder `key`; nothing when there is none."""


def key_value_store() -> KeyValueStore:
    """The running backend's cluster store: TensorFlow's coordination
    service, or JAX's distributed service (raises
    `KeyValueStoreUnavailable` when this JAX lacks it)."""
    from keras_mgpu import backend

    if backend.is_jax():
        from keras_mgpu.backend.jax.kv_store import JaxKeyValueStore

        return JaxKeyValueStore()
    from keras_mgpu.backend.tensorflow.kv_store import TFKeyValueStore

    return TFKeyValueStore()


class WorkerStatus:
    """This worker's status in the cluster's key-value store, and its
    peers'.

    Args:
        rank: int, this worker's rank (`worker_info(strategy)["rank"]`).
        names: list of str, every member's name by rank
            (`member_names(strategy)`: "chief:0 (host:port)", ...;
            "process:1" on JAX).
        run: str, the run's namespace, the same on every worker.
        kv_timeout: float, seconds any key-value call may take.
        read_timeout: float, seconds a read waits for a key not (yet) set.
        store: the key-value store (`set`, `get`, `delete`, and `service`,
            `host` naming it); defaults to the running backend's
            (`key_value_store()`).
    """

    def __init__(
        self,
        rank: int,
        names: list[str],
        run: str,
        kv_timeout: float = 5.0,
        read_timeout: float = 1.0,
        store: KeyValueStore | None = None,
    ) -> None:
        self.rank = rank
        self.names = list(names)
        self.run = run
        self.kv_timeout = kv_timeout
        self.read_timeout = read_timeout
        self.store = key_value_store() if store is None else store
        # Each call runs on a daemon thread of its own, at most one at a
        # time per key: a read stuck on a missing key or a dead chief never
        # delays this worker's heartbeat, and a call that never returns
        # neither piles up nor holds the process at exit (a pool's
        # threads would be joined there).
        self._pending: dict[str, concurrent.futures.Future] = {}

    @property
    def name(self) -> str:
        return self.names[self.rank]

    @property
    def peers(self) -> list[int]:
        return [r for r in range(len(self.names)) if r != self.rank]

    def close(self) -> None:
        self._pending.clear()

    def _start(self, slot: str, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on a daemon thread; a Future. Raises
        `TimeoutError` while the previous call of `slot` still runs."""
        previous = self._pending.get(slot)
        if previous is not None and not previous.done():
            raise TimeoutError(f"the previous {slot} has not returned")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

        self._pending[slot] = future
        threading.Thread(target=run, name="keras_mgpu-kv", daemon=True).start()
        return future

    # ------------------------------------------------------------------
    def key(self, rank: int) -> str:
        """The folder of a worker's status keys (one per slot)."""
        return f"{_KEY_PREFIX}/{self.run}/{rank}"

    def slot_key(self, rank: int, slot: int) -> str:
        return f"{self.key(rank)}/{slot}"

    @property
    def service(self) -> str:
        """ "the coordination service (on the chief)", ..."""
        return f"{self.store.service} ({self.store.host})"

    def publish(self, status: dict) -> None:
        """Replace this worker's status. Raises when the store does not
        answer within `kv_timeout`.

        TensorFlow's store does not overwrite a key, so a status is written
        as a delete and a set; done on one key, a worker killed in between
        would leave no status, which reads as "finished the run". Two
        slots are written in turn instead (on both backends: one scheme),
        each status numbered: the slot not being written holds the previous
        status, and readers take the newer of the two (the first
        publication fills both)."""
        store = self.store
        self._version = getattr(self, "_version", 0) + 1
        version = self._version
        value = json.dumps({**status, "name": self.name, "version": version})
        slots = (0, 1) if version == 1 else (version % 2,)
        keys = [self.slot_key(self.rank, slot) for slot in slots]

        def write():
            for key in keys:
                store.set(key, value)

        self._start("write", write).result(timeout=self.kv_timeout)

    def remove(self) -> None:
        """Delete this worker's status (the run ended normally): the
        folder of its slots (the store deletes a folder's keys at once),
        then each slot in case it does not."""
        store = self.store
        keys = [self.key(self.rank)] + [
            self.slot_key(self.rank, slot) for slot in (0, 1)
        ]

        def delete():
            for key in keys:
                try:
                    store.delete(key)
                except Exception:  # gone already
                    pass

        try:
            self._start("delete", delete).result(timeout=self.kv_timeout)
        except Exception:  # the store is gone: nothing to do
            pass

    def read_peers(self) -> dict[int, tuple[dict | None, str | None]]:
        """Every peer's `(status, error)`, read in parallel: `(None, None)`
        for a peer without status, `(None, error)` when the store failed.
        Of a peer's two slots the newer status is taken."""
        futures: dict[tuple[int, int], Any] = {}
        answers: dict[int, list[tuple[dict | None, str | None]]] = {
            rank: [] for rank in self.peers
        }
        for rank in self.peers:
            for slot in (0, 1):
                try:
                    futures[rank, slot] = self._start(
                        f"read {rank}/{slot}",
                        self.store.get,
                        self.slot_key(rank, slot),
                        self.read_timeout,
                    )
                except TimeoutError as exc:
                    answers[rank].append((None, self._read_error(exc)))
        deadline = time.monotonic() + self.kv_timeout
        for (rank, _), future in futures.items():
            try:
                text = future.result(max(deadline - time.monotonic(), 0.01))
            except Exception as exc:
                answers[rank].append((None, self._read_error(exc)))
                continue
            if text is None:  # not set: no status
                answers[rank].append((None, None))
                continue
            try:
                answers[rank].append((json.loads(text), None))
            except ValueError:
                answers[rank].append((None, None))
        return {rank: _newest(found) for rank, found in answers.items()}

    def _read_error(self, exc: BaseException) -> str:
        """What went wrong reading the store."""
        if isinstance(exc, (TimeoutError, concurrent.futures.TimeoutError)):
            return f"{self.store.service} did not answer"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def _newest(
    answers: list[tuple[dict | None, str | None]],
) -> tuple[dict | None, str | None]:
    """A peer's status from its slots' answers: the newest status found;
    else the store's error, if any; else no status."""
    statuses = [status for status, _ in answers if status is not None]
    if statuses:
        return max(statuses, key=lambda s: int(s.get("version", 0))), None
    errors = [error for _, error in answers if error is not None]
    return None, (errors[0] if errors else None)


def where_in_run(status: dict) -> str:
    """ "train step 12", "validation step 2 (epoch 1)", ..."""
    phase = status.get("phase", "train")
    text = f"{phase} step {status.get('step', '?')}"
    if phase == "validation":
        text += f" (epoch {status.get('epoch', '?')})"
    return text


def when_in_run(status: dict) -> str:
    """ "in train step 12", "after predict step 1", "before the first
    train step"."""
    if status.get("in_step"):
        return "in " + where_in_run(status)
    if not status.get("step"):
        return f"before the first {status.get('phase', 'train')} step"
    return "after " + where_in_run(status)


class PeerRecord:
    """One peer as this worker has seen it in this run.

    Heartbeats are judged by this worker's clock: the peer's counter `seq`
    must change within `stale_after` seconds.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.status: dict | None = None
        self.seen = False
        self.absent = True  # the last read found no status
        self.error: str | None = None
        self._seq: Any = None
        self._changed_at: float | None = None
        self._failing_since: float | None = None

    def observe(
        self, status: dict | None, error: str | None, now: float
    ) -> None:
        """Record one read (`now`: `time.monotonic()`)."""
        self.error = error
        if error is not None:
            if self._failing_since is None:
                self._failing_since = now
            return
        self._failing_since = None
        self.absent = status is None
        if status is None:
            return
        self.status = status
        self.seen = True
        # The peer's own name may say more (on JAX: its host and pid).
        self.name = str(status.get("name") or self.name)
        if status.get("seq") != self._seq:
            self._seq, self._changed_at = status.get("seq"), now

    def silent_for(self, now: float) -> float:
        """Seconds since the peer's heartbeat last changed (0 if never)."""
        return 0.0 if self._changed_at is None else now - self._changed_at

    def failing_for(self, now: float) -> float:
        """Seconds the store has failed to answer about this peer."""
        return 0.0 if self._failing_since is None else now - self._failing_since

    def describe(
        self,
        own: dict,
        now: float,
        run_age: float,
        stale_after: float,
        grace: float,
        service: str = "the coordination service (on the chief)",
    ) -> tuple[str, str]:
        """(verdict, one line) while this worker waits in a step.

        The verdict is "gone" (killed, frozen, left the run, never came:
        abort now), "suspect" (alive but not where this worker waits: it is
        named if the wait reaches the timeout) or "ok". `run_age`: seconds
        since this worker began the run; a peer without status is gone only
        after `grace` of them (a slow but healthy start: a long dataset
        build, a slow callback listed before the watchdog). `service`: the
        store that keeps the statuses, and where (`WorkerStatus.service`).
        """
        name = self.name
        host = host_of(service)
        if self.failing_for(now) > stale_after:
            return "gone", (
                f"{name}: unknown, {service} has not answered for "
                f"{self.failing_for(now):.0f} s ({self.error}; "
                f"{host.removeprefix('the ')} killed?)"
            )
        status = self.status
        if not self.seen:
            if run_age < grace:
                return "ok", f"{name}: not started yet"
            return "gone", (
                f"{name}: no status within {run_age:.0f} s of this worker's "
                f"start (never started this run, or {host} that hosts "
                f"{service[: service.rfind(' (on ')]} is gone)"
            )
        if status.get("ended"):
            return "gone", f"{name}: left the run ({status['ended']})"
        if self.absent:
            return "ok", f"{name}: finished the run"
        silent = self.silent_for(now)
        if silent > stale_after:
            return "gone", (
                f"{name}: no heartbeat for {silent:.0f} s (process killed, "
                "crashed or frozen)"
            )
        # As the peer measured it (its clock), at its last heartbeat.
        phase_for = float(status.get("for", 0.0))
        framework = status.get("framework", "TensorFlow")
        if not status.get("in_tensorflow", False):
            return "suspect", (
                f"{name}: stalled in Python for {phase_for:.0f} s at "
                f"{status.get('where', '?')} ({when_in_run(status)})"
            )
        if int(status.get("progress", 0)) < int(own.get("progress", 0)):
            return "suspect", (
                f"{name}: behind, still in {where_in_run(status)}"
            )
        return "ok", (
            f"{name}: in {where_in_run(status)} inside {framework} for "
            f"{phase_for:.0f} s (waiting too, or stuck computing)"
        )


def missing_workers_message(
    own: dict, lines: list[tuple[str, str]], waited: float
) -> str:
    """The error message of a worker that waited `waited` s for its peers
    (`lines`: each peer's `PeerRecord.describe`)."""
    missing = [text for verdict, text in lines if verdict != "ok"]
    shown = missing or [text for _, text in lines]
    head = (
        f"keras_mgpu WorkerWatchdog: {own.get('name', '?')} waited "
        f"{waited:.0f} s {when_in_run(own)} for "
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


def host_of(service: str) -> str:
    """ "the chief" from "the coordination service (on the chief)"."""
    start = service.rfind("(on ")
    return service[start + 4 : -1] if start >= 0 else "its host"


def abort_collectives(message: str) -> None:
    """TensorFlow: make this process's pending and future collectives fail
    with `message` (`keras_mgpu.backend.tensorflow.kv_store`)."""
    from keras_mgpu.backend.tensorflow.kv_store import abort_collectives

    abort_collectives(message)
