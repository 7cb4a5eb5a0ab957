"""`StragglerMonitor`: per-worker step time and the slowest worker, logged
on every worker of a multi-worker cluster."""

from __future__ import annotations

import math
import time
from typing import Any

from keras_mgpu._flavour import callback_bases
from keras_mgpu._validation import check_number
from keras_mgpu.backend import ON_JAX_STRAGGLER, require_backend
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
        require_backend(
            "StragglerMonitor",
            ("tensorflow",),
            instead=ON_JAX_STRAGGLER,
        )
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
        self.keys: list[str] = []

    # ------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        from keras_mgpu.distribute import collective_timing
        from keras_mgpu.distribute.strategy import is_multi_worker, worker_info

        self._notices.reset()
        self._release()
        strategy = getattr(self.model, "distribute_strategy", None)
        self.keys = []
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
        self._task = int(info["rank"] or 0)
        self._workers = int(info["num_workers"])
        self._local = max(len(strategy.extended.worker_devices), 1)
        names = ("step_ms", "wait_ms", "busy_ms")
        self.keys = [
            f"{GROUP}/w{w}_{n}" for w in range(self._workers) for n in names
        ] + [f"{GROUP}/step_time_ratio", f"{GROUP}/slowest"]

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        from keras_mgpu.distribute import collective_timing

        self._steps = 0
        self._start = time.perf_counter()
        self._wait_start, self._count_start = collective_timing.read()

    def on_train_batch_end(self, batch: int, logs: dict | None = None):
        self._steps += 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._strategy is None or logs is None:
            return
        own = self._own_figures()
        figures = self._gather(own)
        logs.update(figures)
        self._check(figures)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._release()

    # ------------------------------------------------------------------
    def _release(self) -> None:
        if self._token is not None:
            from keras_mgpu.distribute import collective_timing

            collective_timing.uninstall(self._token)
            self._token = None
        self._strategy = None

    def _own_figures(self) -> dict[str, float]:
        from keras_mgpu.distribute import collective_timing

        steps = max(self._steps, 1)
        wall = time.perf_counter() - self._start
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
        prefix = f"{GROUP}/w{self._task}_"
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
        self._notices.warn(
            "straggler",
            f"StragglerMonitor: worker {slowest} is a straggler: it works "
            f"{ratio:.2f}x as long per step as worker {fastest} "
            f"({busy[slowest]:.1f} ms vs {busy[fastest]:.1f} ms), and every "
            "other worker waits for it in each collective. Look at its "
            "input pipeline, host load and device (throttling: "
            "GPULoadMonitor).",
        )
