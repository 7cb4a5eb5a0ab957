"""`StragglerMonitor`: per-worker step time and the slowest worker, logged
on every worker of a multi-worker cluster (or every process of a JAX
cluster)."""

from __future__ import annotations

import math
import time
from typing import Any

from keras_mgpu import backend
from keras_mgpu._flavour import callback_bases
from keras_mgpu._validation import check_number
from keras_mgpu.backend import require_backend
from keras_mgpu.monitoring.notices import Notices
from keras_mgpu.monitoring.sampler import training_frame

GROUP = "workers"


class StragglerMonitor(*callback_bases()):
    """Logs every worker's time per step, the time it spent waiting for the
    others, and how much slower the slowest worker is.

    Under `MultiWorkerMirroredStrategy` the workers meet in every
    collective, so their wall-clock step times are all the same: the
    slowest worker sets the pace and the others wait for it. This monitor
    times those waits (two timestamps around each all-reduce and
    all-gather of the train step, see
    `keras_mgpu.distribute.collective_timing`) and at each epoch end adds
    to `logs`, on every worker (one small all-reduce gathers them):

    - `workers/w<k>_step_ms`: mean wall time per step on worker k;
    - `workers/w<k>_wait_ms`: mean time per step worker k waited in
      collectives (for the others, plus the transfer itself);
    - `workers/w<k>_busy_ms`: step minus wait, worker k's own work per step
      (compute, input pipeline, callbacks and any host work between steps);
    - `workers/step_time_ratio`: slowest busy / fastest busy (1.0 when
      balanced), and `workers/slowest`: the slowest worker's index.

    When the ratio exceeds `warn_ratio` a `MonitorWarning` names the
    slowest worker, once per `fit`. It needs the train function traced
    after `on_train_begin` (Keras does so at the first step of each
    `compile`); a function traced earlier shows NaN waits, with a warning.
    Outside multi-worker training (and on an `evaluator` task) it logs
    nothing (one warning). The timing hook it installs in TensorFlow goes
    at `on_train_end`, and also when `fit` raises (Keras then calls no
    `on_train_end`): the hook stops timing once the `fit` call has left
    the stack, and is removed at its next use.

    **On Keras's JAX backend** it runs across the processes of a
    `jax.distributed` cluster (`keras_mgpu.distribute.start_cluster()`,
    `DataParallel` over every process's devices), with the same keys (`k`
    the process index), gathered with one small `process_allgather` per
    epoch. The collectives run inside XLA's compiled step and cannot be
    timed apart from it, so the wait is derived: it times each step's
    batch fetch and the rest of the step (dispatch, computation, the wait
    in its collectives; `keras_mgpu.backend.jax.step_timing` wraps
    `model.train_function` for the `fit`), and since every process runs the
    same compiled step, `w<k>_wait_ms` is how much longer process k spent
    in the step than the process that spent least there (that one waited
    for nobody), and `w<k>_busy_ms` is its step time minus that wait (its
    batch fetch, callbacks and host work between steps, plus the step's
    own computation). A slow device, which makes the compiled step itself
    longer on one process, shows as a wait on every process and is not
    told apart. The wrapper goes at `on_train_end`, or at the next call of
    the train function after a `fit` that raised. On one JAX process it
    logs nothing (one warning).

    Args:
        warn_ratio: float > 1 or None, the `step_time_ratio` that triggers
            the warning. Defaults to 1.25; None turns it off.

    Example:

    ```python
    model.fit(dataset, epochs=5, callbacks=[
        keras_mgpu.callbacks.StragglerMonitor(),
        keras.callbacks.CSVLogger("run.csv"),
    ])
    ```
    """

    def __init__(self, *, warn_ratio: float | None = 1.25) -> None:
        require_backend("StragglerMonitor")
        super().__init__()
        self.warn_ratio = check_number(
            warn_ratio,
            "warn_ratio",
            minimum=1.0,
            exclusive_minimum=True,
            allow_none=True,
        )
        self._notices = Notices()
        self._strategy: Any = None
        self._token: int | None = None
        self._timer: Any = None  # JAX: the StepTimer of this fit
        self._noun = "worker"
        self.keys: list[str] = []

    # ------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        from keras_mgpu.distribute import collective_timing
        from keras_mgpu.distribute.strategy import is_multi_worker, worker_info

        self._notices.reset()
        self._release()
        self.keys = []
        if backend.is_jax():
            self._begin_jax()
            return
        strategy = getattr(self.model, "distribute_strategy", None)
        if strategy is None or not is_multi_worker(strategy):
            self._notices.warn(
                "not-multi-worker",
                "StragglerMonitor: needs MultiWorkerMirroredStrategy with "
                "several workers; it logs nothing here.",
            )
            return
        # Watching the `fit` frame drops the hook by itself when `fit`
        # raises (Keras then calls no on_train_end).
        self._token = collective_timing.install(watch_frame=training_frame())
        if self._token is None:
            self._notices.warn(
                "no-timer",
                "StragglerMonitor: this TensorFlow has no "
                "CollectiveReplicaLauncher to time; waits are NaN.",
            )
        info = worker_info(strategy)
        self._strategy = strategy
        self._local = max(len(strategy.extended.worker_devices), 1)
        self._set_keys(info)

    def _set_keys(self, info: dict) -> None:
        self._task = int(info["rank"] or 0)
        self._workers = int(info["num_workers"])
        names = ("step_ms", "wait_ms", "busy_ms")
        self.keys = [
            f"{GROUP}/w{w}_{n}" for w in range(self._workers) for n in names
        ] + [f"{GROUP}/step_time_ratio", f"{GROUP}/slowest"]

    def _begin_jax(self) -> None:
        from keras_mgpu.backend.jax.distribution import current_distribution
        from keras_mgpu.backend.jax.step_timing import StepTimer
        from keras_mgpu.distribute.strategy import worker_info

        info = worker_info()
        if info["num_workers"] < 2:
            self._notices.warn(
                "not-multi-worker",
                "StragglerMonitor: needs several JAX processes "
                "(keras_mgpu.distribute.start_cluster()); it logs nothing "
                "here.",
            )
            return
        timer = StepTimer()
        # Watching the `fit` frame removes the wrapper by itself when `fit`
        # raises (Keras then calls no on_train_end).
        if not timer.install(self.model, watch_frame=training_frame()):
            self._notices.warn(
                "no-timer",
                "StragglerMonitor: the model has no train function to time "
                "(not called from fit); it logs nothing.",
            )
            return
        self._timer = timer
        self._noun = "process"
        self._strategy = current_distribution()
        self._set_keys(info)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._steps = 0
        self._start = time.perf_counter()
        if self._timer is not None:
            self._timer.reset()
            return
        from keras_mgpu.distribute import collective_timing

        self._wait_start, self._count_start = collective_timing.read()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None):
        # Counted at the begin hook (on the training thread): an end hook
        # would switch off Keras's asynchronous batch dispatch.
        self._steps += 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is None or (self._strategy is None and self._timer is None):
            return
        own = self._own_figures()
        figures = self._gather(own)
        logs.update(figures)
        self._check(figures)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._release()

    # ------------------------------------------------------------------
    def _release(self) -> None:
        if self._timer is not None:
            from keras_mgpu.backend.jax.step_timing import uninstall

            self._timer.active = False
            uninstall(self.model)
            self._timer = None
        if self._token is not None:
            from keras_mgpu.distribute import collective_timing

            collective_timing.uninstall(self._token)
            self._token = None
        self._strategy = None

    def _own_figures(self) -> dict[str, float]:
        steps = max(self._steps, 1)
        wall = time.perf_counter() - self._start
        prefix = f"{GROUP}/w{self._task}_"
        if self._timer is not None:
            # JAX: the time in the step is gathered as the "wait" and
            # turned into the wait beyond the least-waiting process after
            # the exchange (`_gather`).
            timer = self._timer
            in_step = timer.in_step / timer.steps if timer.steps else math.nan
            return {
                prefix + "step_ms": 1000.0 * wall / steps,
                prefix + "wait_ms": 1000.0 * in_step,
                prefix + "busy_ms": math.nan,
            }
        from keras_mgpu.distribute import collective_timing

        wait, count = collective_timing.read()
        wait -= self._wait_start
        if count == self._count_start:
            wait = math.nan  # nothing timed: traced before the timer
            self._notices.warn(
                "untimed",
                "StragglerMonitor: no collective of this epoch was timed "
                "(the train function was traced before on_train_begin); "
                "waits are NaN. Compile the model again to retrace.",
            )
        # Each local replica timed its own (concurrent) collectives.
        wait /= self._local
        return {
            prefix + "step_ms": 1000.0 * wall / steps,
            prefix + "wait_ms": 1000.0 * wait / steps,
            prefix + "busy_ms": 1000.0 * (wall - wait) / steps,
        }

    def _gather(self, own: dict[str, float]) -> dict[str, float]:
        from keras_mgpu.monitoring.gather import gather_worker_figures

        gathered = gather_worker_figures(
            own, self._strategy, self._task, self._workers
        )
        if self._timer is not None:
            _waits_from_time_in_step(gathered, self._workers)
        busy = [gathered[f"{GROUP}/w{w}_busy_ms"] for w in range(self._workers)]
        if all(math.isfinite(b) and b > 0 for b in busy):
            slowest = max(range(self._workers), key=busy.__getitem__)
            ratio = busy[slowest] / min(busy)
        else:
            slowest, ratio = -1, math.nan
        gathered[f"{GROUP}/step_time_ratio"] = ratio
        gathered[f"{GROUP}/slowest"] = float(slowest)
        return gathered

    def _check(self, figures: dict[str, float]) -> None:
        ratio = figures[f"{GROUP}/step_time_ratio"]
        if self.warn_ratio is None or not ratio > self.warn_ratio:
            return
        slowest = int(figures[f"{GROUP}/slowest"])
        busy = {
            w: figures[f"{GROUP}/w{w}_busy_ms"] for w in range(self._workers)
        }
        fastest = min(busy, key=busy.__getitem__)
        noun = self._noun
        self._notices.warn(
            "straggler",
            f"StragglerMonitor: {noun} {slowest} is a straggler: it works "
            f"{ratio:.2f}x as long per step as {noun} {fastest} "
            f"({busy[slowest]:.1f} ms vs {busy[fastest]:.1f} ms), and every "
            f"other {noun} waits for it in each collective. Look at its "
            "input pipeline, host load and device (throttling: "
            "GPULoadMonitor).",
        )


def _waits_from_time_in_step(figures: dict[str, float], workers: int) -> None:
    """JAX: turn each process's time in the step (gathered under `wait_ms`)
    into its wait beyond the process that spent least there, and busy =
    step - wait, in place. Every process runs the same compiled step and
    leaves it when its collectives end, so the differences are waits."""
    in_step = [figures[f"{GROUP}/w{w}_wait_ms"] for w in range(workers)]
    least = min(in_step) if all(map(math.isfinite, in_step)) else math.nan
    for w in range(workers):
        wait = in_step[w] - least
        figures[f"{GROUP}/w{w}_wait_ms"] = wait
        figures[f"{GROUP}/w{w}_busy_ms"] = (
            figures[f"{GROUP}/w{w}_step_ms"] - wait
        )
