"""What the `keras-mgpu` commands share: option types, the error they
report as one line, and holding back TensorFlow's native stderr."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator

PROG = "keras-mgpu"


class CommandError(Exception):
    """A failure the command reports as one clear line (exit code 1)."""


# Option types: argparse turns their ArgumentTypeError into
# "keras-mgpu demo: error: argument --epochs: ..." and exit code 2.
def int_type(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if (
            value is None
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            allowed = f"an integer >= {minimum}"
            if maximum is not None:
                allowed = f"an integer from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(
                f"must be {allowed}. Received: {text!r}"
            )
        return value

    parse.__name__ = "integer"  # shown by argparse in its messages
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a number > 0. Received: {text!r}"
        )
    return value


@contextlib.contextmanager
def native_stderr_to(
    enabled: bool = True, log_path: str | None = None
) -> Iterator[None]:
    """Send what is written to the process's stderr (file descriptor 2) to
    `log_path` (or nowhere) for the duration of the block.

    TensorFlow's C++ side writes start-up notices (CUDA probing on a
    machine without a GPU, CPU features) and dataset warnings straight to
    file descriptor 2, before or regardless of `TF_CPP_MIN_LOG_LEVEL`. A
    failure other than a `CommandError` replays the end of what was held
    back, so nothing that explains a crash is lost.
    """
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    if log_path is not None:
        sink = open(log_path, "a+b")
    else:
        sink = tempfile.TemporaryFile(mode="w+b")
    try:
        os.dup2(sink.fileno(), 2)
        yield
    except (CommandError, KeyboardInterrupt):
        raise
    except BaseException:
        sys.stderr.flush()
        os.dup2(saved, 2)
        sink.seek(0)
        tail = sink.read()[-4000:].decode(errors="replace")
        if tail.strip():
            sys.stderr.write(f"--- TensorFlow's stderr (end) ---\n{tail}\n")
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sink.close()


def requested_backend() -> str:
    """The Keras backend the command will run, read without importing Keras
    (`KERAS_BACKEND`, else `keras.json`, else "tensorflow"); "tensorflow"
    under tf_keras (`TF_USE_LEGACY_KERAS=1`)."""
    from keras_mgpu.testing.devices import requested_backend as read

    if os.environ.get("TF_USE_LEGACY_KERAS", "0").lower() in ("1", "true"):
        return "tensorflow"
    return read()


def missing_modules(modules: dict[str, str]) -> list[str]:
    return [
        package
        for module, package in modules.items()
        if importlib.util.find_spec(module) is None
    ]


def gpu_mismatch_note(nvml_gpus: int, tensorflow_gpus: int) -> str | None:
    """A line saying what to install when NVML sees GPUs that TensorFlow
    does not (a TensorFlow without its CUDA libraries), else None."""
    if nvml_gpus <= 0 or tensorflow_gpus > 0:
        return None
    return (
        f"NVML sees {nvml_gpus} GPU(s) but TensorFlow sees none, so training "
        "runs on the CPU. This TensorFlow has no CUDA libraries: on Linux, "
        'pip install "tensorflow[and-cuda]" (or "keras-mgpu[gpu]", which '
        "pulls it), then check with `keras-mgpu info`."
    )


def nvml_gpu_count() -> int:
    """GPUs the NVIDIA driver reports (0 without NVML or a driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver: no GPU to speak of
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
