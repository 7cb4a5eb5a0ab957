"""Which Keras backend runs, and what each component supports on it.

Keras's own layout is the model (`keras/src/backend/<name>/`): component code
is written once against Keras's public API and `keras.ops`; what only one
backend can do lives in `keras_mgpu/backend/<name>/` (`jax/`; `tensorflow/`
holds TensorFlow's coordination-service key-value store and collective
abort; the other TensorFlow pieces still live beside the components that use
them, reached through `keras_mgpu._flavour.tf`). A component asks
`require_backend` at construction, so an unsupported backend is a clear
error naming it and the supported ones, never a trace from deep inside a
training step.

The backend is the one Keras runs on: `keras.backend.backend()` for Keras 3,
"tensorflow" for tf_keras. keras_mgpu picks TensorFlow when `KERAS_BACKEND` is
unset (it was built on `tf.distribute`); set `KERAS_BACKEND=jax` before
importing Keras for the JAX backend and `keras.distribution`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "SUPPORTED_BACKENDS",
    "BackendNotSupportedError",
    "backend",
    "is_jax",
    "is_tensorflow",
    "require_backend",
]

#: The backends keras_mgpu supports at all. Torch, numpy and openvino are
#: refused by every component (Keras's torch backend distribution lands in
#: 3.16; its CPU wheels pull the CUDA libraries).
SUPPORTED_BACKENDS = ("tensorflow", "jax")


# What to use on JAX instead of a component that runs on TensorFlow only.
ON_JAX_PLACEMENT = (
    "keras.distribution.ModelParallel with a LayoutMap from "
    "keras_mgpu.sharding.plan_layout_map"
)
ON_JAX_NO_COMPRESSION = (
    "GradientAccumulationOptimizer without compression (XLA runs the "
    "all-reduce of the jitted step)"
)
ON_JAX_MULTI_PROCESS = (
    "keras_mgpu.distribute.start_cluster() (keras.distribution.initialize() "
    "with bounded waits and gloo on CPU; it returns a DataParallel over "
    "every process's devices) and keras_mgpu.distribute."
    "shard_across_processes() for NumPy arrays, PyDatasets and generators"
)


class BackendNotSupportedError(NotImplementedError):
    """A keras_mgpu component was used on a backend it does not support."""


def backend() -> str:
    """The name of the Keras backend keras_mgpu runs on.

    "tensorflow" for the tf_keras flavour; otherwise Keras 3's
    `keras.backend.backend()` ("tensorflow", "jax", "torch", ...).
    """
    from keras_mgpu._flavour import IS_TF_KERAS, keras

    if IS_TF_KERAS:
        return "tensorflow"
    return keras.backend.backend()


def is_jax() -> bool:
    """True when Keras 3 runs on the JAX backend."""
    return backend() == "jax"


def is_tensorflow() -> bool:
    """True when keras_mgpu runs on TensorFlow (Keras 3 or tf_keras)."""
    return backend() == "tensorflow"


def require_backend(
    component: str,
    supported: Sequence[str] = SUPPORTED_BACKENDS,
    *,
    instead: str | None = None,
) -> str:
    """Return the running backend, or raise naming it and what is supported.

    Args:
        component: str, the public name of the component asking.
        supported: the backends the component runs on.
        instead: str, what to use on the running backend, when there is an
            alternative (e.g. "keras.distribution.ModelParallel").

    Raises:
        BackendNotSupportedError: on any other backend.
    """
    name = backend()
    if name in supported:
        return name
    message = (
        f"{component} does not support the {name!r} backend of Keras. "
        f"Supported: {', '.join(repr(b) for b in supported)} (set "
        "KERAS_BACKEND before importing keras)."
    )
    if name not in SUPPORTED_BACKENDS:
        message += (
            f" keras_mgpu supports Keras's "
            f"{' and '.join(SUPPORTED_BACKENDS)} backends only."
        )
    if instead:
        message += f" On {name}, use {instead} instead."
    raise BackendNotSupportedError(message)
