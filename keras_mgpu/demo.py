"""The `keras-mgpu demo` training recipe: a small CNN on scikit-learn's 8x8
digits under `MirroredStrategy` (or, with `model_parallel`, split across
the devices by `apply_placement`), with every keras_mgpu component on.

On Keras's JAX backend (`KERAS_BACKEND=jax`) it trains under
`keras.distribution.DataParallel` across the devices found (GPUs, or CPU
devices from `XLA_FLAGS`), from NumPy arrays, without importing TensorFlow;
each component is used where it constructs on JAX, and the summary names
those that refuse (`BackendNotSupportedError`) and why.

Kept apart from the command line (`keras_mgpu.cli`) so that the recipe reads
as one example of using the pack: gradient accumulation
(`GradientAccumulationOptimizer`), linear learning-rate scaling and warmup
(`LearningRateScaler`, `LearningRateWarmup`), both monitors
(`MemoryMonitor`, `GPULoadMonitor`) and a recomputed block
(`RecomputeGrad`), with a `CSVLogger` whose file `keras-mgpu report`
turns into the same PNG report.

Logical CPU devices must exist before TensorFlow (or JAX) initialises its
runtime: call `configure_devices` first, before anything builds a tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
import warnings
from typing import Any, TextIO

import numpy as np

from keras_mgpu._flavour import keras, tf
from keras_mgpu.backend import backend as _backend
from keras_mgpu.testing import set_random_seed

DEMO_EXTRA_HINT = 'pip install "keras-mgpu[demo]"'

# The learning rate was tuned for Adam at this batch size; the scaler
# multiplies it by global batch / BASE_BATCH_SIZE.
BASE_LEARNING_RATE = 1e-3
BASE_BATCH_SIZE = 32


@dataclasses.dataclass
class DemoConfig:
    """Settings of one demo run (the `keras-mgpu demo` options)."""

    output_dir: str
    epochs: int = 10
    batch_size: int = 32  # per replica, per micro-step
    # When set, batch_size and accumulation_steps come from the memory
    # search (`keras_mgpu.configure_batch`).
    global_batch_size: int | None = None
    memory_budget_mb: float | None = None
    accumulation_steps: int = 2
    accumulation: bool = True
    warmup: bool = True
    warmup_epochs: float = 2.0
    scaling: bool = True
    monitors: bool = True
    recompute: bool = True
    seed: int = 0
    progress: bool = True
    # Components that refused this backend at construction: name -> why.
    skipped: dict = dataclasses.field(default_factory=dict)
    # Split the model across the devices (apply_placement) instead of
    # mirroring it; micro_batches > 1 pipelines it.
    model_parallel: bool = False
    micro_batches: int = 1


def configure_devices(
    num_devices: int | None = None, use_gpus: bool = True
) -> dict[str, Any]:
    """Pick the devices the demo trains on, before TensorFlow starts.

    With GPUs visible (and `use_gpus`), the first `num_devices` GPUs (all by
    default) are used, with memory growth on, so the memory figures show
    what the model needs rather than TensorFlow's up-front reservation.
    Otherwise the host CPU is split into `num_devices` (default 2) logical
    devices, so `MirroredStrategy` has replicas to mirror across.

    Returns a dict: `kind` ("GPU" or "CPU"), `devices` (logical device
    names) and `gpu_names`.

    On JAX, the same through JAX: GPUs (or other accelerators) JAX sees,
    with `XLA_PYTHON_CLIENT_PREALLOCATE=false` unless set (figures show
    what the model needs); otherwise `num_devices` CPU devices
    (`--xla_force_host_platform_device_count` in `XLA_FLAGS`).
    `devices` are then `keras.distribution.list_devices` names ("cpu:0").

    Raises:
        ValueError: more GPUs asked for than there are.
        RuntimeError: TensorFlow's runtime is already initialised (a tensor
            was built first), so devices can no longer be configured.
    """
    if _backend() == "jax":
        return _configure_jax_devices(num_devices, use_gpus)
    gpus = tf.config.list_physical_devices("GPU") if use_gpus else []
    if gpus and num_devices is not None and num_devices > len(gpus):
        raise ValueError(
            f"--devices {num_devices} asks for more GPUs than the "
            f"{len(gpus)} visible here. Use --devices {len(gpus)} or fewer, "
            "or --cpu to split the CPU into logical devices instead."
        )
    try:
        if gpus:
            gpus = gpus[: num_devices or len(gpus)]
            tf.config.set_visible_devices(gpus, "GPU")
            for gpu in gpus:
                tf.config.experimental.set_memory_growth(gpu, True)
        else:
            if tf.config.list_physical_devices("GPU"):
                tf.config.set_visible_devices([], "GPU")
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu,
                [tf.config.LogicalDeviceConfiguration()] * (num_devices or 2),
            )
    except RuntimeError as exc:
        raise RuntimeError(
            "TensorFlow was initialised before the demo could set up its "
            "devices (logical CPU devices and GPU memory growth must be "
            "configured first). Run the demo in a fresh process: "
            "`keras-mgpu demo`."
        ) from exc
    kind = "GPU" if gpus else "CPU"
    devices = [d.name for d in tf.config.list_logical_devices(kind)]
    gpu_names = []
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        gpu_names.append(details.get("device_name", gpu.name))
    return {"kind": kind, "devices": devices, "gpu_names": gpu_names}


def _configure_jax_devices(
    num_devices: int | None, use_gpus: bool
) -> dict[str, Any]:
    from keras_mgpu.testing import configure_cpu_devices

    if not use_gpus:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cpu_count = 2 if num_devices is None else num_devices
    try:
        # Sets XLA_FLAGS before JAX starts; a GPU machine ignores it.
        configure_cpu_devices(cpu_count)
        cpu_ok = True
    except RuntimeError:
        cpu_ok = False
    import jax

    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    accelerators = accelerators if use_gpus else []
    if accelerators:
        if num_devices is not None and num_devices > len(accelerators):
            raise ValueError(
                f"--devices {num_devices} asks for more GPUs than the "
                f"{len(accelerators)} visible here. Use --devices "
                f"{len(accelerators)} or fewer, or --cpu to split the CPU "
                "into devices instead."
            )
        chosen = accelerators[: num_devices or len(accelerators)]
        return {
            "kind": "GPU",
            "devices": [f"{d.platform}:{d.id}" for d in chosen],
            "gpu_names": [d.device_kind for d in chosen],
        }
    if not cpu_ok:
        raise RuntimeError(
            f"JAX started with {len(jax.devices('cpu'))} CPU devices before "
            f"the demo could ask for {cpu_count}. Run the demo in a fresh "
            "process: `keras-mgpu demo`."
        )
    return {
        "kind": "CPU",
        "devices": [f"cpu:{d.id}" for d in jax.devices("cpu")],
        "gpu_names": [],
    }


def load_digits_split(seed: int = 0) -> tuple:
    """scikit-learn's 8x8 digits (1797 images, shipped with the package),
    scaled to [0, 1], split 80/20 stratified: `(x_train, y_train, x_test,
    y_test)`, images shaped (8, 8, 1)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise ImportError(
            "The demo trains on scikit-learn's digits dataset. Install it "
            f"with: {DEMO_EXTRA_HINT}"
        ) from exc
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    labels = digits.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=seed
    )
    return x_train, y_train, x_test, y_test


