"""One real training step of a copy of the user's model, on one device,
measured with TensorFlow's allocator.

The copy is rebuilt from the model's configuration and compiled from its
compile configuration (loss, metrics, optimizer), so the step is the one
`fit` runs (forward, backward, optimizer update, custom `train_step`
included) while the user's weights and optimizer state are never touched.
It is built in a thread of its own: `tf.distribute` keeps the strategy
scope per thread, so the copy lives on one device under a
`OneDeviceStrategy` even when the caller is inside a `MirroredStrategy`
(or multi-worker) scope.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mgpu._flavour import flavour_of, keras_of, tf
from keras_mgpu.backend.keras_serialization import tensorflow_left_alone
from keras_mgpu.batch_size.samples import SampleBatches
from keras_mgpu.batch_size.search import OutOfMemory
from keras_mgpu.monitoring.tf_memory import TFMemoryReader

# Each batch size the search tries runs this many steps of `fit` and the
# highest per-step peak is kept: the first step (which traces) and the
# steady state, where `fit` holds the next batch while a step runs.
STEPS = 3
# The answer is confirmed over a longer run of `fit` (see
# `search._Search.confirm`): with parallel ops the order in which threads
# free buffers varies, and with it the peak, from step to step (over ~15%
# for an MLP on CPU), so a few steps can all peak low.
CONFIRM_STEPS = 12


class AllocatorStatsUnavailable(RuntimeError):
    """TensorFlow keeps no allocator statistics for the probe's device."""


class ModelNotCopyable(TypeError):
    """The model cannot be rebuilt from its configuration."""


def memory_reader() -> Any:
    """The allocator reader the probe uses (replaced by tests)."""
    return TFMemoryReader()


def allocator_stats_hint(device: str) -> str:
    """What to do when `device` has no allocator statistics."""
    if device.startswith("CPU"):
        return (
            f"TensorFlow keeps no allocator statistics for {device}: on CPU "
            "they exist only with oneDNN on. Set TF_ENABLE_ONEDNN_OPTS=1 in "
            "the environment before TensorFlow starts (before `import "
            "tensorflow`), e.g. `TF_ENABLE_ONEDNN_OPTS=1 python train.py`."
        )
    return (
        f"TensorFlow keeps no allocator statistics for {device} "
        "(tf.config.experimental.get_memory_info failed), so the memory "
        "of a training step cannot be measured there."
    )


