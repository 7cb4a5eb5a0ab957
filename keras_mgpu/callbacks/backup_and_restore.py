"""`BackupAndRestore`: Keras's callback, safe for multi-worker training."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from keras_mgpu._flavour import object_flavour

_METADATA = "training_metadata.json"


def _keras3_base() -> type:
    import keras

    return keras.callbacks.BackupAndRestore


def _tf_keras_callback_base() -> tuple:
    """tf_keras's Callback protocol, when tf_keras is installed: lets this
    callback also run in a tf_keras `fit` (it then hands every hook to
    tf_keras's own, multi-worker safe, BackupAndRestore)."""
    import importlib.util

    if importlib.util.find_spec("tf_keras") is None:
        return ()
    import tf_keras

    return (tf_keras.callbacks.Callback,)


class BackupAndRestore(_keras3_base(), *_tf_keras_callback_base()):
    """Keras's `BackupAndRestore`, with the same arguments, made safe for
    multi-worker training and for a process killed while it writes.

    Keras 3's own callback lets every worker of a
    `MultiWorkerMirroredStrategy` cluster create and write the same
    `backup_dir` (`FileExistsError` at `on_train_begin`, then concurrent
    writes of one file). This one keeps the chief's backup authoritative,
    the design of tf_keras's multi-worker `BackupAndRestore`:

    - **Saving.** Every worker saves (reading the optimizer's per-replica
      variables, e.g. `GradientAccumulationOptimizer`'s accumulators, is a
      collective every worker must join), but only the chief writes into
      `backup_dir`; the other workers write to a private temporary folder
      that is deleted at once. A backup is committed atomically: the
      weights go to a new file, then the metadata naming that file replaces
      the old metadata (a rename), then the previous weights file is
      removed. A process killed mid-save leaves the previous backup intact.
    - **Restoring.** At `on_train_begin` every worker reads the chief's
      backup from `backup_dir`, which therefore must be storage every
      worker reaches (a shared file system or a bucket, as for tf_keras).
      The workers check, with one small all-reduce, that they all see the
      same backup; a worker that sees another one (or none) makes every
      worker raise a `ValueError` naming it, instead of training from
      different weights.
    - What is restored is everything `model.save_weights` holds: weights
      and optimizer variables, so `GradientAccumulationOptimizer`'s
      accumulators and counters (resume in the middle of a window), the
      update counter that `Warmup` and the LR callbacks read, momentum and
      EMA. Training resumes at the first epoch after the backup and ends
      with the weights of an uninterrupted run when each epoch's data do
      not depend on how many epochs ran before in the process
      (`shuffle=False`, or a dataset shuffled with a seed per epoch).
    - `save_freq=<int>` saves every that many batches and, as in Keras,
      resumes at the start of the interrupted epoch with the weights of
      the last backup (batches since the epoch began are trained again):
      use `save_freq="epoch"` (the default) for an exact resume.

    On one worker (no strategy, `MirroredStrategy`, ...) it behaves as
    Keras's, plus the atomic commit. In a tf_keras `fit` it hands every
    hook to tf_keras's `BackupAndRestore` (multi-worker safe already).

    Args:
        backup_dir: str, folder of the backup (not shared with anything
            else). Under multi-worker training: reachable by every worker.
        save_freq: "epoch" (default) or int >= 1, batches between saves.
        double_checkpoint: bool, also keep the previous backup and fall
            back to it when the latest cannot be read. Defaults to False.
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
    ```
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ) -> None:
        if isinstance(save_freq, int) and (
            isinstance(save_freq, bool) or save_freq < 1
        ):
            raise ValueError(
                "Argument `save_freq` must be 'epoch' or an integer >= 1. "
                f"Received: save_freq={save_freq!r}"
            )
        super().__init__(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
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
                arguments.pop("double_checkpoint")
                self._tf_keras_callback = tf_keras.callbacks.BackupAndRestore(
                    **arguments
                )
            self._tf_keras_callback.set_model(model)

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        if self._tf_keras_callback is not None:
            self._tf_keras_callback.set_params(params)

    def _implements_train_batch_hooks(self) -> bool:
        if self._tf_keras_callback is not None:
            # tf_keras's keeps its saved batch number in every batch.
            return True
        return self.save_freq != "epoch"

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
        from keras_mgpu.distribute.strategy import is_multi_worker, worker_info

        strategy = self._strategy()
        # Several processes share one backup only when they train one model
        # together; otherwise each process owns its backup.
        together = is_multi_worker(strategy)
        info = worker_info(strategy)
        self._is_chief = bool(info["is_chief"]) or not together
        self._num_workers = int(info["num_workers"]) if together else 1
        self._task_id = int(info["rank"] or 0) if together else 0
        metadata = self._read_metadata()
        if self._num_workers > 1:
            self._check_workers_agree(metadata)
        if metadata is not None:
            self._restore(metadata)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if not self._delegate("on_epoch_begin", epoch, logs):
            super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self._delegate("on_epoch_end", epoch, logs):
            super().on_epoch_end(epoch, logs)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None):
        if not self._delegate("on_train_batch_begin", batch, logs):
            super().on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self._delegate("on_train_batch_end", batch, logs):
            super().on_train_batch_end(batch, logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._delegate("on_train_end", logs):
            return
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        if self.delete_checkpoint and self._is_chief:
            import tensorflow as tf

            if tf.io.gfile.exists(self.backup_dir):
                tf.io.gfile.rmtree(self.backup_dir)

    # ------------------------------------------------------------------
    # Saving
    # ------------------------------------------------------------------
    def _strategy(self) -> Any:
        return getattr(self.model, "distribute_strategy", None)

    def _save_model(self) -> None:
        """Every worker saves; only the chief commits into `backup_dir`."""
        import tensorflow as tf

        self._saves += 1
        name = f"backup-{self._saves}-e{self._current_epoch}.weights.h5"
        if not self._is_chief:
            if self._private_dir is None:
                self._private_dir = tempfile.mkdtemp(prefix="keras_mgpu_bkp_")
            path = os.path.join(self._private_dir, name)
            self.model.save_weights(path, overwrite=True)
            os.remove(path)
            return
        tf.io.gfile.makedirs(self.backup_dir)
        self.model.save_weights(
            os.path.join(self.backup_dir, name), overwrite=True
        )
        previous = self._read_metadata()
        metadata = {
            "epoch": self._current_epoch,
            "batch": self._last_batch_seen,
            "weights": name,
            "previous": previous if self.double_checkpoint else None,
        }
        if previous is not None and self.double_checkpoint:
            previous["previous"] = None  # keep one level only
        self._write_metadata(metadata)
        for stale in self._stale_weight_files(metadata):
            tf.io.gfile.remove(os.path.join(self.backup_dir, stale))

    def _stale_weight_files(self, metadata: dict) -> list[str]:
        import tensorflow as tf

        keep = {metadata["weights"]}
        if metadata.get("previous"):
            keep.add(metadata["previous"]["weights"])
        return [
            f
            for f in tf.io.gfile.listdir(self.backup_dir)
            if f.endswith(".weights.h5") and f not in keep
        ]

    def _write_metadata(self, metadata: dict) -> None:
        import tensorflow as tf

        path = os.path.join(self.backup_dir, _METADATA)
        temporary = f"{path}.tmp"
        with tf.io.gfile.GFile(temporary, "w") as f:
            f.write(json.dumps(metadata))
        # The commit point: readers see the old backup or the new one.
        tf.io.gfile.rename(temporary, path, overwrite=True)

    # ------------------------------------------------------------------
    # Restoring
    # ------------------------------------------------------------------
    def _read_metadata(self) -> dict | None:
        import tensorflow as tf

        path = os.path.join(self.backup_dir, _METADATA)
        if not tf.io.gfile.exists(path):
            return None
        with tf.io.gfile.GFile(path, "r") as f:
            metadata = json.loads(f.read())
        if "weights" not in metadata:
            # Written by keras.callbacks.BackupAndRestore.
            metadata["weights"] = os.path.basename(self._weights_path)
        return metadata

    def _check_workers_agree(self, metadata: dict | None) -> None:
        """Every worker must restore the same backup (one all-reduce)."""
        from keras_mgpu.distribute.collectives import gather_rows

        seen = -1 if metadata is None else int(metadata["epoch"])
        epochs = gather_rows(self._strategy(), [seen])[:, 0]
        if len(set(epochs.tolist())) > 1:
            described = ", ".join(
                f"worker {i}: "
                + ("no backup" if e < 0 else f"the backup of epoch {int(e)}")
                for i, e in enumerate(epochs)
            )
            raise ValueError(
                "The workers see different backups in backup_dir="
                f"{self.backup_dir!r} ({described}). Under multi-worker "
                "training, backup_dir must be storage every worker reaches "
                "(a shared file system or a bucket): the chief writes it, "
                "every worker restores from it."
            )

    def _restore(self, metadata: dict) -> None:
        """Load the backup named by `metadata` (or the previous one if it
        cannot be read and `double_checkpoint` kept one)."""
        model = self.model
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be "
                f"built before you call `fit()`. Model {model} is unbuilt: "
                "build it by calling it on a batch of data."
            )
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        try:
            model.load_weights(
                os.path.join(self.backup_dir, metadata["weights"])
            )
        except OSError:
            previous = metadata.get("previous")
            if not previous:
                raise
            metadata = previous
            model.load_weights(
                os.path.join(self.backup_dir, metadata["weights"])
            )
        model._initial_epoch = int(metadata["epoch"])