def build_model(recompute: bool = True) -> Any:
    """A small CNN; its middle conv block is wrapped in `RecomputeGrad`.

    The block's two 32-channel activations are recomputed in the backward
    pass instead of being stored (on a model this small that saves little:
    the point is showing the wrapper train correctly under the strategy).
    """
    from keras_mgpu.layers import RecomputeGrad

    inputs = keras.Input((8, 8, 1), name="image")
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    block = keras.Sequential(
        [
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        ],
        name="conv_block",
    )
    x = (
        RecomputeGrad(block, name="recompute_conv_block")
        if recompute
        else block
    )(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_cnn")


class ProgressBar(keras.callbacks.Callback):
    """One line per epoch, and on a terminal a live `keras.utils.Progbar`
    over the whole run.

    Keras's own per-epoch bar shows every log key, which the monitors make
    too wide to read; this shows loss and accuracy live, and loss,
    accuracy, validation accuracy and learning rate once per epoch.
    """

    def __init__(
        self, epochs: int, steps_per_epoch: int, stream: TextIO | None = None
    ) -> None:
        super().__init__()
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.stream = stream or sys.stdout
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._progbar: Any = None
        self._epoch = 0
        self._epoch_start = 0.0

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.live:
            # Keras's bar writes to sys.stdout, which is our stream here.
            self._progbar = keras.utils.Progbar(
                self.epochs * self.steps_per_epoch,
                width=28,
                stateful_metrics=["loss", "accuracy"],
                unit_name="step",
            )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._epoch_start = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._progbar is None:
            return
        logs = logs or {}
        values = [
            (key, float(logs[key]))
            for key in ("loss", "accuracy")
            if key in logs
        ]
        step = self._epoch * self.steps_per_epoch + batch + 1
        self._progbar.update(step, values=values)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        line = (
            f"epoch {epoch + 1:>{len(str(self.epochs))}}/"
            f"{self.epochs}  loss {logs.get('loss', math.nan):.4f}  "
            f"accuracy {logs.get('accuracy', math.nan):.4f}  "
            f"val_accuracy {logs.get('val_accuracy', math.nan):.4f}  "
            f"lr {logs.get('learning_rate', math.nan):.2e}  "
            f"{time.perf_counter() - self._epoch_start:.1f}s"
        )
        self.stream.write(("\n" if self.live else "") + line + "\n")
        self.stream.flush()


class StepLogger(keras.callbacks.Callback):
    """Writes the learning rate after every batch to a CSV file (columns
    `epoch`, fractional with 1.0 at the end of the first epoch, `update`
    and `learning_rate`), so the report draws the warmup ramp rather than
    one point per epoch. Its cost: two device reads per batch (the update
    counter and the learning rate), and, as it overrides
    `on_train_batch_end`, Keras's asynchronous batch dispatch is off in the
    demo (JAX); the pack's own callbacks keep it."""

    def __init__(self, path: str, steps_per_epoch: int) -> None:
        super().__init__()
        self.path = path
        self.steps_per_epoch = steps_per_epoch
        self._rows: list = []
        self._epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._rows = [(0.0, 0, self._learning_rate())]

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def _learning_rate(self) -> float:
        return _learning_rate(self.model.optimizer)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._rows.append(
            (
                self._epoch + (batch + 1) / self.steps_per_epoch,
                int(self.model.optimizer.iterations.numpy()),
                self._learning_rate(),
            )
        )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Rewritten each epoch, so an interrupted run still leaves a file.
        with open(self.path, "w") as f:
            f.write("epoch,update,learning_rate\n")
            for fraction, update, lr in self._rows:
                f.write(f"{fraction:.6g},{update},{lr!r}\n")


class _LogLearningRate(keras.callbacks.Callback):
    """Logs `learning_rate` when neither LR callback does (both turned off),
    so the report's learning-rate panel is never empty."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None and "learning_rate" not in logs:
            logs["learning_rate"] = _learning_rate(self.model.optimizer)


def _learning_rate(optimizer: Any) -> float:
    """The learning rate of `optimizer`'s next update.

    On JAX, Keras's own `optimizer.learning_rate` (a schedule evaluated at
    `iterations`), which needs no TensorFlow.
    """
    if _backend() == "jax":
        return float(np.asarray(optimizer.learning_rate))
    from keras_mgpu.schedules import current_learning_rate

    return current_learning_rate(optimizer)


def _peak_memory(history: dict, kind: str, devices: list) -> list:
    """(device label, peak MB over the run, note) from the monitor's logs."""
    rows = []

    def peak(key: str) -> float:
        values = [v for v in history.get(key, []) if math.isfinite(v)]
        return max(values) if values else math.nan

    jax = _backend() == "jax"
    if kind == "GPU":
        for device in devices:
            short = device.split("device:")[-1]  # "GPU:0" (or "gpu:0")
            kind_name, _, index = short.partition(":")
            label = f"{kind_name.lower()}{index or 0}"  # the monitor's key
            rows.append(
                (
                    short.upper(),
                    peak(f"mem/{label}_peak_mb"),
                    "XLA allocator" if jax else "TensorFlow allocator",
                )
            )
    elif jax:
        # JAX keeps no allocator statistics for CPU devices.
        figures = [
            peak(key)
            for key in history
            if key.startswith("mem/cpu") and key.endswith("_peak_mb")
        ]
        if any(math.isfinite(v) for v in figures):
            rows.append(
                (
                    f"CPU ({len(devices)} devices)",
                    max(v for v in figures if math.isfinite(v)),
                    "XLA allocator",
                )
            )
    # On CPU neither allocator figure is the process's memory: TensorFlow's
    # CPU allocator does not see oneDNN's buffers (a run holding 812 MB
    # read 2.0 MB there), and JAX keeps none for CPU devices. The figure
    # that means "peak memory" there is the process's own high-water mark.
    rows.append(
        (
            "host process",
            _peak_rss_mb(),
            "peak resident set size of this process (the OS's "
            f"high-water mark: {_process_holders()})",
        )
    )
    return rows


