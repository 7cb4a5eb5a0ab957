"""`keras-mgpu info`: versions, devices, GPUs and the strategies that work
here; on Keras's JAX backend (`KERAS_BACKEND=jax`), the JAX version, its
devices and which keras_mgpu components run there (TensorFlow untouched)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import sys

from keras_mgpu.cli._common import (
    gpu_mismatch_note,
    native_stderr_to,
    nvml_gpu_count,
)


def add_parser(sub, parents: list) -> argparse.ArgumentParser:
    """Add `info` to the subcommands `sub`."""
    info = sub.add_parser(
        "info",
        parents=parents,
        help="versions, devices, GPUs and the strategies that work here",
        description=(
            "Print TensorFlow/Keras versions and flavour, physical and "
            "logical devices, GPU names and memory (NVML) and which "
            "tf.distribute strategies work here. With KERAS_BACKEND=jax: "
            "the JAX version and devices, keras.distribution and which "
            "keras_mgpu components run on JAX."
        ),
    )
    return info


def _nvml_lines() -> list[str]:
    try:
        import pynvml
    except ImportError:
        return [
            "NVML: nvidia-ml-py not installed (GPU names and memory need "
            'it: pip install "keras-mgpu[gpu]")'
        ]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [f"NVML: not available ({type(exc).__name__}: no driver?)"]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(driver, bytes):
            driver = driver.decode()
        lines = [f"NVML: driver {driver}"]
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            lines.append(
                f"  GPU {index}: {name}, {memory.total / 2**20:,.0f} MiB "
                f"total, {memory.used / 2**20:,.0f} MiB used"
            )
        if len(lines) == 1:
            lines.append("  no GPU")
        return lines
    except pynvml.NVMLError as exc:
        return [f"NVML: error {type(exc).__name__}: {exc}"]
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _multi_worker_fit_state() -> str:
    import keras as keras3

    from keras_mgpu.distribute import multi_worker_fit

    if multi_worker_fit.keras_code_differences():
        return (
            f"Keras {keras3.version()}'s trainer code differs from the code "
            "it was read from: it patches nothing and warns"
        )
    if multi_worker_fit.keras_version_is_tested(keras3.version()):
        return f"tested with this Keras, {keras3.version()}"
    return (
        f"Keras {keras3.version()}'s trainer code matches a tested release: "
        "it applies"
    )


def strategy_lines(
    is_tf_keras: bool, num_gpus: int, num_cpu_devices: int
) -> list[str]:
    """Which strategies work with `model.fit` here: measured with Keras 3.15
    / tf_keras 2.21 / TF 2.21 (see the README compatibility table)."""
    if num_gpus >= 2:
        mirrored = f"model.fit across the {num_gpus} GPUs"
    elif num_gpus == 1:
        mirrored = "works, 1 replica (one GPU); `--cpu` demos several"
    else:
        mirrored = (
            "no GPU: model.fit across logical CPU devices (keras-mgpu demo "
            f"--devices N; {num_cpu_devices} configured now)"
        )
    lines = [
        f"  MirroredStrategy             {mirrored}",
        "  OneDeviceStrategy            works",
    ]
    if is_tf_keras:
        lines += [
            "  MultiWorkerMirroredStrategy  model.fit works (tf_keras)",
            "  ParameterServerStrategy      model.fit with DatasetCreator "
            "and steps_per_epoch (tf_keras)",
        ]
    else:
        lines += [
            "  MultiWorkerMirroredStrategy  model.fit fails in Keras 3 "
            "(keras#20585) unless you call "
            "keras_mgpu.distribute.enable_multi_worker_fit() first "
            f"({_multi_worker_fit_state()}; examples/multi_worker.py); add "
            "callbacks.BackupAndRestore, WorkerWatchdog, StragglerMonitor",
            "  ParameterServerStrategy      not with Keras 3 model.fit (no "
            "DatasetCreator); use tf_keras (TF_USE_LEGACY_KERAS=1)",
        ]
    lines += [
        "  CentralStorageStrategy       trains, but Keras 3 reports a "
        "wrong loss and Dropout fails; prefer MirroredStrategy",
        "  TPUStrategy                  no TPU here",
    ]
    return lines


def _host_line() -> str:
    try:
        import psutil

        return (
            f"Host: {psutil.cpu_count(logical=True)} CPU threads "
            f"({psutil.cpu_count(logical=False)} cores), "
            f"{psutil.virtual_memory().total / 2**30:.1f} GiB memory"
        )
    except ImportError:  # a dependency, but keep info working without it
        return f"Host: {os.cpu_count()} CPU threads"


def _device_line(device) -> str:
    line = f"  {device.platform}:{device.id} {device.device_kind}"
    stats = None
    with contextlib.suppress(Exception):  # None on CPU; absent on some
        stats = device.memory_stats()
    if stats and stats.get("bytes_limit"):
        line += f", {stats['bytes_limit'] / 2**20:,.0f} MiB for XLA"
    return line


def jax_lines(components: list | None = None) -> list[str]:
    """What `info` prints on the JAX backend (TensorFlow is not imported).

    `components`: `(name, works, why not)` rows (default: read now by
    constructing each component, `keras_mgpu._components`).
    """
    import jax
    import keras

    from keras_mgpu import __version__
    from keras_mgpu._components import (
        FAILED,
        instead_of,
        support_table,
    )

    devices = jax.devices()
    cpus = jax.devices("cpu")
    accelerators = [d for d in devices if d.platform != "cpu"]
    lines = [
        f"keras-mgpu {__version__}",
        f"Python {platform.python_version()} on {platform.platform()}",
        f"Backend: jax (KERAS_BACKEND={os.environ.get('KERAS_BACKEND', '')})",
        f"JAX {jax.__version__}, jaxlib "
        f"{getattr(jax.lib, '__version__', None) or _jaxlib_version()}, "
        f"Keras {keras.__version__}",
        f"Devices ({jax.default_backend()} by default): "
        f"{len(accelerators)} accelerator(s), {len(cpus)} CPU device(s)",
    ]
    lines += [_device_line(d) for d in accelerators]
    if len(cpus) > 1:
        lines.append(
            f"  {len(cpus)} CPU devices (XLA_FLAGS "
            "--xla_force_host_platform_device_count)"
        )
    lines += _nvml_lines()
    nvml_gpus = nvml_gpu_count()
    if nvml_gpus and not accelerators:
        lines.append(
            f"Note: NVML sees {nvml_gpus} GPU(s) but JAX sees none, so "
            'training runs on the CPU: pip install "jax[cuda12]" (or '
            "jax[cuda13] for your driver), then check with `keras-mgpu info`."
        )
    lines.append(_host_line())
    found = [
        f"{name} [{extra}] "
        + ("yes" if importlib.util.find_spec(module) else "no")
        for module, (name, extra) in {
            "matplotlib": ("matplotlib", "plot"),
            "sklearn": ("scikit-learn", "demo"),
            "pynvml": ("nvidia-ml-py", "gpu"),
        }.items()
    ]
    lines.append("Optional: " + ", ".join(found))
    where = (
        f"the {len(accelerators)} {accelerators[0].platform.upper()}(s)"
        if accelerators
        else f"the {len(cpus)} CPU device(s)"
    )
    lines += [
        "Distribution on JAX (keras.distribution; tf.distribute strategies "
        "are TensorFlow's):",
        f"  DataParallel                 model.fit across {where} "
        "(keras-mgpu demo)",
        "  ModelParallel                with a LayoutMap from "
        "keras_mgpu.sharding.plan_layout_map",
        "  several processes            keras_mgpu.distribute.start_cluster()"
        " and shard_across_processes() (the data)",
        "keras_mgpu components on jax (each one constructed here):",
    ]
    rows = support_table() if components is None else components
    width = max(len(name) for name, _, _ in rows)
    for name, works, why in rows:
        if works:
            state = "works"
        elif why.startswith(FAILED):
            state = f"ERROR: {why}"
        else:
            state = f"refuses: {instead_of(why)}"
        lines.append(f"  {name:<{width}}  {state}")
    lines.append(
        "TensorFlow imported: "
        + (
            "yes (by a component above; on JAX none should)"
            if "tensorflow" in sys.modules
            else "no"
        )
    )
    return lines


def _jaxlib_version() -> str:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return "?"


def run(args) -> int:
    """Print what this machine offers; return the exit code."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from keras_mgpu.cli._common import requested_backend

    if requested_backend() == "jax":
        with native_stderr_to(not args.verbose):
            lines = jax_lines()
        print("\n".join(lines))
        return 0
    with native_stderr_to(not args.verbose):
        from keras_mgpu import __version__
        from keras_mgpu._flavour import FLAVOUR, IS_TF_KERAS, keras, tf

        physical = tf.config.list_physical_devices()
        logical = tf.config.list_logical_devices()
        gpu_details = []
        for gpu in tf.config.list_physical_devices("GPU"):
            details = tf.config.experimental.get_device_details(gpu)
            gpu_details.append(
                f"{gpu.name}: {details.get('device_name', '?')}, compute "
                f"capability {details.get('compute_capability', '?')}"
            )
    other = "tf_keras" if not IS_TF_KERAS else "Keras 3"
    other_hint = (
        "set TF_USE_LEGACY_KERAS=1 to use tf_keras (TFMOT)"
        if not IS_TF_KERAS
        else "unset TF_USE_LEGACY_KERAS for Keras 3"
    )
    lines = [
        f"keras-mgpu {__version__}",
        f"Python {platform.python_version()} on {platform.platform()}",
        f"TensorFlow {tf.__version__} (built with CUDA: "
        f"{tf.test.is_built_with_cuda()})",
        f"Keras {keras.__version__}, flavour {FLAVOUR} ({other_hint})",
    ]
    if not IS_TF_KERAS and importlib.util.find_spec("tf_keras") is not None:
        lines[-1] += f"; {other} is installed too"
    lines.append(
        "Physical devices: "
        + ", ".join(d.name.replace("/physical_device:", "") for d in physical)
    )
    lines.append(
        "Logical devices:  "
        + ", ".join(d.name.replace("/device:", "") for d in logical)
    )
    lines += [f"  {line}" for line in gpu_details]
    lines += _nvml_lines()
    note = gpu_mismatch_note(nvml_gpu_count(), len(gpu_details))
    if note is not None:
        lines.append(f"Note: {note}")
    lines.append(_host_line())
    extras = {
        "matplotlib": ("matplotlib", "plot"),
        "sklearn": ("scikit-learn", "demo"),
        "pynvml": ("nvidia-ml-py", "gpu"),
        "tensorflow_model_optimization": ("TFMOT", "tfmot"),
    }
    found = [
        f"{name} [{extra}] "
        + ("yes" if importlib.util.find_spec(module) else "no")
        for module, (name, extra) in extras.items()
    ]
    lines.append("Optional: " + ", ".join(found))
    num_gpus = sum(1 for d in logical if d.device_type == "GPU")
    num_cpus = sum(1 for d in logical if d.device_type == "CPU")
    lines.append(
        f"Strategies with {FLAVOUR} model.fit here (measured with Keras "
        "3.15, tf_keras 2.21, TensorFlow 2.21):"
    )
    lines += strategy_lines(IS_TF_KERAS, num_gpus, num_cpus)
    print("\n".join(lines))
    return 0