class ModelBlueprint:
    """What it takes to rebuild and compile a copy of `model`, read in the
    caller's thread (reading a mirrored variable, such as the learning
    rate, needs the caller's strategy scope).

    Args:
        model: a compiled Keras model (Sequential, Functional, or a
            subclass with `get_config`).
        accumulate: wrap the copy's optimizer in a
            `GradientAccumulationOptimizer`, so its accumulators are
            counted (unless it already is one).
    """

    def __init__(self, model: Any, accumulate: bool = False) -> None:
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                "Argument `model` must be compiled: the probe runs one "
                "training step with the model's loss and optimizer. Call "
                "`model.compile(optimizer=..., loss=...)` first."
            )
        self.name = model.name
        self._class = type(model)
        # The model's own flavour, whatever TF_USE_LEGACY_KERAS says.
        self._keras = keras = keras_of(flavour_of(model))
        # Keras's serialization would import TensorFlow on a JAX run.
        with tensorflow_left_alone():
            self._read_configs(model, keras)
        self._loss = getattr(model, "loss", None)
        self.accumulate = accumulate

    def _read_configs(self, model: Any, keras: Any) -> None:
        try:
            self._config = dict(keras.saving.serialize_keras_object(model))
        except Exception as exc:  # any failure means: cannot be copied
            raise ModelNotCopyable(
                f"Argument `model` ({type(model).__name__}) cannot be "
                "copied for the memory probe: its configuration could not "
                f"be read ({type(exc).__name__}: {_first_line(exc)}). "
                "Subclassed models need `get_config()` (and "
                "`from_config()`)."
            ) from exc
        # Compiled below, with the probe's own arguments.
        self._config.pop("compile_config", None)
        self._compile = model.get_compile_config() or {}
        self._optimizer_config = keras.saving.serialize_keras_object(
            model.optimizer
        )

    def build(self) -> Any:
        """The compiled copy, in the current strategy scope."""
        with tensorflow_left_alone():
            return self._build()

    def _build(self) -> Any:
        keras = self._keras
        try:
            copy = keras.saving.deserialize_keras_object(
                self._config,
                custom_objects={self._class.__name__: self._class},
            )
        except Exception as exc:
            raise ModelNotCopyable(
                f"Argument `model` ({self._class.__name__}) cannot be "
                "copied for the memory probe: rebuilding it from its "
                f"configuration failed ({type(exc).__name__}: "
                f"{_first_line(exc)}). Subclassed models need `get_config()`"
                " (and `from_config()`)."
            ) from exc
        copy.compile(**self._compile_arguments())
        return copy

    def _compile_arguments(self) -> dict:
        keras = self._keras
        try:
            arguments = dict(
                keras.saving.deserialize_keras_object(self._compile)
            )
        except Exception:
            # An unregistered custom loss or metric: the loss object
            # itself and a copy of the optimizer still give the step;
            # metrics (a few small buffers) are left out.
            arguments = {
                "optimizer": keras.saving.deserialize_keras_object(
                    self._optimizer_config
                ),
                "loss": self._loss,
            }
        # One step per call, whatever the user's steps_per_execution.
        arguments["steps_per_execution"] = 1
        if self.accumulate:
            arguments["optimizer"] = _with_accumulation(
                arguments["optimizer"], keras
            )
        return arguments


def _with_accumulation(optimizer: Any, keras: Any) -> Any:
    from keras_mgpu.backend import is_jax
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    if isinstance(optimizer, str | dict):
        optimizer = keras.optimizers.get(optimizer)
    if is_jax() and not isinstance(optimizer, GradientAccumulationOptimizer):
        # Keras's own accumulation keeps the same buffers (one per
        # trainable variable), and needs no keras_mgpu step on JAX.
        config = optimizer.get_config()
        config["gradient_accumulation_steps"] = 2
        return type(optimizer).from_config(config)
    if isinstance(optimizer, GradientAccumulationOptimizer):
        return optimizer
    # The accumulators' memory does not depend on the number of steps.
    return GradientAccumulationOptimizer(optimizer, accumulation_steps=2)