def _process_holders(modules: Any = None, environ: Any = None) -> str:
    """What the process's memory holds, as loaded in it: a JAX run imports
    neither TensorFlow nor its oneDNN kernels (on by default on x86 CPUs,
    off with `TF_ENABLE_ONEDNN_OPTS=0`)."""
    modules = sys.modules if modules is None else modules
    environ = os.environ if environ is None else environ
    holders = []
    if "jax" in modules:
        holders.append("JAX")
    if "tensorflow" in modules:
        onednn = environ.get("TF_ENABLE_ONEDNN_OPTS", "1") != "0"
        holders += ["TensorFlow", "oneDNN"] if onednn else ["TensorFlow"]
    holders += ["XLA", "Python"]
    return ", ".join(holders[:-1]) + " and " + holders[-1]


def _peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MB (NaN where the
    OS does not report it)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def _default_device_info() -> dict:
    if _backend() == "jax":
        import jax

        gpus = [d for d in jax.devices() if d.platform != "cpu"]
        chosen = gpus or jax.devices("cpu")
        return {
            "kind": "GPU" if gpus else "CPU",
            "devices": [f"{d.platform}:{d.id}" for d in chosen],
            "gpu_names": [d.device_kind for d in gpus],
        }
    kind = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    devices = [d.name for d in tf.config.list_logical_devices(kind)]
    return {"kind": kind, "devices": devices, "gpu_names": []}


