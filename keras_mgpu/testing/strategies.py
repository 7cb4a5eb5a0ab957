"""The strategy matrix a multi-device test runs under, on CPU devices.

TensorFlow: `tf.distribute` strategies. JAX: `keras.distribution`
distributions (`DataParallel`, `ModelParallel`). Both kinds have a
`.scope()`, so a test written as `with strategy.scope(): ...` runs on either
backend; `STRATEGY_NAMES` lists the matrix of the backend this process runs.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any

from keras_mgpu.testing.devices import requested_backend

TF_STRATEGY_NAMES = (
    "default",
    "one_device",
    "mirrored_2",
    "mirrored_4",
    "central_storage",
)
JAX_STRATEGY_NAMES = (
    "default",
    "data_parallel_1",
    "data_parallel_2",
    "data_parallel_4",
    "model_parallel_2x2",
)

#: The (batch, model) mesh axes of the `model_parallel_<b>x<m>` entries.
MODEL_PARALLEL_AXES = ("batch", "model")


def running_backend() -> str:
    """The Keras backend of this process: Keras's own answer once Keras is
    imported (tf_keras counts as "tensorflow"), else what `KERAS_BACKEND` or
    `keras.json` asks for, read without importing anything."""
    if "keras_mgpu._flavour" in sys.modules or "keras" in sys.modules:
        from keras_mgpu.backend import backend

        return backend()
    return requested_backend()


def strategy_names(backend: str | None = None) -> tuple[str, ...]:
    """The matrix of `backend` (default: the one this process runs)."""
    backend = backend or running_backend()
    return JAX_STRATEGY_NAMES if backend == "jax" else TF_STRATEGY_NAMES


#: The matrix of the backend this process runs (fixed at import).
STRATEGY_NAMES = strategy_names(requested_backend())

_DATA_PARALLEL = re.compile(r"data_parallel_(\d+)$")
_MODEL_PARALLEL = re.compile(r"model_parallel_(\d+)x(\d+)$")
_MIRRORED = re.compile(r"mirrored_(\d+)$")


def devices_needed(name: str) -> int:
    """CPU devices the matrix entry `name` spans (1 for "default")."""
    for pattern in (_DATA_PARALLEL, _MIRRORED):
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    match = _MODEL_PARALLEL.match(name)
    if match:
        return int(match.group(1)) * int(match.group(2))
    return 2 if name == "central_storage" else 1


def mirrored_strategy(
    num_replicas: int = 2, cross_device_ops: Any = None
) -> Any:
    """A `MirroredStrategy` over the first `num_replicas` logical CPUs.

    On CPU, TensorFlow's default `CollectiveAllReduce` pins its group size
    at first use: a 4-replica strategy after a 2-replica one fails in the
    same process ("joining a group with size4, but that group has size
    2"). This factory uses `ReductionToOneDevice` unless told otherwise,
    so strategies of any size can follow each other in one test process.
    Test the default cross-device ops (what users get) in a process of
    their own (`run_workers(..., num_workers=1)` or a subprocess).

    TensorFlow only: on JAX it raises `BackendNotSupportedError` naming
    `keras.distribution.DataParallel` (`make_strategy("data_parallel_2")`).

    Args:
        num_replicas: int >= 1, replicas (logical CPU devices) to use.
        cross_device_ops: a `tf.distribute.CrossDeviceOps`, or None for
            `ReductionToOneDevice()`.

    Example:

    ```python
    strategy = keras_mgpu.testing.mirrored_strategy(4)
    with strategy.scope():
        model = build_model()
    ```
    """
    from keras_mgpu.backend import require_backend

    require_backend(
        "keras_mgpu.testing.mirrored_strategy",
        ("tensorflow",),
        instead=(
            "keras.distribution.DataParallel("
            "devices=keras.distribution.list_devices()[:n]) (the matrix "
            "entries data_parallel_<n>: make_strategy('data_parallel_2'))"
        ),
    )
    import tensorflow as tf

    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if (
        not isinstance(num_replicas, int)
        or isinstance(num_replicas, bool)
        or not 1 <= num_replicas <= len(cpus)
    ):
        raise ValueError(
            f"Argument `num_replicas` must be an integer from 1 to "
            f"{len(cpus)} (the logical CPU devices configured). Received: "
            f"num_replicas={num_replicas!r}"
        )
    return tf.distribute.MirroredStrategy(
        devices=cpus[:num_replicas],
        cross_device_ops=cross_device_ops
        or tf.distribute.ReductionToOneDevice(),
    )


def make_strategy(name: str) -> Any:
    """Build one entry of the strategy matrix on the CPU devices.

    On TensorFlow (`TF_STRATEGY_NAMES`): `"default"` (no strategy),
    `"one_device"`, `"mirrored_<n>"` (see `mirrored_strategy`) and
    `"central_storage"` (variables on CPU:0, compute on CPU:0 and CPU:1).

    On JAX (`JAX_STRATEGY_NAMES`): `"default"` (a `NoDistribution`, whose
    scope clears any distribution in force), `"data_parallel_<n>"` (a
    `keras.distribution.DataParallel` over the first n CPU devices) and
    `"model_parallel_<b>x<m>"` (a `ModelParallel` on a (b, m) mesh with
    axes ("batch", "model") and `model_parallel_layout_map`'s layout).

    Raises:
        ValueError: an unknown name, or an entry that needs more devices
            than configured (the `strategy` fixture skips those instead).
    """
    backend = running_backend()
    names = strategy_names(backend)
    if not isinstance(name, str) or not (
        name in names
        or (backend == "jax" and _DATA_PARALLEL.match(name))
        or (backend == "jax" and _MODEL_PARALLEL.match(name))
        or (backend != "jax" and _MIRRORED.match(name))
    ):
        pattern = "data_parallel_<n>, model_parallel_<b>x<m>"
        if backend != "jax":
            pattern = "mirrored_<n>"
        raise ValueError(
            f"Argument `name` must be one of {', '.join(names)} (or "
            f"{pattern}) on the {backend} backend. Received: name={name!r}"
        )
    if backend == "jax":
        return _make_distribution(name)
    _check_devices(name, available_devices())
    return _make_tf_strategy(name)


def _check_devices(name: str, have: int) -> None:
    needed = devices_needed(name)
    if needed > have:
        raise ValueError(
            f"Strategy {name!r} needs {needed} CPU devices; {have} are "
            f"configured (keras_mgpu_cpu_devices = {have}). Configure more, "
            "or pick a smaller entry."
        )


def _make_tf_strategy(name: str) -> Any:
    import tensorflow as tf

    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if _MIRRORED.match(name):
        return mirrored_strategy(int(name[9:]))
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    return tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=cpus[:2], parameter_device=cpus[0]
    )


def available_devices() -> int:
    """The CPU devices this process has (logical ones on TensorFlow)."""
    if running_backend() == "jax":
        import jax

        return len(jax.devices("cpu"))
    import tensorflow as tf

    return len(tf.config.list_logical_devices("CPU"))


class NoDistribution:
    """The JAX matrix's "default" entry: no `keras.distribution`.

    Its `scope()` clears any distribution in force for the block (as
    `tf.distribute.get_strategy()`'s scope is the default strategy's), so a
    test written as `with strategy.scope():` runs unchanged.
    `num_replicas_in_sync` is 1, as on the default `tf.distribute` strategy,
    and so is `keras_mgpu.num_replicas_in_sync(NoDistribution())` (no
    mesh, no batch axis).
    """

    num_replicas_in_sync = 1
    device_mesh = None
    batch_dim_name = None

    def scope(self) -> contextlib.AbstractContextManager[None]:
        from keras_mgpu.backend.jax.distribution import no_distribution

        return no_distribution()

    def __repr__(self) -> str:
        return "NoDistribution()"


def model_parallel_layout_map(device_mesh: Any) -> Any:
    """The matrix's `LayoutMap`: Dense kernels split along "model" by their
    output units, Dense biases along "model"; everything else replicated.

    Keys are Keras variable-path regexes: `.*dense.*kernel` -> (None,
    "model") and `.*dense.*bias` -> ("model",).
    """
    import keras

    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    layout_map[".*dense.*bias"] = ("model",)
    return layout_map


def _make_distribution(name: str) -> Any:
    import keras

    if name == "default":
        return NoDistribution()
    devices = keras.distribution.list_devices("cpu")
    needed = devices_needed(name)
    _check_devices(name, len(devices))
    match = _DATA_PARALLEL.match(name)
    if match:
        return keras.distribution.DataParallel(devices=devices[:needed])
    batch, model = (int(g) for g in _MODEL_PARALLEL.match(name).groups())
    mesh = keras.distribution.DeviceMesh(
        (batch, model), list(MODEL_PARALLEL_AXES), devices[:needed]
    )
    return _model_parallel_class()(
        layout_map=model_parallel_layout_map(mesh),
        batch_dim_name=MODEL_PARALLEL_AXES[0],
    )


_CLASSES: dict[str, type] = {}


def _model_parallel_class() -> type:
    """`ModelParallel` that keeps a variable replicated where its layout
    would split an axis unevenly (JAX refuses uneven shards, so a
    `Dense(1)` output layer could not be built under the matrix's map)."""
    if "model_parallel" in _CLASSES:
        return _CLASSES["model_parallel"]
    import keras

    class ModelParallel(keras.distribution.ModelParallel):
        __doc__ = _model_parallel_class.__doc__

        def get_variable_layout(self, variable: Any) -> Any:
            layout = super().get_variable_layout(variable)
            mesh = dict(
                zip(self.device_mesh.axis_names, self.device_mesh.shape)
            )
            axes = tuple(getattr(layout, "axes", ()))
            even = len(axes) == len(variable.shape) and all(
                axis is None or size % mesh[axis] == 0
                for axis, size in zip(axes, variable.shape)
            )
            if even:
                return layout
            return keras.distribution.TensorLayout(
                [None] * len(variable.shape), self.device_mesh
            )

    ModelParallel.__module__ = __name__
    ModelParallel.__qualname__ = "ModelParallel"
    _CLASSES["model_parallel"] = ModelParallel
    return ModelParallel


def describe(strategy: Any) -> str:
    """A short name of a strategy or distribution for messages."""
    if isinstance(strategy, NoDistribution):
        return "no distribution"
    mesh = getattr(strategy, "device_mesh", None)
    if mesh is not None:
        shape = "x".join(str(s) for s in mesh.shape)
        return f"{type(strategy).__name__} (mesh {shape})"
    return type(strategy).__name__
