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
    # keras_mgpu is built on TensorFlow's distribution strategies; pick the
    # TensorFlow backend unless the user chose one explicitly.
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras  # noqa: F401

    if keras.backend.backend() != "tensorflow":
        raise ImportError(
            "keras_mgpu needs the TensorFlow backend of Keras 3. Received: "
            f"KERAS_BACKEND={keras.backend.backend()!r}. Set "
            "KERAS_BACKEND=tensorflow before importing keras."
        )
    FLAVOUR = "keras3"

import tensorflow as tf  # noqa: E402,F401


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


def check_flavour(obj: object, argument: str) -> None:
    """Raise a `TypeError` when `obj` belongs to the other Keras flavour."""
    found = object_flavour(obj)
    if found is None or found == FLAVOUR:
        return
    hint = (
        f"unset {LEGACY_ENV_VAR} to use Keras 3"
        if IS_TF_KERAS
        else f"set {LEGACY_ENV_VAR}=1 before importing keras_mgpu to use "
        "tf_keras"
    )
    raise TypeError(
        f"Argument `{argument}` is a {found} object ({type(obj).__name__}), "
        f"but keras_mgpu was imported for the {FLAVOUR} flavour. Mixing Keras "
        f"flavours is not supported: {hint}."
    )


def register_serializable(cls):
    """Register `cls` for (de)serialization under the package `keras_mgpu`."""
    if IS_TF_KERAS:
        return keras.utils.register_keras_serializable(package="keras_mgpu")(
            cls
        )
    return keras.saving.register_keras_serializable(package="keras_mgpu")(cls)


def _tf_keras_if_installed():
    import importlib.util

    if importlib.util.find_spec("tf_keras") is None:
        return None
    import tf_keras

    return tf_keras


def callback_bases() -> tuple[type, ...]:
    """Base classes of a callback that runs in Keras 3 and tf_keras `fit`.

    Keras 3's `Callback` first (its `set_model` and `model`), then
    tf_keras's when installed: tf_keras's `CallbackList` calls its protocol
    methods (`_implements_train_batch_hooks`, ...), while Keras 3's only
    calls the hooks. The callback then follows the model it is given,
    whatever `TF_USE_LEGACY_KERAS` says (Ray Train sets it while user code
    builds Keras 3 models).
    """
    import keras as keras3

    bases: list[type] = [keras3.callbacks.Callback]
    tf_keras = _tf_keras_if_installed()
    if tf_keras is not None:
        bases.append(tf_keras.callbacks.Callback)
    return tuple(bases)