@dataclasses.dataclass
class _Paths:
    """Where one demo run writes its files."""

    csv: str
    steps: str
    png: str
    summary: str

    @classmethod
    def under(cls, output_dir: str) -> _Paths:
        os.makedirs(output_dir, exist_ok=True)
        return cls(
            csv=os.path.join(output_dir, "history.csv"),
            steps=os.path.join(output_dir, "history_steps.csv"),
            png=os.path.join(output_dir, "report.png"),
            summary=os.path.join(output_dir, "summary.json"),
        )


def _whole_steps(
    config: DemoConfig, replicas: int, examples: int
) -> tuple[int, int]:
    """(examples per step, whole steps per epoch) on either backend."""
    step_batch = config.batch_size * replicas
    steps_per_epoch = examples // step_batch
    if steps_per_epoch < 1:
        raise ValueError(
            f"--batch-size {config.batch_size} x {replicas} replicas = "
            f"{step_batch} is larger than the {examples} training "
            "images: use a smaller --batch-size"
        )
    return step_batch, steps_per_epoch


def _datasets(
    config: DemoConfig, replicas: int, data: tuple
) -> tuple[Any, Any, int]:
    """(train, test, steps per epoch): one micro-step of every replica."""
    x_train, y_train, x_test, y_test = data
    step_batch, steps_per_epoch = _whole_steps(config, replicas, len(x_train))
    # Whole batches only: every micro-step gives each replica the same
    # number of examples, and the train step is traced once.
    train = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=config.seed, reshuffle_each_iteration=True)
        .batch(step_batch, drop_remainder=True)
        .prefetch(2)
    )
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(
        step_batch
    )
    return train, test, steps_per_epoch


def _compiled_model(config: DemoConfig, strategy: Any) -> tuple[Any, int]:
    """The compiled demo model and the examples each update averages."""
    from keras_mgpu import GradientAccumulationOptimizer
    from keras_mgpu.distribute import global_batch_size

    steps = config.accumulation_steps if config.accumulation else 1
    with strategy.scope():
        model = build_model(recompute=config.recompute)
        if config.model_parallel:
            from keras_mgpu.placement import apply_placement

            # The devices configure_devices left visible, one stage each.
            model = apply_placement(model, micro_batches=config.micro_batches)
        optimizer = keras.optimizers.Adam(BASE_LEARNING_RATE)
        if config.accumulation:
            optimizer = GradientAccumulationOptimizer(optimizer, steps)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        examples_per_update = global_batch_size(
            config.batch_size, strategy, accumulation_steps=steps
        )
    return model, examples_per_update


def _batch_by_memory(
    config: DemoConfig, strategy: Any, data: tuple
) -> tuple[DemoConfig, dict]:
    """`config` with the per-replica batch and accumulation steps that
    reach `config.global_batch_size` with the largest micro-batch that
    fits (`configure_batch`, which prints why), and what it found."""
    from keras_mgpu import configure_batch

    x_train, y_train = data[0], data[1]
    replicas = strategy.num_replicas_in_sync
    if config.global_batch_size > len(x_train):
        raise ValueError(
            f"--global-batch {config.global_batch_size} is larger than the "
            f"{len(x_train)} training images: use at most {len(x_train)}"
        )
    plain = dataclasses.replace(config, accumulation=False)
    model, _ = _compiled_model(plain, strategy)
    setup = configure_batch(
        model,
        (x_train, y_train),
        config.global_batch_size,
        base_batch_size=BASE_BATCH_SIZE if config.scaling else None,
        memory_budget_mb=config.memory_budget_mb,
        # One step of every replica must fit in the training set.
        max_batch_size=len(x_train) // replicas,
        strategy=strategy,
        verbose=int(config.progress),
    )
    # The probe model drew initial weights: the trained one starts from
    # the same ones as without the search.
    set_random_seed(config.seed)
    steps = setup.accumulation_steps
    search = setup.search
    found = {
        "largest_batch_size": search.batch_size,
        "peak_mb": search.peak_mb,
        "measured_peak_mb": search.measured_peak_mb,
        "budget_mb": search.budget_mb,
        "budget_source": search.budget_source,
        "fixed_mb": search.fixed_mb,
        "per_sample_mb": search.per_sample_mb,
        "search_seconds": search.search_seconds,
        "explanation": setup.explanation,
    }
    return (
        dataclasses.replace(
            config,
            batch_size=setup.per_replica_batch_size,
            accumulation=steps > 1,
            accumulation_steps=steps,
        ),
        found,
    )


