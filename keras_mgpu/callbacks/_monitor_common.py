"""What the epoch monitors (`GPULoadMonitor`, `MemoryMonitor`) share: their
common arguments (`update_freq`, `worker_prefix`, `gather_workers`), the
strategy they sample under, the worker prefix and gathering started at train
begin, and the batch count behind `update_freq`. Each monitor reads its own
figures; this is the one place for the rest."""

from __future__ import annotations

import itertools
from typing import Any

from keras_mgpu._validation import check_bool, monitor_update_freq
from keras_mgpu.backend import require_backend
from keras_mgpu.distribute.strategy import current_strategy
from keras_mgpu.monitoring.gather import WorkerGathering
from keras_mgpu.monitoring.host_backend import HostBackend
from keras_mgpu.monitoring.notices import Notices


class EpochMonitorMixin:
    """Mixed into a monitor before its Keras `Callback` base. The monitor
    calls `_init_monitor` from `__init__`, `_begin_monitor` first thing in
    `on_train_begin`, and `_batch_due` first thing in its `_log_batch`."""

    def _init_monitor(
        self,
        owner: str,
        update_freq: str | int,
        worker_prefix: bool | None,
        gather_workers: bool,
        deprecated: dict,
    ) -> None:
        """Check and keep the common arguments (`owner` names the monitor in
        messages); `deprecated` is the caller's `**deprecated` keywords."""
        self._backend_name = require_backend(owner)
        update_freq, log_every_n_batches = monitor_update_freq(
            # One frame more than a call from the monitor's `__init__`: the
            # warning still points at the user's line.
            owner,
            update_freq,
            deprecated,
            stacklevel=5,
        )
        self.update_freq = update_freq
        # Batches between batch-level logs; 0: per epoch only.
        self.log_every_n_batches = log_every_n_batches
        self.worker_prefix = check_bool(
            worker_prefix, "worker_prefix", allow_none=True
        )
        self._gathering = WorkerGathering(gather_workers, owner)
        self.gather_workers = gather_workers
        # psutil's host figures; tests replace it with a stand-in before
        # `fit`.
        self._host_backend = HostBackend()
        self._notices = Notices()
        self._prefix = ""
        self.keys: list[str] = []
        self._restart_batch_count()
        if self.log_every_n_batches:
            # Only then: a batch hook turns off Keras's async batch dispatch.
            self.on_train_batch_end = self._log_batch

    def _strategy(self) -> Any:
        """The `tf.distribute` strategy of the model, or the one in scope;
        on JAX the `keras.distribution` in force (None without one)."""
        model = getattr(self, "model", None)
        return current_strategy(getattr(model, "distribute_strategy", None))

    def _begin_monitor(self) -> Any:
        """Train begin: notices afresh, the batch count from 0, the worker
        prefix (and gathering) for the strategy in force; returns it."""
        self._notices.reset()
        self._restart_batch_count()
        strategy = self._strategy()
        self._prefix = self._gathering.start(
            strategy, self.worker_prefix, self._notices
        )
        return strategy

    def _restart_batch_count(self) -> None:
        self._batches = 0
        self._batch_count = itertools.count(1)

    def _batch_due(self, logs: dict | None) -> bool:
        """Count a batch; True when its figures are to be logged."""
        # May run on Keras's dispatch threads: `next` on a count is atomic.
        self._batches = count = next(self._batch_count)
        return logs is not None and not count % self.log_every_n_batches

    def _log_batch(self, batch: int, logs: dict | None = None) -> None:
        raise NotImplementedError  # each monitor logs its own figures
