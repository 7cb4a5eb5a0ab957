"""`BackupAndRestore`: Keras's callback, safe for multi-worker training."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import uuid
from typing import Any

from keras_mgpu._flavour import _tf_keras_if_installed, object_flavour
from keras_mgpu.backend import (
    is_jax,
    require_backend,
)
from keras_mgpu.callbacks._backup_files import (
    _FORMAT,
    _METADATA,
    _METADATA_COPY,
    _check_readable,
    _file_sha256,
    _fsync,
    _gfile,
)
from keras_mgpu.callbacks._backup_restore import RestoreMixin

_KILL_ENV = "KERAS_MGPU_TEST_KILL_AT"  # test-only seam, see `_test_kill`


def _keras3_base() -> type:
    import keras

    return keras.callbacks.BackupAndRestore


def _tf_keras_callback_base() -> tuple:
    """tf_keras's Callback protocol, when tf_keras is installed: lets this
    callback also run in a tf_keras `fit` (it then hands every hook to
    tf_keras's own, multi-worker safe, BackupAndRestore)."""
    tf_keras = _tf_keras_if_installed()
    return () if tf_keras is None else (tf_keras.callbacks.Callback,)


class BackupAndRestore(
    RestoreMixin, _keras3_base(), *_tf_keras_callback_base()
):
    """Keras's `BackupAndRestore`, with the same arguments, made safe for
    multi-worker training and for a process killed anywhere.

    Keras 3's own callback lets every worker of a
    `MultiWorkerMirroredStrategy` cluster create and write the same
    `backup_dir` (`FileExistsError` at `on_train_begin`, then concurrent
    writes of one file). This one keeps the chief's backup authoritative,
    the design of tf_keras's multi-worker `BackupAndRestore`:

    - **Saving.** Every worker saves (reading the optimizer's per-replica
      variables, e.g. `GradientAccumulationOptimizer`'s accumulators, is a
      collective every worker must join), but only the chief writes into
      `backup_dir`; the other workers write to a private temporary folder
      that is deleted at once. A backup is committed so that a SIGKILL at
      any point leaves the previous one intact: the weights go to a file
      no process or run ever wrote before (never over a committed file),
      are flushed to disk (fsync) and hashed (SHA-256); then a metadata
      file naming that file and its digest replaces the old metadata (a
      rename, the commit point); then older weights files are removed.
      `delete_checkpoint` removes the metadata before the files.
    - **Restoring.** At `on_train_begin` every worker reads the chief's
      backup from `backup_dir`, which therefore must be storage every
      worker reaches (a shared file system or a bucket, as for tf_keras).
      Three small all-reduces make the workers agree: they all see the
      same metadata; each reports which backups (the latest and, with
      `double_checkpoint`, the previous) it can read, with the committed
      digest, and all load the newest that every worker can read; after
      loading, each reports its status and a digest of the weights it
      holds. A worker that cannot read or load, or loaded other weights,
      makes every worker raise the same `ValueError` naming it: none is
      left waiting in a collective, none trains from other weights.
    - **Exact resume.** What is restored is everything `model.save_weights`
      holds: weights and optimizer variables, so
      `GradientAccumulationOptimizer`'s accumulators and counters (resume
      in the middle of a window), the update counter that `Warmup` and the
      LR callbacks read, momentum and EMA. With `save_freq="epoch"`,
      training resumes at the epoch after the backup; with an integer it
      resumes after the saved batch (unlike Keras, which trains the
      interrupted epoch's first batches again): the batches the backup
      already holds are read and dropped, not trained. Either ends with the
      weights of an uninterrupted run when each epoch's data do not depend
      on how many epochs ran before in the process (`shuffle=False`, or a
      dataset shuffled with a seed per epoch); the resumed epoch's logged
      loss covers only the batches trained after the restart.
    - A backup records the number of workers and of replicas that wrote
      it; a restart with other numbers is refused (per-replica optimizer
      state and the split of each batch would differ), naming both.

    **On Keras's JAX backend** it does the same without TensorFlow (local
    files; a remote "gs://" `backup_dir` goes through `tf.io.gfile`, as
    Keras's own callback): with or without a `keras.distribution` in force
    (build, compile and fit the model inside `distribution.scope()`), a fit
    interrupted and resumed with this callback in a fresh model ends at the
    weights and optimizer state of the uninterrupted run, from an epoch
    backup or mid-epoch (`save_freq=N`), mid accumulation window included.
    The step is one global program there, so a backup resumes exactly on
    another number of devices too (the number of processes must match).
    **Across JAX processes** (`keras_mgpu.distribute.start_cluster()` or
    `keras.distribution.initialize()`, a `DataParallel` over every
    process's devices) process 0 is the chief: it commits into
    `backup_dir`, the others save to a private folder deleted at once
    (Keras's `save_weights` creates variables, a collective every process
    joins); the agreement at `on_train_begin` exchanges each process's
    rows through `jax.distributed`'s key-value store (no XLA collective,
    each wait bounded). `backup_dir` must be a folder every process
    reaches (shared file system, bucket): process 0 writes a probe file at
    `on_train_begin`, and a process that does not see it within 5 s makes
    every process raise the same `ValueError` before training. Every
    variable must be replicated (`DataParallel`): sharded state (a
    `ModelParallel` over several processes) is refused at
    `on_train_begin`, on every process, before any exchange. A killed
    process makes the others exit within `start_cluster`'s
    `heartbeat_timeout` (JAX's coordination service); restart every
    process with the same command.

    On one worker (no strategy, `MirroredStrategy`, ...) it behaves as
    Keras's, plus the commit protocol and the exact resume. It reads a
    backup written by Keras's callback. In a tf_keras `fit` it hands every
    hook to tf_keras's `BackupAndRestore` (multi-worker safe already).

    **Cost per step.** With `save_freq="epoch"` (default) or False it does
    nothing per batch that reads the device (it declares `async_safe`, so
    Keras's asynchronous batch dispatch stays on). With an integer
    `save_freq` it saves from its batch hook, a full read of the weights
    every `save_freq` batches, and Keras runs that hook synchronously (each
    step waits for the device, as with Keras's own callback).

    Args:
        backup_dir: str, folder of the backup (not shared with anything
            else). Under multi-worker training (or several JAX processes):
            reachable by every worker.
        save_freq: "epoch" (default), int >= 1 (batches between saves) or
            False (or 0): no periodic save, as Keras documents it (Keras
            3.15 in fact saves after every batch); the callback still
            restores a backup found in `backup_dir`. Not allowed in a
            tf_keras `fit` (tf_keras then requires preemption
            checkpointing).
        double_checkpoint: bool, also keep the previous backup and fall
            back to it when a worker cannot read the latest (every worker
            then loads the previous). Every save keeps, as the previous
            backup, one whose file is intact at that moment (the one last
            committed or restored, else the newest intact one), so a
            damaged file never displaces the last intact copy; the pointer
            is written twice (`training_metadata.json` and
            `training_metadata.copy.json`): a damaged or missing pointer
            falls back to its copy, with a warning. Not available in a
            tf_keras `fit` (ValueError: tf_keras keeps one checkpoint).
            Defaults to False.
        delete_checkpoint: bool, delete `backup_dir` when training ends
            (the chief does). Defaults to True.

    Example:

    ```python
    keras_mgpu.distribute.enable_multi_worker_fit()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_and_compile()
    model.fit(dataset, epochs=10, callbacks=[
        keras_mgpu.callbacks.BackupAndRestore("/shared/run1/backup")])
    # Kill any worker, restart every worker with the same command: the run
    # resumes at the epoch after the last backup.

    # On JAX, in every process (the same restart):
    distribution = keras_mgpu.distribute.start_cluster(
        auto_shard_dataset=False, heartbeat_timeout=10)
    with distribution.scope():
        model = build_and_compile()
        model.fit(
            keras_mgpu.distribute.shard_across_processes(x, y, batch_size=64),
            epochs=10,
            callbacks=[keras_mgpu.callbacks.BackupAndRestore(
                "/shared/run1/backup", save_freq=100)])
    ```
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int | bool = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ) -> None:
        require_backend("BackupAndRestore")
        if save_freq is False or (
            isinstance(save_freq, int)
            and not isinstance(save_freq, bool)
            and save_freq == 0
        ):
            save_freq = False  # Keras documents `False`; 0 is the same value
        elif save_freq != "epoch" and (
            not isinstance(save_freq, int)
            or isinstance(save_freq, bool)
            or save_freq < 1
        ):
            # Keras's words first (a drop-in keeps them), then ours.
            raise ValueError(
                "Invalid value for argument `save_freq`. Argument "
                "`save_freq` must be 'epoch', an integer >= 1 or False (0). "
                f"Received: save_freq={save_freq!r}"
            )
        super().__init__(
            backup_dir,
            save_freq="epoch" if save_freq is False else save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        self.save_freq = save_freq
        # Keras's asynchronous batch dispatch stays on when nothing is saved
        # per batch: the batch hook then reads only host counters. An
        # integer `save_freq` saves from that hook (a full read of the
        # weights every `save_freq` batches), which must not overlap the
        # next step: Keras then runs the hook synchronously, as for its own
        # BackupAndRestore.
        self.async_safe = save_freq in ("epoch", False)
        self._arguments = dict(
            backup_dir=backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        self._tf_keras_callback = None
        # tf_keras runs callbacks marked chief-only on the chief alone;
        # every worker must save and restore.
        self._chief_worker_only = False
        self._saves = 0
        self._private_dir: str | None = None
        self._run_id = uuid.uuid4().hex[:12]
        self._kill_counts: dict[str, int] = {}
        self._skip: tuple[int, int] | None = None
        # The backup this process last committed or restored (the chief's):
        # with `double_checkpoint`, the first choice for "previous".
        self._known: dict | None = None

    # ------------------------------------------------------------------
    # tf_keras: delegate to its own BackupAndRestore
    # ------------------------------------------------------------------
    def set_model(self, model: Any) -> None:
        super().set_model(model)
        if object_flavour(model) == "tf_keras":
            import tf_keras

            if self._tf_keras_callback is None:
                # tf_keras's callback has no `double_checkpoint` (it keeps
                # TensorFlow checkpoints, written atomically).
                arguments = dict(self._arguments)
                if arguments.pop("double_checkpoint"):
                    # Ignoring it would promise a fallback that is not
                    # there: tf_keras keeps one checkpoint.
                    raise ValueError(
                        "Argument `double_checkpoint` cannot be True in a "
                        "tf_keras `fit`: tf_keras's BackupAndRestore, which "
                        "this callback hands a tf_keras model to, keeps one "
                        "TensorFlow checkpoint (committed atomically, so a "
                        "kill during a save leaves the previous one) and has "
                        "no previous backup to fall back to. Pass "
                        "double_checkpoint=False, or train a Keras 3 model. "
                        "Received: double_checkpoint=True"
                    )
                if arguments["save_freq"] is False:
                    # tf_keras accepts it only with its preemption
                    # checkpointing, which this callback does not expose.
                    raise ValueError(
                        "Argument `save_freq` cannot be False (0) in a "
                        "tf_keras `fit`: tf_keras's BackupAndRestore then "
                        "requires `save_before_preemption=True`. Pass "
                        "save_freq='epoch' or an integer >= 1. Received: "
                        "save_freq=False"
                    )
                self._tf_keras_callback = tf_keras.callbacks.BackupAndRestore(
                    **arguments
                )
            self._tf_keras_callback.set_model(model)

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        if self._tf_keras_callback is not None:
            self._tf_keras_callback.set_params(params)

    def _implements_train_batch_hooks(self) -> bool:
        # tf_keras's keeps its saved batch number in every batch; ours
        # counts batches (int save_freq) or skips the batches a mid-epoch
        # backup already holds.
        return True

    def _delegate(self, hook: str, *args: Any) -> bool:
        if self._tf_keras_callback is None:
            return False
        getattr(self._tf_keras_callback, hook)(*args)
        return True

    # ------------------------------------------------------------------
    # Hooks
    # ------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._delegate("on_train_begin", logs):
            return
        from keras_mgpu.distribute.strategy import (
            is_multi_worker,
            num_replicas_in_sync,
            worker_info,
        )

        strategy = self._strategy()
        # Several processes share one backup only when they train one model
        # together; otherwise each process owns its backup.
        together = is_multi_worker(strategy)
        info = worker_info(strategy)
        self._is_chief = bool(info["is_chief"]) or not together
        self._num_workers = int(info["num_workers"]) if together else 1
        self._task_id = int(info["rank"] or 0) if together else 0
        if is_jax():
            self._num_replicas = num_replicas_in_sync(strategy)
            if together:
                self._check_jax_state_readable()
        else:
            self._num_replicas = int(
                getattr(strategy, "num_replicas_in_sync", 1) or 1
            )
        # A callback object may serve several `fit` calls (Keras's tests
        # restart with the same one): start each from a clean state.
        self._uninstall_skipper()
        self._skip = None
        self._saves = 0
        self._known = None
        self._current_epoch = 0
        self._last_batch_seen = -1
        self._batches_seen_since_last_saving = 0
        # Keras never clears the epoch a restore set: a model trained
        # again in this process would start where an earlier backup was,
        # with nothing restored (`fit` falls back to its `initial_epoch`).
        if getattr(self._model, "_initial_epoch", None) is not None:
            self._model._initial_epoch = None
        self._restore()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._delegate("on_epoch_begin", epoch, logs):
            return
        # Batch-level saves record this epoch, restored or not (Keras
        # records 0 until the first epoch ends after a restore).
        self._current_epoch = epoch
        self._last_batch_seen = -1
        if self._skip is not None and self._skip[0] != epoch:
            self._uninstall_skipper()
            self._skip = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._delegate("on_epoch_end", epoch, logs):
            return
        self._uninstall_skipper()
        self._skip = None
        self._current_epoch = epoch + 1
        if self.save_freq == "epoch":
            self._save_model(epoch + 1, -1)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None):
        if self._delegate("on_train_batch_begin", batch, logs):
            return
        if self._skipping(batch):
            self._install_skipper(self._skip[1] - batch + 1)
        elif self._skip is not None:
            self._uninstall_skipper()
            self._skip = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._delegate("on_train_batch_end", batch, logs):
            return
        if self.async_safe:
            # Nothing per batch to save; the counters below serve integer
            # saves only. (This hook may run on Keras's dispatch thread.)
            return
        if self._skipping(batch):
            # Batches the backup already holds: count from the backup's
            # save, as the uninterrupted run did.
            self._last_batch_seen = batch
            self._batches_seen_since_last_saving = 0
            return
        if isinstance(self.save_freq, bool) or self.save_freq == "epoch":
            return
        self._batches_seen_since_last_saving += batch - self._last_batch_seen
        self._last_batch_seen = batch
        if self._batches_seen_since_last_saving >= self.save_freq:
            self._batches_seen_since_last_saving = 0
            self._save_model(self._current_epoch, batch)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._delegate("on_train_end", logs):
            return
        self._uninstall_skipper()
        self._skip = None
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        if self.delete_checkpoint and self._is_chief:
            self._delete_backup()

    def _check_jax_state_readable(self) -> None:
        """Several JAX processes: every variable must be replicated (a
        `DataParallel`), so that each process reads it whole. Decided
        alike on every process (from the layouts, which all share): all
        raise the same error, none waits in a collective."""
        from keras_mgpu.backend.jax.backup import sharded_variables

        model = self._model
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables += list(optimizer.variables)
        sharded = sharded_variables(variables)
        if sharded:
            shown = ", ".join(sharded[:3])
            shown += " ..." if len(sharded) > 3 else ""
            raise ValueError(
                "BackupAndRestore on several JAX processes needs every "
                "variable replicated on every device (a "
                "keras.distribution.DataParallel): process 0 writes the "
                f"backup from its own copy. {len(sharded)} variable(s) are "
                f"sharded by the distribution's layout ({shown}). Keras's "
                "`save_weights` cannot read a variable split across "
                "processes, and sharded layouts across processes are not "
                "supported here yet. Use a DataParallel, or train a "
                "ModelParallel in one process."
            )

    # ------------------------------------------------------------------
    # Saving
    # ------------------------------------------------------------------
    def _strategy(self) -> Any:
        """The model's `tf.distribute` strategy; on JAX the
        `keras.distribution` in force (None without one)."""
        if is_jax():
            from keras_mgpu.backend.jax.distribution import (
                current_distribution,
            )

            return current_distribution()
        return getattr(self.model, "distribute_strategy", None)

    def _save_model(self, epoch: int, batch: int) -> None:
        """Every worker saves; only the chief commits into `backup_dir`.

        `epoch`, `batch`: where a restart resumes, at batch `batch + 1` of
        `epoch` (`batch=-1`: at the start of `epoch`).
        """
        steps = (self.params or {}).get("steps")
        if batch >= 0 and steps and batch + 1 >= steps:
            epoch, batch = epoch + 1, -1  # the epoch's last batch
        self._saves += 1
        # A name no other process or run ever wrote: a save never
        # overwrites a committed file in place.
        name = f"backup-{self._run_id}-{self._saves:06d}.weights.h5"
        if not self._is_chief:
            if self._private_dir is None:
                self._private_dir = tempfile.mkdtemp(prefix="keras_mgpu_bkp_")
            path = os.path.join(self._private_dir, name)
            self._save_weights(path)
            self._test_kill("weights_partial", path)
            self._test_kill("weights_written")
            os.remove(path)
            return
        _gfile(self.backup_dir).makedirs(self.backup_dir)
        path = os.path.join(self.backup_dir, name)
        self._save_weights(path)
        self._test_kill("weights_partial", path)
        _fsync(path)
        self._test_kill("weights_written")
        previous = self._intact_backup() if self.double_checkpoint else None
        metadata = {
            "format": _FORMAT,
            "epoch": int(epoch),
            "batch": int(batch),
            "weights": name,
            "sha256": _file_sha256(path),
            "num_workers": self._num_workers,
            "num_replicas": self._num_replicas,
            "previous": None,
        }
        if previous is not None:
            previous = dict(previous)
            previous.pop("previous", None)  # keep one level only
            metadata["previous"] = previous
        self._write_metadata(metadata)
        if self.double_checkpoint:
            self._write_metadata(metadata, _METADATA_COPY)
        self._known = {k: v for k, v in metadata.items() if k != "previous"}
        self._remove_stale_files(metadata)

    def _intact_backup(self) -> dict | None:
        """The backup to keep as "previous" at a save: one that is intact
        now (its file holds the committed bytes). First the one this
        process last committed or restored (after a restore that fell back
        from a damaged latest, that is the previous one, never the damaged
        file); then the newest the pointer or its copy names. Checked at
        every save (one read of the file), so damage done between saves is
        seen too. None when no backup is intact."""
        candidates = [self._known] if self._known else []
        found = []
        for reader in (self._read_metadata, self._read_metadata_copy):
            try:
                metadata = reader()
            except Exception:  # an unreadable pointer names nothing
                continue
            if metadata:
                found += self._candidates(metadata)
        found.sort(
            key=lambda c: (int(c.get("epoch", 0)), int(c.get("batch", -1))),
            reverse=True,
        )
        candidates += found
        tried = set()
        for candidate in candidates:
            if candidate["weights"] in tried:
                continue
            tried.add(candidate["weights"])
            if self._readable(candidate) is None:
                return candidate
        return None

    def _remove_stale_files(self, metadata: dict) -> None:
        """Files no committed pointer names: older backups, files a killed
        chief was writing, its temporary pointers."""
        keep = {metadata["weights"]}
        if metadata.get("previous"):
            keep.add(metadata["previous"]["weights"])
        files = _gfile(self.backup_dir)
        for f in files.listdir(self.backup_dir):
            stale = f.endswith(".weights.h5") and f not in keep
            if stale or f.endswith(".tmp"):
                files.remove(os.path.join(self.backup_dir, f))

    def _write_metadata(self, metadata: dict, name: str = _METADATA) -> None:
        path = os.path.join(self.backup_dir, name)
        temporary = f"{path}.{self._run_id}.tmp"
        files = _gfile(self.backup_dir)
        with files.GFile(temporary, "w") as f:
            f.write(json.dumps(metadata))
        _fsync(temporary)
        self._test_kill("metadata_written")
        # The commit point: readers see the old backup or the new one.
        files.rename(temporary, path, overwrite=True)
        _fsync(self.backup_dir)
        self._test_kill("committed" if name == _METADATA else "copied")

    def _delete_backup(self) -> None:
        """The pointer first, then the files it named: a process killed in
        between leaves no pointer to a deleted file."""
        files = _gfile(self.backup_dir)
        if not files.exists(self.backup_dir):
            return
        # The copy before the pointer: a kill in between leaves the pointer,
        # as a kill before the deletion does.
        for name in (_METADATA_COPY, _METADATA):
            pointer = os.path.join(self.backup_dir, name)
            if files.exists(pointer):
                files.remove(pointer)
                _fsync(self.backup_dir)
        self._test_kill("pointer_deleted")
        files.rmtree(self.backup_dir)

    def _readable(self, candidate: dict) -> str | None:
        """Why this worker cannot read a backup, or None."""
        path = os.path.join(self.backup_dir, candidate["weights"])
        try:
            return _check_readable(path, candidate.get("sha256"))
        except Exception as exc:  # reported to every worker, then raised
            return f"{type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------
    # Resuming mid-epoch
    # ------------------------------------------------------------------
    def _skipping(self, batch: int) -> bool:
        return (
            self._skip is not None
            and self._current_epoch == self._skip[0]
            and batch <= self._skip[1]
        )

    def _install_skipper(self, steps: int) -> None:
        """Make `fit`'s next call of `train_function` read and drop
        `steps` batches (at most `steps_per_execution`) instead of
        training on them. Keras 3.10-3.15's TensorFlow `fit` calls
        `self.train_function(iterator)` once per execution and reads the
        attribute each time; its JAX `fit` likewise, with the state."""
        # `_model`, not `model`: on JAX reading `model` copies the step's
        # state back into the variables (Callback.model syncs).
        model = self._model
        current = getattr(model, "train_function", None)
        if current is None:
            return
        original = getattr(current, "_keras_mgpu_original", current)
        per_execution = int(getattr(model, "steps_per_execution", 1) or 1)
        count = max(1, min(steps, per_execution))

        if is_jax():
            # Keras 3.10-3.15's JAX `fit` calls
            # `logs, state = self.train_function(state, iterator)`.
            def skip(state, iterator):
                for _ in range(count):
                    next(iterator)
                return {}, state

        else:

            def skip(iterator):
                for _ in range(count):
                    next(iterator)
                return {}

        skip._keras_mgpu_original = original
        model.train_function = skip

    def _uninstall_skipper(self) -> None:
        model = getattr(self, "_model", None)
        if model is None:
            return
        current = getattr(model, "train_function", None)
        original = getattr(current, "_keras_mgpu_original", None)
        if original is not None:
            model.train_function = original

    # ------------------------------------------------------------------
    # Test-only seam
    # ------------------------------------------------------------------
    def _test_kill(self, point: str, path: str | None = None) -> None:
        """Test-only seam, not API: SIGKILL this process at `point` when
        the environment variable KERAS_MGPU_TEST_KILL_AT names it, as
        `point:role[:n]` (role: chief, worker or any; the n-th time, 1 by
        default). `weights_partial` first truncates the weights file it
        just wrote to half, as a kill during the write leaves it."""
        spec = os.environ.get(_KILL_ENV)
        if not spec:
            return
        wanted, _, rest = spec.partition(":")
        role, _, nth = rest.partition(":")
        if wanted != point:
            return
        if (role == "chief" and not self._is_chief) or (
            role == "worker" and self._is_chief
        ):
            return
        count = self._kill_counts.get(point, 0) + 1
        self._kill_counts[point] = count
        if count != int(nth or 1):
            return
        if path is not None:
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.truncate(size // 2)
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
