"""Moving statistics that advance once per optimizer update: BatchNormalization
when an update is made of several micro-batches.

Gradient accumulation (`GradientAccumulationOptimizer`, K micro-batches per
update) and pipeline micro-batches (`apply_placement(..., micro_batches=M)`)
run each BatchNormalization layer K (or M, or K*M) times per update: its
moving mean and variance advance that many times with the momentum meant for
one step, on statistics of micro-batches. `use_window_statistics` switches
the layers, in place, so the moving statistics advance once per window of
calls, as the large batch would move them (`statistics="window"`), or with
the momentum corrected for the number of calls (`statistics="momentum"`).
`restore_batchnorm_statistics` switches them back.

How: each BatchNormalization instance gets its class swapped for a subclass
(`WindowBatchNormalization`, one per Keras flavour, registered for
serialization under the package `keras_mgpu`) whose `call` runs the class's
own `call` and then, with `statistics="window"`, puts the moving statistics
back and folds the micro-batch's statistics into accumulators (variables of
the layer). Only public attributes of BatchNormalization are read
(`moving_mean`, `moving_variance`, `momentum`): the micro-batch's mean and
biased variance are recovered from the update the layer made, which works
the same for Keras 3, tf_keras and tf_keras's fused kernel.
"""

from __future__ import annotations

import functools
from typing import Any

from keras_mgpu._flavour import (
    FLAVOUR,
    do_not_convert,
    keras_of,
    object_flavour,
    register_serializable,
)
from keras_mgpu._validation import check_int
from keras_mgpu.backend import require_backend
from keras_mgpu.normalization._find import (
    batchnorm_layers,
    choice_after_undo,
    choice_of,
    mark_choice,
    pop_saved,
    saved,
)
from keras_mgpu.normalization._window_math import (
    _ORIGINAL_CLASS,
    _STATE,
    _STATISTICS,
    _USER_MOMENTUM,
    _WINDOW,
    STATISTICS,
    _advance_window,
    _check_statistics,
    _ensure_state,
    _in_symbolic_build,
    _ops_of,
    _set_mode,
    _training_value,
    _untrack,
    window_state,
)

# ---------------------------------------------------------------------------
# The switched layer.
# ---------------------------------------------------------------------------


class _WindowStatisticsMixin:
    """What `WindowBatchNormalization` adds to a flavour's
    BatchNormalization (see `use_window_statistics`)."""

    def __init__(
        self, *args, window: int = 1, statistics: str = "window", **kwargs
    ):
        window = check_int(window, "window", minimum=1)
        _check_statistics(statistics)
        _set_mode(self, window, statistics)
        # Made from a config (a `.keras` file, `clone_model`, a placed copy):
        # the choice is made already.
        mark_choice(self, statistics)
        super().__init__(*args, **kwargs)

    # The momentum Keras's `call` applies per call; the user's stays in
    # `_keras_mgpu_user_momentum` (what `get_config` and the undo give).
    @property
    def momentum(self) -> float:
        momentum = self.__dict__.get(_USER_MOMENTUM)
        if momentum is None:
            return momentum
        if self.__dict__.get(_STATISTICS) == "momentum":
            return float(momentum) ** (1.0 / self.__dict__[_WINDOW])
        return momentum

    @momentum.setter
    def momentum(self, value: float) -> None:
        object.__setattr__(self, _USER_MOMENTUM, value)

    @property
    def window(self) -> int:
        """Training calls per optimizer update."""
        return self.__dict__[_WINDOW]

    @property
    def statistics(self) -> str:
        """The statistics kept (see `use_window_statistics`)."""
        return self.__dict__[_STATISTICS]

    def build(self, input_shape):
        # tf_keras calls the class's `build`; Keras 3 calls the `build` the
        # instance was made with, then `_post_build` (below). The signature
        # is BatchNormalization's: Keras 3 binds shapes to its names.
        super().build(input_shape)
        _ensure_state(self)

    def _post_build(self):
        super()._post_build()
        _ensure_state(self)

    def get_config(self) -> dict:
        config = super().get_config()
        config["momentum"] = self.__dict__.get(_USER_MOMENTUM)
        config["window"] = self.__dict__[_WINDOW]
        config["statistics"] = self.__dict__[_STATISTICS]
        return config

    @do_not_convert
    def call(self, inputs, training=None, mask=None):
        state = self.__dict__.get(_STATE)
        active = _training_value(self, training)
        if (
            state is None
            or active is False
            or self.momentum >= 1.0
            or _in_symbolic_build()
        ):
            return super().call(inputs, training=training, mask=mask)
        # Read before Keras's update: automatic control dependencies keep
        # program order between these reads and its assignments (JAX: the
        # stateless scope hands out the value before the assignment).
        ops = _ops_of(self)
        old_mean = ops.copy(ops.convert_to_tensor(self.moving_mean))
        old_var = ops.copy(ops.convert_to_tensor(self.moving_variance))
        outputs = super().call(inputs, training=training, mask=mask)
        _advance_window(self, state, inputs, mask, old_mean, old_var, active)
        return outputs