# The flag of DemoConfig each component is used under.
_COMPONENT_FLAGS = {
    "GradientAccumulationOptimizer": "accumulation",
    "LearningRateScaler": "scaling",
    "LearningRateWarmup": "warmup",
    "MemoryMonitor": "monitors",
    "GPULoadMonitor": "monitors",
    "ThroughputMonitor": "monitors",
    "RecomputeGrad": "recompute",
}


def drop_refused_components(config: DemoConfig) -> DemoConfig:
    """`config` without the components that refuse this backend.

    Each component that `config` turns on is constructed once; one that
    raises `BackendNotSupportedError` is turned off (the monitors share
    `monitors`, which stays on while any works) and recorded in
    `skipped` with the reason, for the summary. On TensorFlow every one
    constructs.
    """
    from keras_mgpu._components import _probes, construct

    probes = _probes()
    skipped = dict(config.skipped)
    for name, flag in _COMPONENT_FLAGS.items():
        if getattr(config, flag):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, why = construct(probes[name])
            if why is not None:
                skipped[name] = why
    off = {
        flag: False
        for flag in set(_COMPONENT_FLAGS.values())
        if getattr(config, flag)
        and all(
            name in skipped
            for name, owner in _COMPONENT_FLAGS.items()
            if owner == flag
        )
    }
    return dataclasses.replace(config, skipped=skipped, **off)


def _callbacks(config: DemoConfig, paths: _Paths, steps_per_epoch: int) -> list:
    """The demo's callbacks, in the order the README recommends."""
    from keras_mgpu import callbacks as mgpu_callbacks

    callbacks: list = []
    if config.scaling:
        # Listed before the warmup, so the warmup ramps to the scaled rate.
        callbacks.append(
            mgpu_callbacks.LearningRateScaler(
                base_batch_size=BASE_BATCH_SIZE,
                per_replica_batch_size=config.batch_size,
                verbose=0,
            )
        )
    if config.warmup:
        callbacks.append(
            mgpu_callbacks.LearningRateWarmup(
                warmup_epochs=config.warmup_epochs
            )
        )
    callbacks.append(_LogLearningRate())
    callbacks.append(StepLogger(paths.steps, steps_per_epoch))
    if config.monitors:
        if "MemoryMonitor" not in config.skipped:
            callbacks.append(mgpu_callbacks.MemoryMonitor())
        if "GPULoadMonitor" not in config.skipped:
            callbacks.append(mgpu_callbacks.GPULoadMonitor(interval=0.25))
        if "ThroughputMonitor" not in config.skipped:
            callbacks.append(mgpu_callbacks.ThroughputMonitor(window_size=10))
    if config.progress:
        callbacks.append(ProgressBar(config.epochs, steps_per_epoch))
    # Last: it writes the logs the callbacks above added.
    callbacks.append(keras.callbacks.CSVLogger(paths.csv))
    return callbacks


