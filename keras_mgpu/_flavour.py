"""The one place that picks the Keras flavour: Keras 3 or tf_keras.

TensorFlow reads `TF_USE_LEGACY_KERAS=1` to make `tf.keras` resolve to
`tf_keras` (Keras 2). We read the same switch, once, at import time, so the
whole package is built on exactly one flavour per process. Everything else in
`keras_mgpu` imports `keras` from here, never directly.

Note: `import tensorflow_model_optimization` *sets* `TF_USE_LEGACY_KERAS=1`
as a side effect. Import `keras_mgpu` after choosing the flavour (set the
variable yourself before anything imports Keras); the flavour is not switched
afterwards, and objects of the other flavour are rejected with a clear error.
"""

from __future__ import annotations

import os
import types

from keras_mgpu._flavour_switch import (
    LEGACY_ENV_VAR,
    LEGACY_REQUESTED_AT_IMPORT,
    legacy_keras_requested,  # noqa: F401
)

IS_TF_KERAS: bool = LEGACY_REQUESTED_AT_IMPORT

if IS_TF_KERAS:
    try:
        import tf_keras as keras  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on install
        raise ImportError(
            f"{LEGACY_ENV_VAR}=1 selects the tf_keras flavour, but `tf_keras` "
            "is not installed. Install it with: "
            'pip install "keras-mgpu[tfmot]"'
        ) from exc
    FLAVOUR = "tf_keras"
else:
    # keras_mgpu was built on TensorFlow's distribution strategies; pick the
    # TensorFlow backend unless the user chose one explicitly. Other backends
    # import fine: each component says at construction whether it supports
    # the running one (`keras_mgpu.backend.require_backend`).
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras  # noqa: F401

    FLAVOUR = "keras3"


class _TensorFlowOnFirstUse(types.ModuleType):
    """`tensorflow`, imported when first touched.

    Off the TensorFlow backend nothing should import TensorFlow (it takes
    seconds and, on a GPU, memory): modules that need it for their
    TensorFlow path keep `from keras_mgpu._flavour import tf`, and only that
    path pays for the import (a `tf.data` input on JAX, say).
    """

    def __init__(self) -> None:
        super().__init__("tensorflow")

    def __getattr__(self, name: str):
        import tensorflow

        return getattr(tensorflow, name)


#: Whether TensorFlow runs the models (Keras 3 on TensorFlow, or tf_keras).
TF_RUNS: bool = IS_TF_KERAS or keras.backend.backend() == "tensorflow"

if TF_RUNS:
    import tensorflow as tf  # noqa: F401
else:
    tf = _TensorFlowOnFirstUse()


def do_not_convert(function):
    """`tf.autograph.experimental.do_not_convert` where TensorFlow runs
    (AutoGraph would rewrite a function that reads the Python stack or
    mutates Python state); `function` itself elsewhere."""
    if not TF_RUNS:
        return function
    return tf.autograph.experimental.do_not_convert(function)


def object_flavour(obj: object) -> str | None:
    """Which Keras flavour an object belongs to, from its class's module.

    Returns "keras3", "tf_keras", "tf_legacy" (a `tf.compat.v1` optimizer) or
    None when the object comes from neither.
    """
    for klass in type(obj).__mro__:
        module = klass.__module__ or ""
        if module.startswith("tf_keras"):
            return "tf_keras"
        if module == "keras" or module.startswith("keras."):
            return "keras3"
        if module.startswith("tensorflow.python.training"):
            return "tf_legacy"
    return None


def flavour_of(obj: object, default: str | None = None) -> str:
    """The flavour of `obj` ("keras3" or "tf_keras"), or `default` (the
    process's flavour when None) for objects of neither, e.g. a float."""
    found = object_flavour(obj)
    if found in ("keras3", "tf_keras"):
        return found
    return default or FLAVOUR


def keras_of(flavour: str):
    """The Keras package of `flavour`: Keras 3 (`keras`) or `tf_keras`.

    Both can serve one process: the components that take Keras objects
    follow the objects (Ray Train sets TF_USE_LEGACY_KERAS=1 while user
    code builds Keras 3 models).
    """
    if flavour == "keras3":
        import keras as keras3

        return keras3
    if flavour == "tf_keras":
        try:
            import tf_keras
        except ImportError as exc:  # pragma: no cover - depends on install
            raise ImportError(
                "A tf_keras object needs the `tf_keras` package. Install it "
                'with: pip install "keras-mgpu[tfmot]"'
            ) from exc
        return tf_keras
    raise ValueError(f"Unknown Keras flavour {flavour!r}")


def check_flavour(
    obj: object, argument: str, expected: str | None = None
) -> None:
    """Raise a `TypeError` when `obj` belongs to another Keras flavour than
    `expected` (the process's flavour when None)."""
    expected = expected or FLAVOUR
    found = object_flavour(obj)
    if found is None or found == expected:
        return
    hint = (
        f"unset {LEGACY_ENV_VAR} to use Keras 3"
        if expected == "tf_keras"
        else f"set {LEGACY_ENV_VAR}=1 before importing keras_mgpu to use "
        "tf_keras"
    )
    raise TypeError(
        f"Argument `{argument}` is a {found} object ({type(obj).__name__}), "
        f"but this keras_mgpu component is built on {expected}. Mixing Keras "
        f"flavours in one model is not supported: {hint}."
    )


def register_serializable(cls, flavour: str | None = None):
    """Register `cls` for (de)serialization under the package `keras_mgpu`,
    in the registry of `flavour` (the process's flavour when None)."""
    if (flavour or FLAVOUR) == "tf_keras":
        return keras_of("tf_keras").utils.register_keras_serializable(
            package="keras_mgpu"
        )(cls)
    return keras_of("keras3").saving.register_keras_serializable(
        package="keras_mgpu"
    )(cls)


def register_in_every_flavour(cls):
    """Register a class that serves both flavours in both registries."""
    register_serializable(cls, "keras3")
    if _tf_keras_if_installed() is not None:
        register_serializable(cls, "tf_keras")
    return cls


def _tf_keras_if_installed():
    """tf_keras when installed and TensorFlow runs; None otherwise (on
    Keras's JAX backend importing tf_keras would import TensorFlow for
    nothing: no tf_keras model can run beside it there)."""
    import importlib.util

    if not TF_RUNS:
        return None

    if importlib.util.find_spec("tf_keras") is None:
        return None
    import tf_keras

    return tf_keras


def _bases(path: str) -> tuple[type, ...]:
    """`path` ("callbacks.Callback") in Keras 3, then in tf_keras when it
    is installed."""
    import operator

    get = operator.attrgetter(path)
    bases: list[type] = [get(keras_of("keras3"))]
    tf_keras = _tf_keras_if_installed()
    if tf_keras is not None:
        bases.append(get(tf_keras))
    return tuple(bases)


def schedule_bases() -> tuple[type, ...]:
    """Base classes of a learning-rate schedule that both flavours'
    optimizers accept (each checks `isinstance` with its own class)."""
    return _bases("optimizers.schedules.LearningRateSchedule")


def callback_bases() -> tuple[type, ...]:
    """Base classes of a callback that runs in Keras 3 and tf_keras `fit`.

    Keras 3's `Callback` first (its `set_model` and `model`), then
    tf_keras's when installed: tf_keras's `CallbackList` calls its protocol
    methods (`_implements_train_batch_hooks`, ...), while Keras 3's only
    calls the hooks. The callback then follows the model it is given,
    whatever `TF_USE_LEGACY_KERAS` says (Ray Train sets it while user code
    builds Keras 3 models).
    """
    return _bases("callbacks.Callback")