# ---------------------------------------------------------------------------
# One subclass per (flavour, BatchNormalization class).
# ---------------------------------------------------------------------------


def _plain_batchnorm(flavour: str) -> type:
    return keras_of(flavour).layers.BatchNormalization


@functools.cache
def _window_class(base: type) -> type:
    """The switched class for `base`. For a flavour's own
    BatchNormalization it is `WindowBatchNormalization`, for tf_keras's
    `SyncBatchNormalization` `WindowSyncBatchNormalization`, both
    registered for serialization under `keras_mgpu`; for a user's subclass
    it is a subclass of that, unregistered (restore before saving such a
    model in the `.keras` format)."""
    flavour = _flavour_of_class(base)
    plain = base is _plain_batchnorm(flavour)
    own = plain or base is _tf_keras_sync_batchnorm(flavour)
    name = "WindowBatchNormalization" if plain else f"Window{base.__name__}"
    cls = type(
        name,
        (_WindowStatisticsMixin, base),
        {
            "__module__": __name__,
            "__doc__": (
                f"{base.__name__} whose moving statistics advance once per "
                "window of training calls (see "
                "`keras_mgpu.normalization.use_window_statistics`)."
            ),
        },
    )
    if own:
        register_serializable(cls, flavour)
    return cls


def _tf_keras_sync_batchnorm(flavour: str) -> type | None:
    """tf_keras's `SyncBatchNormalization` (what `synchronize_batchnorm`
    makes of a tf_keras BatchNormalization); None for Keras 3, where
    `synchronized` is part of BatchNormalization's config."""
    if flavour != "tf_keras":
        return None
    return keras_of("tf_keras").layers.experimental.SyncBatchNormalization


def _flavour_of_class(base: type) -> str:
    for klass in base.__mro__:
        module = klass.__module__ or ""
        if module.startswith("tf_keras"):
            return "tf_keras"
    return "keras3"


def window_batch_normalization_class(flavour: str | None = None) -> type:
    """`WindowBatchNormalization` of `flavour` (the process's when None)."""
    return _window_class(_plain_batchnorm(flavour or FLAVOUR))


# ---------------------------------------------------------------------------
# The whole-model switch and its undo.
# ---------------------------------------------------------------------------


def _check_model(model: Any, argument: str = "model") -> None:
    found = object_flavour(model)
    if found not in ("keras3", "tf_keras") or not isinstance(
        model, keras_of(found).layers.Layer
    ):
        raise TypeError(
            f"Argument `{argument}` must be a Keras model or layer (Keras 3 "
            f"or tf_keras). Received: {argument}={model!r} (of type "
            f"{type(model).__name__})"
        )


def _window_of(window: Any, optimizer: Any) -> int:
    if optimizer is None:
        if window is None:
            raise ValueError(
                "Pass `window` (training calls of each BatchNormalization "
                "layer per optimizer update: K accumulation steps, M "
                "pipeline micro-batches, K*M for both) or `optimizer` (a "
                "GradientAccumulationOptimizer). Received: window=None, "
                "optimizer=None"
            )
        return check_int(window, "window", minimum=1)
    steps = getattr(optimizer, "accumulation_steps", None)
    if steps is None:
        # A Keras optimizer with Keras's own accumulation.
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if not isinstance(steps, int) or isinstance(steps, bool):
        raise TypeError(
            "Argument `optimizer` must be a keras_mgpu "
            "GradientAccumulationOptimizer (its `accumulation_steps` is the "
            "window) or a Keras optimizer with `gradient_accumulation_steps`"
            f" set. Received: optimizer={optimizer!r}"
        )
    if window is not None:
        raise ValueError(
            "Pass either `window` or `optimizer`, not both (the window of a "
            "pipelined, accumulated model is K*M: pass window=K*M). "
            f"Received: window={window!r}, optimizer={optimizer!r}"
        )
    return steps


