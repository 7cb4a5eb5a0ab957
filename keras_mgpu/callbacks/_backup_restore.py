"""`BackupAndRestore`'s restore at train begin: read the pointer (or its
copy), choose the newest backup every worker can read, load it, check that
every worker loaded the same weights, and resume there. Mixed into
`BackupAndRestore` (`keras_mgpu.callbacks.backup_and_restore`), which keeps
the readability check (`_readable`) and the saving side."""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from typing import Any

from keras_mgpu.backend import is_jax
from keras_mgpu.callbacks._backup_agreement import (
    _agree,
    _gather_rows,
    _hex,
    _processes,
    _sha256_words,
    _weights_bytes,
    _workers,
)
from keras_mgpu.callbacks._backup_files import (
    _FORMAT,
    _METADATA,
    _METADATA_COPY,
    _fsync,
    _gfile,
)

# Seconds a JAX process waits to see the chief's probe in a shared folder.
_SHARED_WAIT = 5.0


class RestoreMixin:
    """The restoring half of `BackupAndRestore` (see the module)."""

    # ------------------------------------------------------------------
    # Restoring
    # ------------------------------------------------------------------
    def _read_metadata_copy(self) -> dict | None:
        """The pointer's copy (ours only, with `double_checkpoint`)."""
        metadata = self._read_metadata(_METADATA_COPY)
        if metadata is not None and metadata.get("format") != _FORMAT:
            return None
        return metadata

    def _read_metadata(self, name: str = _METADATA) -> dict | None:
        path = os.path.join(self.backup_dir, name)
        files = _gfile(self.backup_dir)
        if not files.exists(path):
            return None
        with files.GFile(path, "r") as f:
            metadata = json.loads(f.read())
        if "weights" not in metadata:
            # Written by keras.callbacks.BackupAndRestore: it resumes at the
            # start of the epoch (its "batch" is not where it stopped).
            metadata["weights"] = os.path.basename(self._weights_path)
            metadata["batch"] = -1
        return metadata

    def _candidates(self, metadata: dict) -> list[dict]:
        """The backups to try, newest first."""
        candidates = [metadata]
        if not self.double_checkpoint:
            return candidates
        if metadata.get("format") == _FORMAT:
            if metadata.get("previous"):
                candidates.append(metadata["previous"])
            return candidates
        # Keras's own double checkpoint: `*.bkp` copies.
        previous = f"{self._training_metadata_path}.bkp"
        files = _gfile(self.backup_dir)
        if files.exists(f"{self._weights_path}.bkp"):
            epoch = 0
            if files.exists(previous):
                with files.GFile(previous, "r") as f:
                    epoch = int(json.loads(f.read())["epoch"])
            candidates.append(
                {
                    "epoch": epoch,
                    "batch": -1,
                    "weights": os.path.basename(self._weights_path) + ".bkp",
                }
            )
        return candidates

    def _restore(self) -> None:
        """Restore the newest backup every worker can load, the same on
        every worker, or make every worker raise the same error.

        Each step ends with one small all-reduce in which every worker
        reports what it read or loaded (`gather_rows`), so a worker that
        fails never leaves the others waiting in a collective.
        """
        strategy = self._strategy()
        if is_jax() and self._num_workers > 1:
            self._check_shared(strategy)
        metadata, error = None, None
        try:
            metadata = self._read_metadata()
        except Exception as exc:  # every worker must hear of it
            error = f"{type(exc).__name__}: {exc}"
        if self.double_checkpoint and (error or metadata is None):
            # A damaged or missing pointer: its copy names the same
            # backups (every worker reads the same files, decides alike).
            try:
                copy = self._read_metadata_copy()
            except Exception:
                copy = None
            if copy is not None:
                warnings.warn(
                    "BackupAndRestore: the backup's pointer "
                    f"{os.path.join(self.backup_dir, _METADATA)!r} is "
                    + (f"unreadable ({error})" if error else "missing")
                    + f"; restoring from its copy {_METADATA_COPY!r}.",
                    stacklevel=2,
                )
                metadata, error = copy, None
        identity = _sha256_words(
            json.dumps(metadata, sort_keys=True) if metadata else ""
        )
        _agree(
            strategy,
            error,
            [float(metadata is not None), *identity],
            "cannot read the backup's metadata "
            f"{os.path.join(self.backup_dir, _METADATA)!r}",
            "Fix or delete it: no worker starts training.",
            differ=lambda rows: (
                "The workers see different backups in backup_dir="
                f"{self.backup_dir!r} ("
                + ", ".join(
                    f"worker {r}: "
                    + ("no backup" if rows[r, 1] == 0 else "a backup")
                    + f" ({_hex(rows[r, 2:])})"
                    for r in range(len(rows))
                )
                + "). Under multi-worker training, backup_dir must be "
                "storage every worker reaches (a shared file system or a "
                "bucket): the chief writes it, every worker restores from it."
            ),
        )
        if metadata is None:
            return
        self._check_cluster_shape(metadata)
        model = self.model
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be "
                f"built before you call `fit()`. Model {model} is unbuilt: "
                "build it by calling it on a batch of data."
            )
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        # 1. Which backups can each worker read? Decided from every
        # worker's answer, before any worker loads (loading may itself run
        # collectives: all workers must load the same file, or none).
        candidates = self._candidates(metadata)
        errors = [self._readable(candidate) for candidate in candidates]
        rows = _gather_rows(
            strategy, [float(error is None) for error in errors] + [1.0] * 2
        )
        chosen, failures = None, []
        for index, candidate in enumerate(candidates):
            failed = [r for r in range(len(rows)) if rows[r, index] == 0]
            if not failed:
                chosen = candidate
                break
            failures.append(
                f"{candidate['weights']!r} (epoch {candidate['epoch']}): "
                f"{_workers(failed)} cannot read it"
                + (f" (here: {errors[index]})" if errors[index] else "")
            )
        if chosen is None:
            raise ValueError(
                f"No backup in backup_dir={self.backup_dir!r} can be read by "
                "every worker: "
                + "; ".join(failures)
                + ". No worker starts training: fix the storage, or delete "
                "backup_dir to start from scratch"
                + (
                    ""
                    if self.double_checkpoint
                    else " (double_checkpoint=True keeps a previous backup "
                    "to fall back to)"
                )
                + "."
            )
        # 2. Load it, then check what every worker loaded: the load status
        # and a digest of the weights it holds now (computed whether the
        # load worked or not, so every worker reaches the all-reduce).
        error = self._load(chosen)
        _agree(
            strategy,
            error,
            _sha256_words(_weights_bytes(model)),
            f"could not load {chosen['weights']!r} "
            f"from backup_dir={self.backup_dir!r}",
            "No worker starts training.",
            differ=lambda rows: (
                "The workers loaded different weights from "
                f"{chosen['weights']!r} in backup_dir={self.backup_dir!r} "
                "(digests of the loaded weights: "
                + ", ".join(
                    f"worker {r}: {_hex(rows[r, 1:])}" for r in range(len(rows))
                )
                + "): the file changed while they read it, or the model "
                "differs between workers. No worker starts training."
            ),
        )
        self._known = {k: v for k, v in chosen.items() if k != "previous"}
        self._resume_at(chosen)

    def _check_shared(self, strategy: Any) -> None:
        """Several JAX processes: refuse at once a `backup_dir` that is not
        one folder for all (a local path on each host), before a run
        writes backups that its restart could not use. The chief writes a
        probe file; every process reports whether it sees it (waiting up
        to `_SHARED_WAIT` seconds for a shared file system to show it)."""
        token = uuid.uuid4().hex[:12]
        probe, error = None, None
        if self._is_chief:
            try:
                files = _gfile(self.backup_dir)
                files.makedirs(self.backup_dir)
                probe = os.path.join(self.backup_dir, f"probe-{token}.tmp")
                with files.GFile(probe, "w") as f:
                    f.write(token)
                _fsync(probe)
            except Exception as exc:  # every process must hear of it
                error = f"{type(exc).__name__}: {exc}"
        rows = _gather_rows(
            strategy, [float(error is None), float(int(token, 16))]
        )
        written = bool(rows[0, 0])
        seen = True
        if written:
            name = f"probe-{int(rows[0, 1]):012x}.tmp"
            path = os.path.join(self.backup_dir, name)
            deadline = time.monotonic() + _SHARED_WAIT
            while not (seen := _gfile(path).exists(path)):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        rows = _gather_rows(strategy, [float(seen)])
        if probe is not None:
            _gfile(probe).remove(probe)
        unseen = [r for r in range(len(rows)) if rows[r, 0] == 0]
        if written and not unseen:
            return
        if not written:
            reason = "process 0 cannot write into it" + (
                f" ({error})" if error else ""
            )
        else:
            reason = (
                f"{_processes(unseen)} cannot see the file process 0 wrote "
                f"into it (waited {_SHARED_WAIT:.0f} s)"
            )
        raise ValueError(
            f"backup_dir={self.backup_dir!r} is not one folder for every "
            f"process: {reason}. On several JAX processes process 0 writes "
            "the backup and every process restores from it: pass a folder "
            "on a shared file system (or a bucket) that every process "
            "reaches. No process starts training."
        )

    def _check_cluster_shape(self, metadata: dict) -> None:
        """A resume is exact only on the cluster shape that wrote it."""
        workers = metadata.get("num_workers")
        replicas = metadata.get("num_replicas")
        if workers is None or (
            (workers, replicas) == (self._num_workers, self._num_replicas)
        ):
            return
        if is_jax() and workers == self._num_workers:
            # On JAX the step is one global program: optimizer state is
            # global (not per replica) and the batch's split leaves the
            # math alone, so another device count resumes exactly.
            return
        raise ValueError(
            f"The backup in backup_dir={self.backup_dir!r} was written by a "
            f"job of {workers} worker(s) and {replicas} replica(s); this "
            f"job has {self._num_workers} worker(s) and "
            f"{self._num_replicas} replica(s). A resume is exact only on "
            "the same shape (per-replica optimizer state, how each batch "
            f"is split): restart with {workers} worker(s) and {replicas} "
            "replica(s), or delete backup_dir (or pass a new one) to start "
            "from scratch."
        )

    def _load(self, candidate: dict) -> str | None:
        """Load one backup; the reason it failed, or None."""
        from keras_mgpu.schedules._optimizer_lr import hidden_state

        try:
            with hidden_state(self.model):
                self.model.load_weights(
                    os.path.join(self.backup_dir, candidate["weights"])
                )
        except Exception as exc:  # reported to every worker, then raised
            return f"{type(exc).__name__}: {exc}"
        return None

    def _save_weights(self, path: str) -> None:
        from keras_mgpu.schedules._optimizer_lr import hidden_state

        # The optimizer's variables as Keras made them: on JAX our LR
        # callbacks add theirs for the `fit` (see `hidden_state`).
        with hidden_state(self.model):
            self.model.save_weights(path, overwrite=True)

    def _resume_at(self, candidate: dict) -> None:
        epoch = int(candidate["epoch"])
        batch = int(candidate.get("batch", -1))
        self.model._initial_epoch = epoch
        self._current_epoch = epoch
        if batch >= 0:
            # Resume exactly after the saved batch: the first `batch + 1`
            # batches of `epoch` are read and dropped, not trained again.
            self._skip = (epoch, batch)
