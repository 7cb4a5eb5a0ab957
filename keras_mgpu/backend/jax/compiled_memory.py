"""What XLA's compiled training step needs in device memory, read without
running it: `find_batch_size` on the JAX backend.

A copy of the user's model (rebuilt from its configuration, compiled from
its compile configuration: `batch_size.memory_probe.ModelBlueprint`) takes
one real step at the smallest batch, which builds its optimizer and metrics
state. Then, for each candidate batch, the model's own `train_step` (the
stateless step Keras's JAX trainer jits, state donated as `fit` does) is
lowered and compiled for that batch's shapes, never run, and XLA's memory
analysis gives the bytes one device needs: arguments (weights, optimizer
and metrics state, the batch) + outputs - what outputs reuse of donated
arguments + temporaries (activations kept for the backward pass, gradients,
workspace). Under a `keras.distribution` the step is compiled for the
global batch over the distribution's mesh and the figures are per device.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any

import numpy as np

MB = 1024.0 * 1024.0
# Steps of `fit` that confirm the answer runs: the first compiles.
CONFIRM_STEPS = 2


class StepMemory:
    """Compiles a copy of `blueprint`'s model's train step per batch size.

    Args:
        blueprint: a `ModelBlueprint` (the copy is built from it).
        samples: a `SampleBatches` (the data's shapes and dtypes).
        distribution: the `keras.distribution` to compile under, or None.
        data_parallel: the size of the distribution's batch axis (the
            global batch is the per-replica batch times it).
    """

    def __init__(
        self,
        blueprint: Any,
        samples: Any,
        distribution: Any,
        data_parallel: int,
    ) -> None:
        self.blueprint = blueprint
        self.samples = samples
        self.distribution = distribution
        self.data_parallel = data_parallel
        self.model: Any = None

    def _scope(self):
        if self.distribution is None:
            return contextlib.nullcontext()
        return self.distribution.scope()

    def open(self, first_batch: int) -> None:
        """Build the copy and run one step at `first_batch` per replica
        (it builds the optimizer and metrics state; a model the data cannot
        train fails here, with a ValueError naming `data`)."""
        # Keras draws unseeded initializers' seeds from Python's `random`:
        # the copy must not change the caller's later draws.
        state = random.getstate()
        try:
            with self._scope():
                self.model = self.blueprint.build()
                x, y, sample_weight = self.samples.batch(
                    first_batch * self.data_parallel
                )
                try:
                    self.model.train_on_batch(x, y, sample_weight)
                except (ValueError, TypeError) as exc:
                    raise ValueError(
                        "Argument `data` cannot train `model` "
                        f"{self.blueprint.name!r}: one training step at "
                        f"batch {first_batch} failed with "
                        f"{type(exc).__name__}: {_first_line(exc)}"
                    ) from exc
        finally:
            random.setstate(state)

    def close(self) -> None:
        self.model = None

    def need_bytes(self, batch_size: int) -> int:
        """Bytes one device needs for one training step at `batch_size`
        per replica, from XLA's compiled memory analysis."""
        import jax

        model = self.model
        state = abstract_state(model)
        batch = self.samples.batch(batch_size * self.data_parallel)
        data = tuple(
            None if part is None else _tree_map(self._abstract_input, part)
            for part in batch
        )
        with self._scope():
            # Donated state, as Keras's `make_train_function` jits it.
            step = jax.jit(model.train_step, donate_argnums=0)
            compiled = step.lower(state, data).compile()
        analysis = compiled.memory_analysis()
        return int(
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes
        )

    def _abstract_input(self, array: np.ndarray) -> Any:
        return abstract_input(array, self.distribution)

    def confirm(self, batch_size: int) -> float:
        """Run `CONFIRM_STEPS` steps of `fit` on the copy at `batch_size`
        per replica; the last step's seconds. An out-of-memory error of
        XLA becomes `backend.errors.OutOfMemory`."""
        from keras_mgpu.backend.errors import OutOfMemory

        keras = self.blueprint._keras
        global_batch = batch_size * self.data_parallel
        x, y, sample_weight = self.samples.batch(global_batch * CONFIRM_STEPS)
        seconds: list = []

        class StepTimes(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                for value in (logs or {}).values():
                    np.asarray(value)  # waits for the step
                seconds.append(time.perf_counter() - self._start)

        try:
            with self._scope():
                self.model.fit(
                    x,
                    y,
                    sample_weight=sample_weight,
                    batch_size=global_batch,
                    epochs=1,
                    shuffle=False,
                    verbose=0,
                    callbacks=[StepTimes()],
                )
        except Exception as exc:  # noqa: BLE001 - XLA's error class varies
            if (
                "RESOURCE_EXHAUSTED" in str(exc)
                or "out of memory" in str(exc).lower()
            ):
                raise OutOfMemory(_first_line(exc)) from exc
            raise
        return seconds[-1]


def _abstract(value: Any) -> Any:
    import jax

    return jax.ShapeDtypeStruct(
        value.shape, value.dtype, sharding=getattr(value, "sharding", None)
    )


def abstract_state(model: Any) -> tuple:
    """The state Keras's JAX train step takes (trainable, non-trainable,
    optimizer and metrics variables), as shapes, dtypes and shardings."""
    return tuple(
        [_abstract(v.value) for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )


def abstract_input(array: Any, distribution: Any) -> Any:
    """One input array as the distribution lays out a batch of it."""
    import jax

    sharding = None
    if distribution is not None:
        layout = distribution.get_data_layout(array.shape)
        sharding = getattr(layout, "backend_layout", None)
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=sharding)


def abstract_step_arguments(
    model: Any, x: Any, y: Any = None, sample_weight: Any = None
) -> tuple:
    """`(state, data)` as the model's JAX `train_step` takes them, as
    shapes, dtypes and shardings under the `keras.distribution` in force:
    the variables' own layouts, the batch (`x`, `y`, `sample_weight`, the
    global batch, nests allowed) laid out as the distribution splits it."""
    import keras

    distribution = keras.distribution.distribution()
    data = tuple(
        None
        if part is None
        else keras.tree.map_structure(
            lambda array: abstract_input(array, distribution), part
        )
        for part in (x, y, sample_weight)
    )
    return abstract_state(model), data


def _tree_map(function: Any, structure: Any) -> Any:
    import keras

    return keras.tree.map_structure(function, structure)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n")[0][:300]
