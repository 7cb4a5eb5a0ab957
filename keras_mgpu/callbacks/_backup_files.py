"""`BackupAndRestore`'s storage: the pointer files' names, local or
`tf.io.gfile` file operations, durable writes and the SHA-256 checks that
tell a complete backup from a damaged one."""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

_METADATA = "training_metadata.json"
# With `double_checkpoint`, a second pointer with the same content: a
# damaged or missing pointer does not lose the backups it names.
_METADATA_COPY = "training_metadata.copy.json"
_FORMAT = 2  # our metadata: a pointer with the file's SHA-256


class _LocalFiles:
    """The slice of `tf.io.gfile` used here, for local paths without
    TensorFlow (Keras's JAX backend)."""

    GFile = staticmethod(open)
    exists = staticmethod(os.path.exists)
    listdir = staticmethod(os.listdir)
    remove = staticmethod(os.remove)
    rmtree = staticmethod(shutil.rmtree)

    @staticmethod
    def makedirs(path: str) -> None:
        os.makedirs(path, exist_ok=True)

    @staticmethod
    def rename(source: str, target: str, overwrite: bool = False) -> None:
        if not overwrite and os.path.exists(target):
            raise FileExistsError(target)
        os.replace(source, target)  # atomic on POSIX and Windows


def _gfile(path: str) -> Any:
    """`tf.io.gfile` where TensorFlow runs, or for a remote path (a bucket,
    "gs://..."; TensorFlow is then imported, as Keras's own callback does);
    the local file system otherwise."""
    from keras_mgpu._flavour import TF_RUNS

    if TF_RUNS or "://" in str(path):
        import tensorflow as tf

        return tf.io.gfile
    return _LocalFiles


def _fsync(path: str) -> None:
    """Flush a local file or folder to the disk (remote file systems
    commit on close)."""
    if "://" in path:
        return
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) * os.path.isdir(path)
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems cannot fsync a folder
    finally:
        os.close(descriptor)


def _check_readable(path: str, sha256: str | None) -> str | None:
    """Why the backup file at `path` cannot be loaded, or None: it must
    exist and hold the bytes that were committed (their SHA-256), or, for a
    backup written by Keras (no digest), open as HDF5 with every dataset
    readable."""
    if not _gfile(path).exists(path):
        return f"{path!r} does not exist"
    if sha256:
        if _file_sha256(path) != sha256:
            return (
                f"{path!r} differs from the file that was committed (its "
                "SHA-256 does not match)"
            )
        return None
    if "://" in path:
        return None  # Keras's own file, remote: its load will tell
    import h5py

    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, item: (
                item[()] if isinstance(item, h5py.Dataset) else None
            )
        )
    return None


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with _gfile(path).GFile(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