def _check_layer(layer: Any) -> None:
    if getattr(layer, "renorm", False):
        raise ValueError(
            f"BatchNormalization layer {layer.name!r} uses `renorm=True`, "
            "whose renormalisation statistics advance per call too; window "
            "statistics do not cover it. Received: renorm=True"
        )
    if getattr(layer, "virtual_batch_size", None) is not None:
        raise ValueError(
            f"BatchNormalization layer {layer.name!r} uses "
            "`virtual_batch_size` (ghost batches), which already splits the "
            "batch; window statistics do not cover it. Received: "
            f"virtual_batch_size={layer.virtual_batch_size!r}"
        )


def _recompute_switch(layer: Any):
    """The in-place recompute switch of `layer` (keras_mgpu.layers), which
    captured the class's `call` when it was made: undone before a class
    swap and made again after it, so it runs the swapped class's `call`."""
    from keras_mgpu.layers.recompute_in_place import (
        is_switched_per_layer,
        recompute_layer_in_place,
        restore_layer,
    )

    switched = is_switched_per_layer(layer)
    if switched:
        restore_layer(layer)

    def again() -> None:
        if switched:
            recompute_layer_in_place(layer)

    return again


def _switch(layer: Any, window: int, statistics: str) -> None:
    if isinstance(layer, _WindowStatisticsMixin):
        if (layer.window, layer.statistics) == (window, statistics):
            # Already so (a loaded `.keras` file, a second call): keep the
            # window in progress.
            mark_choice(layer, statistics)
            return
        _restore(layer)
    _check_layer(layer)
    again = _recompute_switch(layer)
    original = type(layer)
    user_momentum = layer.__dict__.pop("momentum", None)
    if user_momentum is None:  # pragma: no cover - Keras sets it in __init__
        user_momentum = layer.momentum
    layer.__class__ = _window_class(original)
    object.__setattr__(layer, _ORIGINAL_CLASS, original)
    object.__setattr__(layer, _USER_MOMENTUM, user_momentum)
    _set_mode(layer, window, statistics)
    _ensure_state(layer)
    saved(layer)["window"] = {"choice": choice_of(layer)}
    mark_choice(layer, statistics)
    again()


def _restore(layer: Any) -> None:
    again = _recompute_switch(layer)
    state = list(layer.__dict__.pop(_STATE, None) or ())
    if state:
        _untrack(layer, state)
    original = base_class(layer)
    layer.__dict__.pop(_ORIGINAL_CLASS, None)
    user_momentum = layer.__dict__.pop(_USER_MOMENTUM, None)
    layer.__class__ = original
    object.__setattr__(layer, "momentum", user_momentum)
    for name in (_WINDOW, _STATISTICS):
        layer.__dict__.pop(name, None)
    # Made as a WindowBatchNormalization (a loaded `.keras` file): no record.
    record = pop_saved(layer, "window") or {}
    if choice_of(layer) in STATISTICS:
        mark_choice(layer, choice_after_undo(layer, record.get("choice")))
    again()


def base_class(layer: Any) -> type:
    """The class of `layer` leaving window statistics aside: the class it
    was switched from (or, for a layer loaded switched, the one its
    switched class extends); `type(layer)` for a layer not switched."""
    if not isinstance(layer, _WindowStatisticsMixin):
        return type(layer)
    original = layer.__dict__.get(_ORIGINAL_CLASS)
    if original is not None:
        return original
    mro = type(layer).__mro__
    return mro[mro.index(_WindowStatisticsMixin) + 1]


def set_base_class(layer: Any, base: type) -> None:
    """Give `layer` the class `base` (tf_keras: `SyncBatchNormalization`
    and back, see `synchronize_batchnorm`), keeping its window statistics
    when it is switched: the switched class becomes `base`'s. Both share
    `call` (the mixin's over BatchNormalizationBase's), so an in-place
    recompute switch stays valid."""
    if isinstance(layer, _WindowStatisticsMixin):
        layer.__class__ = _window_class(base)
        object.__setattr__(layer, _ORIGINAL_CLASS, base)
    else:
        layer.__class__ = base


def _reset_compiled_functions(model: Any) -> None:
    # Keras caches the traced train/test/predict functions on the model:
    # the next `fit` must trace the switched calls.
    from keras_mgpu.layers.recompute_in_place import reset_compiled_functions

    reset_compiled_functions(model)


