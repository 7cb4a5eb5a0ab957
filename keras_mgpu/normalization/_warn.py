"""The once-per-model warning for BatchNormalization on micro-batches.

`GradientAccumulationOptimizer` (accumulation_steps > 1) and
`apply_placement` (micro_batches > 1) call in here. A model is warned about
at most once per process; any failure to find or inspect the model means
no warning, never an error in the user's training.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any

from keras_mgpu.normalization._find import unremedied_for_micro_batches

# Set on a model (with `object.__setattr__`, untracked) once it was warned
# about, or once a component decided it needs no warning.
_WARNED_ATTR = "_keras_mgpu_batchnorm_warned"
# Set on an optimizer once it looked for its model (found or given up).
_LOOKED_ATTR = "_keras_mgpu_batchnorm_looked"
# Looks for the model per optimizer before giving up: `build` and the
# first `apply` (the model's `train_step` is on the stack then), plus one.
_MAX_LOOKS = 3
# Frames searched upwards for the model's `train_step`.
_MAX_FRAMES = 80

_LOCK = threading.Lock()


class BatchNormMicroBatchWarning(UserWarning):
    """A model with trainable BatchNormalization layers is trained on
    micro-batches (gradient accumulation or pipelining) with no choice
    made about their statistics.

    Each micro-batch is then normalised with its own statistics and the
    moving statistics move once per micro-batch. Raised in `fit` and in
    custom training loops (the model is the one the loop holds by name
    that owns the variables applied), at the user's line: the `fit` call,
    or the line that applies the gradients (or calls the `tf.function`
    that does). Silence it per model by
    choosing a remedy in `keras_mgpu.normalization`, or filter it:
    `warnings.filterwarnings("ignore",
    category=keras_mgpu.normalization.BatchNormMicroBatchWarning)`.
    """


def _message(model: Any, layers: list, how: str) -> str:
    name = getattr(model, "name", type(model).__name__)
    return (
        f"Model {name!r} has {len(layers)} trainable BatchNormalization "
        f"layer{'s' if len(layers) != 1 else ''} ({layers[0].name!r}"
        f"{', ...' if len(layers) > 1 else ''}) and is trained on {how}: "
        "each micro-batch is normalised with its own statistics and the "
        "moving statistics move once per micro-batch. Choose, in "
        "keras_mgpu.normalization: "
        "use_window_statistics(model, window=...) (moving statistics once "
        "per update), freeze_batchnorm(model) (fine-tuning), "
        "convert_batchnorm_to_groupnorm(model) (from scratch), or "
        "accept_micro_batch_statistics(model) (keep it, no warning). See "
        "docs/guides/batchnorm.md."
    )


# Frames of these packages are skipped so the warning names the user's line
# (the `fit` or `apply_placement` call, or in a custom loop the line that
# applies the gradients, or calls the `tf.function` that does). AutoGraph
# runs converted functions (tf_keras's `train_function`, a user's
# `tf.function` step) from generated files in the temporary folder.
_INTERNAL = (
    f"{os.sep}keras{os.sep}",
    f"{os.sep}tf_keras{os.sep}",
    f"{os.sep}tensorflow{os.sep}",
    f"{os.sep}keras_mgpu{os.sep}",
    f"{os.sep}threading.py",
    f"{os.sep}contextlib.py",
    f"{os.sep}__autograph_generated_file",
    f"{os.sep}jax{os.sep}",
    f"{os.sep}jaxlib{os.sep}",
)


def _is_internal(filename: str) -> bool:
    return any(part in filename for part in _INTERNAL)


def _first_user_frame(frame: Any) -> Any:
    while frame is not None:
        if not _is_internal(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def _user_frame() -> Any:
    """The first frame outside Keras, TensorFlow, JAX, AutoGraph's
    generated files and keras_mgpu: on this thread, or, on a thread with
    none (a replica thread of `MirroredStrategy`, a `merge_call`), on the
    main thread, which waits in the user's `fit` or loop. None if neither
    has one."""
    found = _first_user_frame(sys._getframe(2))
    if found is not None:
        return found
    main = threading.main_thread().ident
    if main == threading.get_ident():
        return None
    return _first_user_frame(sys._current_frames().get(main))


def _warn_at_user_line(message: str) -> None:
    """`warnings.warn(message, BatchNormMicroBatchWarning)` attributed to
    the user's line (`_user_frame`), with the registry and module that
    `warnings.warn` would use for that frame; a `stacklevel` cannot name a
    frame of another thread."""
    frame = _user_frame()
    if frame is None:
        warnings.warn(message, BatchNormMicroBatchWarning, stacklevel=3)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        BatchNormMicroBatchWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<string>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


def warn_if_unremedied(
    model: Any,
    *,
    accumulation_steps: int | None = None,
    micro_batches: int | None = None,
) -> bool:
    """Warn (once per model) when `model` has trainable BatchNormalization
    layers with no micro-batch choice made. Returns whether it warned.

    Never raises: a model that cannot be inspected is not warned about.
    """
    try:
        with _LOCK:
            if model.__dict__.get(_WARNED_ATTR):
                return False
            layers = unremedied_for_micro_batches(model)
            if not layers:
                return False
            object.__setattr__(model, _WARNED_ATTR, True)
        if accumulation_steps is not None:
            how = (
                f"{accumulation_steps} micro-batches per update (gradient "
                f"accumulation, accumulation_steps={accumulation_steps})"
            )
        else:
            how = (
                f"{micro_batches} micro-batches per step (pipelining, "
                f"micro_batches={micro_batches})"
            )
        message = _message(model, layers, how)
    except Exception:  # noqa: BLE001 - a warning must never break training
        return False
    _warn_at_user_line(message)
    return True


def carry_batchnorm_choices(source: Any, copy: Any) -> None:
    """Give the BatchNormalization layers of `copy` (a model rebuilt from
    `source`'s configs, e.g. by `apply_placement`) the remedy choices of
    their namesakes in `source`, and its "warned" state: the rebuilt
    layers are new objects, but the user's choice was made for them.
    Names that are not unique in `source` are skipped."""
    from keras_mgpu.normalization._find import (
        batchnorm_layers,
        choice_of,
        mark_choice,
    )

    try:
        choices: dict = {}
        for layer in batchnorm_layers(source):
            choices.setdefault(layer.name, []).append(choice_of(layer))
        for layer in batchnorm_layers(copy):
            found = choices.get(layer.name, [])
            if len(found) == 1 and found[0] is not None:
                mark_choice(layer, found[0])
        if source.__dict__.get(_WARNED_ATTR):
            object.__setattr__(copy, _WARNED_ATTR, True)
    except Exception:  # noqa: BLE001 - bookkeeping only
        return


def _model_classes() -> tuple:
    classes = []
    keras3 = sys.modules.get("keras")
    if keras3 is not None and hasattr(keras3, "Model"):
        classes.append(keras3.Model)
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None and hasattr(tf_keras, "Model"):
        classes.append(tf_keras.Model)
    return tuple(classes)


def _owns(model: Any, variable_ids: set) -> bool:
    return any(id(v) in variable_ids for v in model.trainable_variables)


# Model methods that build an optimizer without training: loading a saved
# model builds its optimizer from `compile_from_config` (Keras 3.10-3.15),
# and a model loaded for inference must not be warned about.
_NOT_TRAINING = frozenset(
    (
        "compile_from_config",
        "load_own_variables",
        "_load_state",
        "load_weights",
        "build_from_config",
    )
)


# Returned by a search that met a model building its optimizer without
# training (loading): no model is trained, look no further.
_LOADING = object()


def _model_in_frames(frame: Any, classes: tuple, variable_ids: set) -> Any:
    """The model whose method (`train_step`, `fit`, ...) is on the stack
    from `frame` up and owns `variables`; `_LOADING`, or None."""
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, classes) and _owns(candidate, variable_ids):
            if frame.f_code.co_name in _NOT_TRAINING:
                return _LOADING
            return candidate
        frame = frame.f_back
    return None


def _model_in_names(frame: Any, classes: tuple, variable_ids: set) -> Any:
    """A custom training loop: the model that a function on the stack
    holds by name (a local, a closure's variable, or a global of the
    user's module) and that owns the most of `variables` (then the
    fewest others: the model trained, not a larger one around it)."""
    best, best_key, seen = None, None, set()
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        names = [frame.f_locals]
        if not _is_internal(frame.f_code.co_filename):
            names.append(frame.f_globals)
        for namespace in names:
            for value in list(namespace.values()):
                if id(value) in seen or not isinstance(value, classes):
                    continue
                seen.add(id(value))
                try:
                    owned = [
                        id(v) in variable_ids for v in value.trainable_variables
                    ]
                except Exception:  # noqa: BLE001 - e.g. not built yet
                    continue
                if not any(owned):
                    continue
                key = (sum(owned), -len(owned))
                if best_key is None or key > best_key:
                    best, best_key = value, key
        frame = frame.f_back
    return best


def calling_model(variables: list) -> Any:
    """The Keras model being trained on `variables`, or None.

    First the model whose `train_step` (or `_symbolic_build`) is on the
    call stack, on the current thread, then on the other threads: under
    `MirroredStrategy` the replica threads run `train_step`, and a wrapper
    such as `LossScaleOptimizer` may reach the optimizer from threads of
    its own (`merge_call`, then `call_for_each_replica`). Then, for a
    custom training loop (no model method on the stack), a model the
    functions on the stack hold by name. The ownership check keeps a model
    that trains other variables (another thread, another model) from being
    taken; a model loading its optimizer (`compile_from_config`) is not
    trained, and stops the search.
    """
    classes = _model_classes()
    if not classes:
        return None
    variable_ids = {id(v) for v in variables}
    if not variable_ids:
        return None
    me = threading.get_ident()
    frames = [sys._getframe(1)] + [
        frame for ident, frame in sys._current_frames().items() if ident != me
    ]
    for search in (_model_in_frames, _model_in_names):
        for frame in frames:
            found = search(frame, classes, variable_ids)
            if found is _LOADING:
                return None
            if found is not None:
                return found
    return None


def _plain_python(function: Any) -> Any:
    """Keep AutoGraph from converting `function` when an optimizer applies
    gradients inside a user's `tf.function`: it reads the Python stack,
    which a converted copy does not see as written."""
    from keras_mgpu._flavour import do_not_convert

    return do_not_convert(function)


@_plain_python
def check_from_optimizer(optimizer: Any, variables: Any) -> None:
    """Called by `GradientAccumulationOptimizer` in `build` and `apply`:
    find the model being trained and warn once about its
    BatchNormalization layers. After the model is found (or after
    `_MAX_LOOKS` tries) this is one dictionary lookup.
    """
    state = optimizer.__dict__.get(_LOOKED_ATTR, 0)
    if state is True:
        return
    try:
        steps = optimizer.accumulation_steps
        if steps <= 1:
            object.__setattr__(optimizer, _LOOKED_ATTR, True)
            return
        model = calling_model(list(variables))
        with _LOCK:
            state = optimizer.__dict__.get(_LOOKED_ATTR, 0)
            if state is True:
                return
            if model is None:
                state += 1
                object.__setattr__(
                    optimizer,
                    _LOOKED_ATTR,
                    True if state >= _MAX_LOOKS else state,
                )
                return
            object.__setattr__(optimizer, _LOOKED_ATTR, True)
        warn_if_unremedied(model, accumulation_steps=steps)
    except Exception:  # noqa: BLE001 - a warning must never break training
        return