def _fit_run(
    model: Any,
    fit_kwargs: dict,
    config: DemoConfig,
    paths: _Paths,
    steps_per_epoch: int,
    facts: dict,
) -> dict:
    """`model.fit(**fit_kwargs)` with the demo's callbacks, silently; returns
    the run's record: the logs, `facts` (what the backend's path knows:
    replicas, distribution, images, ...), the updates made, the training
    seconds and the monitors' notes.

    The monitors' warnings (no NVML, CPU-only figures) become one-line
    notes under the summary instead of tracebacks in the middle of it.
    """
    fit_kwargs = dict(
        fit_kwargs,
        callbacks=_callbacks(config, paths, steps_per_epoch),
        verbose=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_start = time.perf_counter()
        history = model.fit(**fit_kwargs)
        train_seconds = time.perf_counter() - train_start
    notes = []
    for warning in caught:
        if type(warning.message).__name__ == "MonitorWarning":
            text = str(warning.message).split(". ")[0].rstrip(".") + "."
            if text not in notes:
                notes.append(text)
    return {
        "logs": history.history,
        **facts,
        "updates": int(np.asarray(model.optimizer.iterations)),
        "train_seconds": train_seconds,
        "notes": notes,
    }


def _summary(
    config: DemoConfig,
    device_info: dict,
    run: dict,
    paths: _Paths,
) -> dict:
    """The summary dict of a finished run (`run`: what `run_demo` saw)."""
    from keras_mgpu.schedules import scaled_learning_rate

    logs = run["logs"]
    scaled_lr = (
        scaled_learning_rate(
            BASE_LEARNING_RATE, run["examples_per_update"], BASE_BATCH_SIZE
        )
        if config.scaling
        else BASE_LEARNING_RATE
    )
    peak_memory = [
        {"device": d, "peak_mb": None if math.isnan(p) else p, "what": w}
        for d, p, w in _peak_memory(
            logs, device_info["kind"], device_info["devices"]
        )
    ]
    return {
        "device_kind": device_info["kind"],
        "devices": device_info["devices"],
        "gpu_names": device_info.get("gpu_names", []),
        "replicas": run["replicas"],
        "per_replica_batch_size": config.batch_size,
        "accumulation_steps": (
            config.accumulation_steps if config.accumulation else 1
        ),
        "global_batch_size": run["examples_per_update"],
        "base_learning_rate": BASE_LEARNING_RATE,
        "base_batch_size": BASE_BATCH_SIZE,
        "learning_rate": scaled_lr,
        "final_learning_rate": float(logs["learning_rate"][-1]),
        "scaling": config.scaling,
        "warmup_epochs": config.warmup_epochs if config.warmup else 0,
        "recompute": config.recompute,
        "monitors": config.monitors,
        "epochs": config.epochs,
        "updates": run["updates"],
        "final_accuracy": float(logs["val_accuracy"][-1]),
        "test_images": run["test_images"],
        "final_train_accuracy": float(logs["accuracy"][-1]),
        "final_loss": float(logs["val_loss"][-1]),
        "peak_memory": peak_memory if config.monitors else [],
        "throughput": _throughput(logs) if config.monitors else {},
        "train_seconds": run["train_seconds"],
        "seed": config.seed,
        "csv": os.path.abspath(paths.csv),
        "steps_csv": os.path.abspath(paths.steps),
        "report": os.path.abspath(paths.png),
        "notes": run["notes"] + _skipped_notes(config.skipped),
        "skipped": dict(config.skipped),
        "backend": _backend(),
        "backend_version": _backend_version(),
        "distribution": run["distribution"],
        "train_images": run.get("train_images"),
        "tensorflow_imported": run.get("tensorflow_imported", True),
        "batch_by_memory": run.get("batch_by_memory"),
    }


def _throughput(logs: dict) -> dict:
    """The last epoch's `ThroughputMonitor` figures (keys without the
    `perf/` group and any `w<rank>_` prefix); {} when it did not log."""
    figures = {}
    for key, values in logs.items():
        match = re.match(r"^perf/(w\d+_)?([a-z_]+)$", key)
        if match and values:
            figures[match.group(2)] = float(values[-1])
    return figures


def _throughput_row(figures: dict) -> str:
    def shown(name: str, text: str) -> str | None:
        value = figures.get(name, math.nan)
        return None if math.isnan(value) else text.format(value)

    parts = [
        shown("samples_per_sec", "{:,.0f} samples/s"),
        shown("tflops_per_device", "{:.3g} TFLOP/s per device"),
        shown("mfu", "MFU {:.1%}"),
        shown("compile_seconds", "{:.1f} s compiling (left out)"),
    ]
    return ", ".join(p for p in parts if p) or "n/a"


def _skipped_notes(skipped: dict) -> list:
    return [f"{name} skipped: {why}" for name, why in skipped.items()]


def _backend_version() -> str:
    if _backend() == "jax":
        import jax

        return f"JAX {jax.__version__}, Keras {keras.__version__}"
    return f"TensorFlow {tf.__version__}, Keras {keras.__version__}"


def _placement_summary(config: DemoConfig, model: Any) -> dict:
    """Where the model-parallel demo put its stages (placement_report)."""
    from keras_mgpu.placement import placement_report

    return {
        "model_parallel": True,
        "micro_batches": config.micro_batches,
        "placement": placement_report(model, print_fn=None),
    }


def run_demo(config: DemoConfig, device_info: dict | None = None) -> dict:
    """Train the demo model and write its CSV log, PNG report and summary.

    Call `configure_devices` first (or pass its result as `device_info`).
    Returns the summary dict that is also written to `summary.json`.
    """
    from keras_mgpu.report import plot_training_report

    start = time.perf_counter()
    device_info = device_info or _default_device_info()
    paths = _Paths.under(config.output_dir)
    # Before seeding: building the probes draws initializer seeds.
    config = drop_refused_components(config)
    set_random_seed(config.seed)
    data = load_digits_split(config.seed)
    if _backend() == "jax":
        config, model, run = _train_on_jax(config, device_info, paths, data)
    else:
        config, model, run = _train_on_tensorflow(
            config, device_info, paths, data
        )
    summary = _summary(config, device_info, run, paths)
    if config.model_parallel:
        summary.update(_placement_summary(config, model))
    plot_training_report(
        paths.csv, paths.png, steps=paths.steps, title=_report_title(summary)
    )
    summary["demo_seconds"] = time.perf_counter() - start
    with open(paths.summary, "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _train_on_tensorflow(
    config: DemoConfig, device_info: dict, paths: _Paths, data: tuple
) -> tuple:
    """Train under `MirroredStrategy` (or placed): (config, model, run)."""
    strategy = (
        tf.distribute.get_strategy()  # one replica spanning the devices
        if config.model_parallel
        else tf.distribute.MirroredStrategy(devices=device_info["devices"])
    )
    replicas = strategy.num_replicas_in_sync
    batch_by_memory = None
    if config.global_batch_size is not None:
        config, batch_by_memory = _batch_by_memory(config, strategy, data)
    train, test, steps_per_epoch = _datasets(config, replicas, data)
    model, examples_per_update = _compiled_model(config, strategy)
    run = _fit_run(
        model,
        dict(x=train, epochs=config.epochs, validation_data=test),
        config,
        paths,
        steps_per_epoch,
        {
            "replicas": replicas,
            "distribution": (
                "apply_placement"
                if config.model_parallel
                else "MirroredStrategy"
            ),
            "examples_per_update": examples_per_update,
            "test_images": len(data[2]),
            "train_images": steps_per_epoch * config.batch_size * replicas,
            "batch_by_memory": batch_by_memory,
        },
    )
    return config, model, run


def _train_on_jax(
    config: DemoConfig, device_info: dict, paths: _Paths, data: tuple
) -> tuple:
    """Train under `keras.distribution.DataParallel` from NumPy arrays
    (TensorFlow untouched): (config, model, run)."""
    if config.model_parallel:
        raise ValueError(
            "--model-parallel splits the CNN with apply_placement, which "
            "runs on TensorFlow only; on JAX use "
            "keras.distribution.ModelParallel with a LayoutMap"
        )
    if config.global_batch_size is not None:
        raise ValueError(
            "--global-batch measures memory with TensorFlow's allocator "
            "(configure_batch), TensorFlow only for now; on JAX give "
            "--batch-size and --accumulation-steps"
        )
    distribution = keras.distribution.DataParallel(
        devices=device_info["devices"]
    )
    replicas = len(device_info["devices"])
    x_train, y_train, x_test, y_test = data
    step_batch, steps_per_epoch = _whole_steps(config, replicas, len(x_train))
    # Whole batches only, as on TensorFlow (drop_remainder): every step
    # splits evenly over the devices and the step is compiled once.
    # `fit` shuffles these examples each epoch.
    keep = steps_per_epoch * step_batch
    order = np.random.default_rng(config.seed).permutation(len(x_train))
    x_train, y_train = x_train[order[:keep]], y_train[order[:keep]]
    # Validation batches must split evenly over the devices too.
    test_keep = len(x_test) - len(x_test) % replicas
    x_test, y_test = x_test[:test_keep], y_test[:test_keep]
    with distribution.scope():
        model, examples_per_update = _compiled_model(config, distribution)
        run = _fit_run(
            model,
            dict(
                x=x_train,
                y=y_train,
                batch_size=step_batch,
                epochs=config.epochs,
                shuffle=True,
                validation_data=(x_test, y_test),
                validation_batch_size=step_batch,
            ),
            config,
            paths,
            steps_per_epoch,
            {
                "replicas": replicas,
                "distribution": "keras.distribution.DataParallel",
                "examples_per_update": examples_per_update,
                "test_images": test_keep,
                "train_images": keep,
                "batch_by_memory": None,
            },
        )
    # Nothing on this path needs it; a component that imports it shows.
    run["tensorflow_imported"] = "tensorflow" in sys.modules
    return config, model, run


def _report_title(summary: dict) -> str:
    if summary.get("model_parallel"):
        where = (
            f"{len(_stages(summary))} x {summary['device_kind']} "
            "(model parallel)"
        )
    else:
        how = summary.get("distribution", "MirroredStrategy")
        if summary.get("backend") == "jax":  # short: the title is one line
            how = how.replace("keras.distribution.", "") + " on JAX"
        where = f"{summary['replicas']} x {summary['device_kind']} ({how})"
    parts = [
        f"keras-mgpu demo: digits CNN, {where}",
        f"global batch {summary['global_batch_size']} = "
        f"{summary['per_replica_batch_size']} x {summary['replicas']} x "
        f"{summary['accumulation_steps']} accumulation",
        f"final accuracy {summary['final_accuracy']:.3f}",
    ]
    return "  |  ".join(parts)


def _batch_by_memory_rows(found: dict | None) -> list:
    if not found:
        return []
    return [
        (
            "batch by memory",
            f"largest micro-batch {found['largest_batch_size']:,} "
            f"(measured peak {found['measured_peak_mb']:,.1f} MB of a "
            f"{found['budget_mb']:,.1f} MB budget; search "
            f"{found['search_seconds']:.1f} s)",
        )
    ]


def _stages(summary: dict) -> list:
    """The placement rows that hold a stage (not only optimizer counters)."""
    return [row for row in summary["placement"] if row["stage"] is not None]


def _model_parallel_devices(summary: dict) -> str:
    stages = len(_stages(summary))
    kind = "GPU" if summary["device_kind"] == "GPU" else "logical CPU device"
    pipelining = (
        f", {summary['micro_batches']} micro-batches per step"
        if summary["micro_batches"] > 1
        else ""
    )
    return f"model split into {stages} stages on {stages} x {kind}{pipelining}"


def _placement_rows(summary: dict) -> list:
    """One row per stage: device, layers, parameters (model parallel)."""
    rows = []
    for index, stage in enumerate(_stages(summary)):
        device = stage["device"].replace("/device:", "")
        rows.append(
            (
                "placement" if index == 0 else "",
                f"{device}: {', '.join(stage['layers'])} "
                f"({stage['params']:,} params)",
            )
        )
    return rows


def format_summary(summary: dict, total_seconds: float | None = None) -> str:
    """The summary table the CLI prints after training."""
    on_off = {True: "on", False: "off"}
    if summary["device_kind"] == "GPU":
        names = summary.get("gpu_names") or summary["devices"]
        devices = (
            f"{summary['replicas']} x GPU ({', '.join(sorted(set(names)))})"
        )
    elif summary.get("backend") == "jax":
        devices = f"{summary['replicas']} x CPU device"
    else:
        devices = f"{summary['replicas']} x logical CPU device"
    lr = f"{summary['learning_rate']:.3g}"
    if summary["scaling"]:
        lr += (
            f" (= {summary['base_learning_rate']:g} x "
            f"{summary['global_batch_size']}/{summary['base_batch_size']},"
            " linear rule)"
        )
    else:
        lr += " (scaling off)"
    warmup = (
        f"{summary['warmup_epochs']:g} epochs, linear"
        if summary["warmup_epochs"]
        else "off"
    )
    batch = (
        f"{summary['global_batch_size']} = "
        f"{summary['per_replica_batch_size']} per replica x "
        f"{summary['replicas']} replicas x {summary['accumulation_steps']} "
        "accumulation steps"
    )
    accumulation = (
        f"{summary['accumulation_steps']} micro-steps per update"
        if summary["accumulation_steps"] > 1
        else "off"
    )
    accuracy = (
        f"{summary['final_accuracy']:.4f} on {summary['test_images']} "
        f"held-out digits (train {summary['final_train_accuracy']:.4f})"
    )
    if summary.get("model_parallel"):
        devices = _model_parallel_devices(summary)
    else:
        devices += f" under {summary.get('distribution', 'MirroredStrategy')}"
    rows = [
        (
            "backend",
            f"{summary.get('backend', 'tensorflow')} "
            f"({summary.get('backend_version', '')})",
        ),
        ("devices", devices),
        ("global batch", batch),
        *_batch_by_memory_rows(summary.get("batch_by_memory")),
        ("accumulation", accumulation),
        ("scaled learning rate", lr),
        ("warmup", warmup),
        ("recompute", on_off[summary["recompute"]] + " (conv_block)"),
        ("updates", f"{summary['updates']} in {summary['epochs']} epochs"),
        ("final accuracy", accuracy),
    ]
    if summary.get("model_parallel"):
        rows += _placement_rows(summary)
    skipped = summary.get("skipped") or {}
    if skipped:
        rows.append(
            (
                "skipped",
                f"{', '.join(skipped)} (refused on "
                f"{summary.get('backend')}; see the notes)",
            )
        )
    if summary["peak_memory"]:
        for index, row in enumerate(summary["peak_memory"]):
            peak = row["peak_mb"]
            value = "n/a" if peak is None else f"{peak:,.1f} MB"
            rows.append(
                (
                    "peak memory" if index == 0 else "",
                    f"{row['device']}: {value} ({row['what']})",
                )
            )
    else:
        rows.append(("peak memory", "monitors off"))
    if summary.get("throughput"):
        rows.append(("throughput", _throughput_row(summary["throughput"])))
    time_text = f"{summary['train_seconds']:.1f} s training"
    if total_seconds is not None:
        time_text += f", {total_seconds:.1f} s in all"
    rows.append(("time", time_text))
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {value}" for name, value in rows]
    rule = "  " + "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([rule, *lines, rule])