def use_window_statistics(
    model: Any,
    *,
    window: int | None = None,
    statistics: str = "window",
    optimizer: Any = None,
) -> Any:
    """Make the BatchNormalization layers of `model` move their statistics
    once per optimizer update, as the large batch would.

    With gradient accumulation (`GradientAccumulationOptimizer`, K
    micro-batches per update) or pipeline micro-batches
    (`apply_placement(..., micro_batches=M)`), each BatchNormalization layer
    is trained on `window` micro-batches per optimizer update (K, M, or K*M
    for both). Unchanged, its moving mean and variance advance `window`
    times per update with the momentum meant for one step, each time
    towards one micro-batch's statistics. This function switches every
    BatchNormalization layer of `model` (nested models and layers included)
    in place and returns the same model:

    - `statistics="window"` (default): each layer accumulates the
      micro-batches' statistics over `window` training calls (pairwise
      count-weighted merge, so the window's mean and biased variance are
      those of the large batch exactly, for any micro-batch sizes), and at
      the window's last call moves `moving_mean` and `moving_variance` once,
      with the layer's own momentum. The moving statistics then equal the
      large batch's whenever the micro-batches see what the large batch
      would (no normalisation before the layer differs per micro-batch); in
      a deeper network the layers above the first BatchNormalization see
      inputs normalised per micro-batch, which no bookkeeping of
      statistics can undo. The accumulators are 4 non-trainable variables
      per layer (`window_calls`, `window_count`, `window_mean`,
      `window_m2`), so weights checkpoints, `BackupAndRestore` and `.keras`
      files resume mid-window exactly.
    - `statistics="momentum"`: no extra state; the moving statistics move
      every call with momentum `momentum ** (1 / window)`, so `window`
      calls decay the past as one step would. Exact when every micro-batch
      of a window has the same statistics; otherwise it misses the variance
      between micro-batches (the window's variance is the mean of the
      micro-batches' variances plus the variance of their means).

    Normalisation in training stays per micro-batch (each micro-batch is
    normalised with its own statistics, as any BatchNormalization run on it
    does); inference is unchanged. `window` counts training calls of each
    layer: start it at the start of an accumulation window (a new model,
    or after an update), or windows straddle updates. A layer called twice
    per step (shared) is called `2 * window` times per update.

    Layers marked frozen (`choice_of(layer) == "frozen"`, see
    `keras_mgpu.normalization`) are left as they are; every other switched
    layer is marked with the `statistics` chosen.

    Each layer's class is swapped for `WindowBatchNormalization` (a
    registered subclass, one per Keras flavour), so `get_config` carries
    `window` and `statistics` and a `.keras` file loads back switched
    (with `keras_mgpu` imported); `layer.momentum` reads the momentum
    applied per call, `get_config()["momentum"]` the user's. Call
    `restore_batchnorm_statistics` to undo, e.g. before saving a model for
    loading without keras_mgpu. Subclasses of BatchNormalization are
    switched to an unregistered subclass of their own (restore them before
    saving in the `.keras` format). Calling it again with the same
    `window` and `statistics` (say on a model loaded from a `.keras` file)
    keeps the window in progress; other values start a new one. A
    compiled model's cached train, test and predict functions are dropped,
    so the next `fit` uses the switch.
    Composes with `apply_recompute(..., in_place=True)` in either order
    (the recomputation's replay leaves the moving statistics and
    accumulators as the forward left them).

    Under `tf.distribute`: every replica normalises its own share of each
    micro-batch and keeps its own moving statistics, as BatchNormalization
    does (Keras 3: variables with aggregation "none", updated per replica;
    tf_keras: on-read, averaged when read across replicas); the
    accumulators are created in the strategy of the moving statistics and
    are kept per replica in the same way. With synchronised statistics
    (`synchronize_batchnorm`, or `synchronized=True`) each micro-batch's
    statistics are global, and so is its weight in the window (its count
    is all-reduced with them): every replica's window is the global large
    batch's, also when a batch does not split evenly across the replicas
    (tested: 29 examples in micro-batches of 8 on 2 replicas). Keras 3
    keeps masked moments local even when synchronized; so are their
    counts then.

    Composes with `synchronize_batchnorm` in either order, and the two are
    undone in either order; once both are undone the layer is the plain
    one again. tf_keras: a synchronised layer is a
    `SyncBatchNormalization`, switched a `WindowSyncBatchNormalization`
    (registered too), so `.keras` files keep both.

    On JAX (`keras.distribution`): the jitted step is the global program,
    so under `DataParallel` (or `ModelParallel` with a batch axis) each
    micro-batch's statistics are those of the whole global micro-batch and
    the window's are the global large batch's. The accumulators take the
    moving statistics' layout, whether or not the distribution is still in
    force when this is called. The same math (written with `keras.ops`)
    runs on both backends; with Keras's own
    `gradient_accumulation_steps=K`, pass `window=K` or the optimizer.
    Keras's `DataParallel` refuses a batch that does not split evenly
    across the devices (`IndivisibleError` in `fit`, Keras 3.15): choose
    sizes that divide, or drop the remainder.

    Args:
        model: A Keras model or layer (Keras 3 or tf_keras), or a
            BatchNormalization layer itself.
        window: int >= 1. Training calls of each BatchNormalization layer
            per optimizer update. Pass this or `optimizer`.
        statistics: `"window"` (default, exact) or `"momentum"` (no extra
            state, approximate).
        optimizer: A `GradientAccumulationOptimizer` (`window` is its
            `accumulation_steps`) or a Keras optimizer made with
            `gradient_accumulation_steps=K` (`window` is K).

    Returns:
        `model`, switched in place.

    Raises:
        TypeError: `model` is not a Keras model or layer, `window` not an
            integer, `optimizer` not an accumulation optimizer.
        ValueError: `window < 1`, an unknown `statistics`, both or neither of
            `window` and `optimizer`, no BatchNormalization layer in `model`,
            or a layer with `renorm=True` or `virtual_batch_size`.

    Example:

    ```python
    import keras
    from keras_mgpu.normalization import use_window_statistics
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(1),
    ])
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1), accumulation_steps=4
    )
    use_window_statistics(model, optimizer=optimizer)
    model.compile(optimizer=optimizer, loss="mse")
    x = keras.random.normal((64, 8))
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    ```
    """
    require_backend("use_window_statistics")
    _check_model(model)
    window = _window_of(window, optimizer)
    _check_statistics(statistics)
    layers = batchnorm_layers(model)
    if not layers:
        raise ValueError(
            f"Model {getattr(model, 'name', model)!r} has no "
            "BatchNormalization layer (searched its layers, nested models "
            "and layers included), so there are no statistics to window. "
            f"Received: model of type {type(model).__name__}"
        )
    # A layer frozen by choice (`freeze_batchnorm`) moves no statistics;
    # switching it would only overwrite that choice.
    layers = [layer for layer in layers if choice_of(layer) != "frozen"]
    for layer in layers:
        _check_layer(layer)
    for layer in layers:
        _switch(layer, window, statistics)
    _reset_compiled_functions(model)
    return model