class StepProbe:
    """Runs and measures training steps of a copy of a model on `device`.

    Create and use it in one thread (see `run_in_clean_thread`): `open()`
    reads the allocator's baseline and builds the copy under a
    `OneDeviceStrategy`; `measure(batch_size)` returns `(peak_mb,
    seconds)`, the step's allocator peak above the baseline (so it counts
    the copy's weights, optimizer state and the batch itself, and not what
    the device held before) and the duration of the last step. A
    `ResourceExhaustedError` becomes `OutOfMemory`.

    Args:
        blueprint: a `ModelBlueprint`.
        samples: a `SampleBatches`.
        device: "GPU:0", "CPU:0", ...
        reader: a `TFMemoryReader` (or a fake with `read` and `reset`).
    """

    def __init__(
        self,
        blueprint: ModelBlueprint,
        samples: SampleBatches,
        device: str,
        reader: Any,
    ) -> None:
        self.blueprint = blueprint
        self.samples = samples
        self.device = device
        self.reader = reader
        self.model: Any = None
        self.baseline_mb = 0.0
        self._steps = 0

    def open(self) -> None:
        reading = self.reader.read(self.device)
        if reading is None:
            raise AllocatorStatsUnavailable(allocator_stats_hint(self.device))
        self.baseline_mb = reading["current_mb"]
        kind, _, index = self.device.partition(":")
        self._device_name = f"/{kind.lower()}:{index or 0}"
        self._strategy = tf.distribute.OneDeviceStrategy(self._device_name)
        with self._strategy.scope():
            self.model = self.blueprint.build()

    def close(self) -> None:
        self.model = None
        self._strategy = None
        gc.collect()

    def measure(
        self, batch_size: int, steps: int | None = None, spread: bool = False
    ) -> tuple:
        """`(peak_mb, seconds)` of `steps` (default `STEPS`) steps of `fit`
        at `batch_size`: the highest peak above the baseline, and the last
        step's duration; with `spread`, also how far the highest step's
        peak stands above the median step's, in MB (`step_spread`)."""
        steps = STEPS if steps is None else steps
        x, y, sample_weight = self.samples.batch(batch_size)
        try:
            with self._strategy.scope(), tf.device(self._device_name):
                # On the device before the peak is reset: the batch counts.
                inputs = tuple(
                    None
                    if part is None
                    else tf.nest.map_structure(tf.identity, part)
                    for part in (x, y, sample_weight)
                )
                del x, y, sample_weight
                peaks = self._run_steps(batch_size, inputs, steps)
        except tf.errors.ResourceExhaustedError as exc:
            raise OutOfMemory(str(exc).split("\n")[0]) from exc
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as exc:
            if self._steps:
                raise
            raise ValueError(
                f"Argument `data` cannot train `model` {self.blueprint.name!r}"
                f": one training step at batch {batch_size} failed with "
                f"{type(exc).__name__}: {_first_line(exc)} (a tf.data."
                "Dataset must yield batches, as model.fit takes)"
            ) from exc
        above = [p - self.baseline_mb for p, _ in peaks]
        if spread:
            return max(above), peaks[-1][1], step_spread(above)
        return max(above), peaks[-1][1]

    def _run_steps(self, batch_size: int, inputs: tuple, count: int) -> list:
        """`count` steps of `fit` on the batch, repeated: `(peak_mb,
        seconds)` of each, the peak as the allocator reads it (baseline
        included).

        `fit`, not `train_on_batch`: while a step runs, `fit`'s iterator
        already holds the next batch (one batch more than a lone step,
        ~3% of an MLP's peak), which is what training will need.
        """
        keras = self.blueprint._keras
        reader, device = self.reader, self.device
        parts = tuple(part for part in inputs if part is not None)
        dataset = tf.data.Dataset.from_tensors(parts).repeat(count)
        steps: list = []

        class StepPeaks(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                reader.reset(device)
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                # Reading the loss waits for the step to finish.
                for value in (logs or {}).values():
                    np.asarray(value)
                seconds = time.perf_counter() - self._start
                steps.append((reader.read(device)["peak_mb"], seconds))

        self.model.fit(
            dataset, epochs=1, verbose=0, shuffle=False, callbacks=[StepPeaks()]
        )
        self._steps += len(steps)
        return steps


def step_spread(peaks: list) -> float:
    """`max - median` of a run's step peaks, in MB (0 for one step): how
    far its highest step stood above a typical one."""
    if len(peaks) < 2:
        return 0.0
    return max(max(peaks) - float(np.median(peaks)), 0.0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().split("\n")[0]
    return text[:300]


def run_in_clean_thread(function: Callable[[], Any]) -> Any:
    """`function()` run in a new thread, outside any strategy scope the
    caller is in; returns its result or raises its exception.

    Carries the caller's Keras 3 dtype policy over (Keras keeps it per
    thread) and restores Python's `random` state afterwards: Keras 3 draws
    the copy's unseeded initializer seeds from it, and the probe must not
    change the caller's later random draws.
    """
    keras = keras_of("keras3")  # its dtype policy is per thread
    policy = keras.config.dtype_policy()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            if policy is not None:
                keras.config.set_dtype_policy(policy)
            outcome["value"] = function()
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc

    state = random.getstate()
    thread = threading.Thread(
        target=target, name="keras_mgpu-batch-probe", daemon=True
    )
    try:
        thread.start()
        thread.join()
    finally:
        random.setstate(state)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
