"""Devices for model parallelism: names, defaults, variable placement and
the strategies a placed model can run under.

A placed model spans several devices inside one replica. `tf.distribute`
gives every replica one device, so only the strategies that do not
replicate (the default strategy and `OneDeviceStrategy`) can run it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from keras_mgpu._flavour import tf

ALLOWED_STRATEGIES = (
    "the default strategy (no `strategy.scope()`) or OneDeviceStrategy"
)


def canonical_device(device: Any, argument: str = "devices") -> str:
    """`"/device:GPU:1"` for any spelling of a device (`"gpu:1"`,
    `"/GPU:1"`, a `tf.config.LogicalDevice`, a full
    `"/job:localhost/replica:0/task:0/device:GPU:1"`).

    The job, replica and task are dropped, so a saved placement reads the
    same in every process. Raises a `ValueError` naming `argument` for text
    that is not a device name, or a name without a type and an index.
    """
    name = getattr(device, "name", device)
    if not isinstance(name, str):
        raise TypeError(
            f"Argument `{argument}` must hold device names such as "
            f"'/gpu:0' or '/cpu:1'. Received: {argument} item {device!r} "
            f"(of type {type(device).__name__})"
        )
    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"Argument `{argument}` must hold device names such as "
            f"'/gpu:0' or '/cpu:1'. Received: {argument} item {device!r} "
            f"({exc})"
        ) from None
    if spec.device_type is None or spec.device_index is None:
        raise ValueError(
            f"Argument `{argument}` must name one device, with its type "
            f"and index ('/gpu:0', '/cpu:1'). Received: {argument} item "
            f"{device!r}"
        )
    return f"/device:{spec.device_type.upper()}:{spec.device_index}"


def available_devices() -> list[str]:
    """The logical devices of this process, canonical names, GPUs first."""
    found = []
    for kind in ("GPU", "CPU"):
        for logical in tf.config.list_logical_devices(kind):
            found.append(canonical_device(logical.name))
    return found


def default_devices() -> list[str]:
    """Every logical GPU; without GPUs, every logical CPU device."""
    gpus = [
        canonical_device(d.name) for d in tf.config.list_logical_devices("GPU")
    ]
    if gpus:
        return gpus
    return [
        canonical_device(d.name) for d in tf.config.list_logical_devices("CPU")
    ]


def resolve_devices(
    devices: Sequence[Any] | None, argument: str = "devices"
) -> list[str]:
    """Check `devices` against the logical devices of this process.

    Returns canonical names in the order given. Raises a `ValueError`
    naming `argument` for an empty list, a duplicate or a device that
    does not exist here (listing those that do).
    """
    if devices is None:
        return default_devices()
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TypeError(
            f"Argument `{argument}` must be None or a list of device names "
            f"such as ['/gpu:0', '/gpu:1']. Received: {argument}={devices!r}"
        )
    if not devices:
        raise ValueError(
            f"Argument `{argument}` must name at least one device. "
            f"Received: {argument}={devices!r}"
        )
    names = [canonical_device(d, argument) for d in devices]
    known = available_devices()
    unknown = [orig for orig, name in zip(devices, names) if name not in known]
    if unknown:
        raise ValueError(
            f"Argument `{argument}` names devices that this process does "
            f"not have: {[getattr(d, 'name', d) for d in unknown]}. "
            f"Available: {known}. Received: {argument}={list(devices)!r}"
        )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Argument `{argument}` names a device more than once "
            f"({duplicates}): each stage needs a device of its own. "
            f"Received: {argument}={list(devices)!r}"
        )
    return names


def device_exists(device: str) -> bool:
    return device in available_devices()


def check_strategy(what: str, strategy: Any = None) -> None:
    """Raise if `strategy` (default: the one in scope, or in whose replica
    context this runs) replicates the model, naming `what` was being done
    ("apply_placement", "calling the placed model", ...)."""
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    # TensorFlow's default strategy has no public class.
    default = type(strategy).__name__.startswith("_DefaultDistributionStrategy")
    if default or isinstance(strategy, tf.distribute.OneDeviceStrategy):
        return
    replicas = getattr(strategy, "num_replicas_in_sync", "?")
    raise ValueError(
        f"Model parallelism and data parallelism cannot be combined in "
        f"tf.distribute ({what}): a strategy such as "
        f"{type(strategy).__name__} ({replicas} replica(s)) runs a copy of "
        "the whole model on each of its devices, one device per replica, "
        "so a model placed across devices cannot be replicated. Instead: "
        f"train the placed model under {ALLOWED_STRATEGIES}; or use data "
        "parallelism alone, `keras_mgpu.strip_placement(model)` under the "
        "strategy (with GradientAccumulationOptimizer and RecomputeGrad "
        "when memory is short); or, on the JAX backend of Keras, "
        "`keras.distribution.ModelParallel`, which combines both. "
        f"Received: strategy={type(strategy).__name__}"
    )


def _single_device_token(device: str) -> Any:
    """What a strategy's variable creator reads as "create it on `device`".

    `OneDeviceStrategy` puts every new variable on its own device unless
    the `colocate_with` argument of the variable creator says otherwise;
    a `SingleDevice` there means "this device" (read from TensorFlow 2.21,
    `one_device_strategy.py`, `OneDeviceExtended._create_variable`, and
    `distribute_lib._DefaultDistributionExtended._create_variable`).
    """
    from tensorflow.python.distribute.numpy_dataset import SingleDevice

    return SingleDevice(device)


@contextlib.contextmanager
def variables_on(device: str) -> Iterator[None]:
    """Create the variables made in this block on `device`, ops there too.

    `tf.device` alone places the ops and, under the default strategy, the
    variables; under `OneDeviceStrategy` the strategy's variable creator
    would move the variables to its own device, so the creator is told
    where they belong.
    """

    def creator(next_creator, **kwargs):
        if tf.distribute.has_strategy() and kwargs.get("colocate_with") is None:
            kwargs["colocate_with"] = _single_device_token(device)
        with tf.device(device):
            return next_creator(**kwargs)

    with tf.device(device), tf.variable_creator_scope(creator):
        yield