def restore_batchnorm_statistics(model: Any) -> Any:
    """Undo `use_window_statistics`: switch every BatchNormalization layer of
    `model` back to its own class, momentum and weights.

    The moving statistics keep their values; accumulators of a window in
    progress are dropped (its micro-batches never reach the moving
    statistics). A layer loaded as `WindowBatchNormalization` from a
    `.keras` file becomes a plain `BatchNormalization`. Layers not switched
    are left alone, so this is safe to call on any model. Cached train,
    test and predict functions are dropped. Synchronisation
    (`synchronize_batchnorm`) stays as it is (tf_keras: a
    `WindowSyncBatchNormalization` becomes a `SyncBatchNormalization`);
    undone as well, the layer is the plain one it was: class, config,
    weights and instance attributes.

    Under `tf.distribute`: nothing distributed happens; call it outside the
    training step, as `use_window_statistics`.

    Args:
        model: A Keras model or layer (Keras 3 or tf_keras).

    Returns:
        `model`, restored in place.

    Example:

    ```python
    import keras
    from keras_mgpu.normalization import (
        restore_batchnorm_statistics,
        use_window_statistics,
    )

    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.BatchNormalization()]
    )
    use_window_statistics(model, window=4)
    restore_batchnorm_statistics(model)
    assert type(model.layers[0]) is keras.layers.BatchNormalization
    ```
    """
    require_backend("restore_batchnorm_statistics")
    _check_model(model)
    for layer in batchnorm_layers(model):
        if isinstance(layer, _WindowStatisticsMixin):
            _restore(layer)
    _reset_compiled_functions(model)
    return model


# The process's flavour is registered at import, so `.keras` files with
# switched layers load once keras_mgpu.normalization is imported (tf_keras:
# synchronised ones too).
window_batch_normalization_class()
if FLAVOUR == "tf_keras":
    _window_class(_tf_keras_sync_batchnorm(FLAVOUR))

__all__ = [
    "STATISTICS",
    "restore_batchnorm_statistics",
    "use_window_statistics",
    "window_batch_normalization_class",
    "window_state",
]
