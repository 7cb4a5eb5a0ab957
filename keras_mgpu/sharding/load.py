"""Load a model into its shards: no device ever holds the whole model.

keras#21634: `ModelParallel` + `from_preset` OOMs on a model that fits the
devices once sharded. Keras 3.15 creates variables under a layout sharded at
initialization, but loading goes through `Variable.assign`, which makes each
NumPy value one array on the default device before splitting it
(`convert_to_tensor`, then `jax.device_put`), and a preset's loader may build
the model before the layout is in force. The path here keeps the whole model
in host memory only: build (and load) it on the host (`on_host`), plan its
layout from it, build the sharded model from its config under
`ModelParallel` (Keras initializes each shard on its device), and copy the
weights into the shards (`copy_into_shards`): each device receives its own
slices of each weight, made on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from keras_mgpu.sharding.plan import require_jax


@dataclasses.dataclass
class ShardedLoad:
    """What `copy_into_shards` moved.

    Attributes:
        variables: how many weights were copied.
        largest_piece_bytes: the largest piece of any array made while the
            weights were copied that one device held (measured as each
            shard was made): at most `largest_shard_bytes`, where
            Keras's `set_weights` puts each whole weight on one device.
        largest_shard_bytes: the largest slice of one weight one device
            owns (a replicated weight: the whole weight).
        largest_weight_bytes: the largest single weight, whole.
    """

    variables: int
    largest_piece_bytes: int
    largest_shard_bytes: int
    largest_weight_bytes: int


def on_host(build: Callable[[], Any]) -> Any:
    """`build()` with no `keras.distribution` in force and JAX's default
    device the host's CPU: the model (its weights loaded, e.g.
    `GemmaBackbone.from_preset(...)`) lives in host memory, whole, and is
    the source for `plan_layout_map` and `copy_into_shards`.

    Example:

    ```python
    host = keras_mgpu.sharding.on_host(
        lambda: keras_hub.models.GemmaBackbone.from_preset("gemma2_9b_en"))
    ```
    """
    import jax

    from keras_mgpu.backend.jax.distribution import no_distribution

    require_jax("on_host")
    cpu = jax.devices("cpu")[0]
    with no_distribution(), jax.default_device(cpu):
        return build()


def copy_into_shards(source: Any, target: Any) -> ShardedLoad:
    """Copy `source`'s weights into `target`'s shards.

    `target` is the same architecture built under the
    `keras.distribution` it trains with (`ModelParallel(layout_map=...)`,
    e.g. `type(source).from_config(source.get_config())` in its scope);
    `source` holds the weights in host memory (`on_host`). Weights are
    paired in order, as `set_weights` pairs them, shapes checked. Each
    device receives only its slices of each weight: none holds the whole
    model, nor a whole weight it does not own (JAX only).

    Args:
        source: a built model with the weights (host memory).
        target: the sharded model, built.

    Returns:
        A `ShardedLoad` (peak bytes per device during the copy, measured).
    """
    import numpy as np

    from keras_mgpu.backend.jax.variables import (
        largest_live_piece,
        live_array_ids,
        put_into_shards,
    )

    require_jax("copy_into_shards")
    sources, targets = list(source.weights), list(target.weights)
    if len(sources) != len(targets):
        raise ValueError(
            f"Model {source.name!r} has {len(sources)} weights and "
            f"{target.name!r} {len(targets)}: build `target` from "
            "`source`'s config. Received: different architectures"
        )
    for s, t in zip(sources, targets):
        if tuple(s.shape) != tuple(t.shape):
            raise ValueError(
                f"Weight {t.path!r} of shape {tuple(t.shape)} cannot take "
                f"{s.path!r} of shape {tuple(s.shape)}: build `target` "
                "from `source`'s config."
            )
    # Arrays alive before the copy (the target's first values, the
    # source's) are not pieces of it.
    before = live_array_ids()
    piece = 0

    def measure(_index) -> None:
        nonlocal piece
        piece = max(piece, largest_live_piece(before))

    largest = 0
    for s, t in zip(sources, targets):
        host = np.asarray(s.value)
        largest = max(largest, host.nbytes)
        put_into_shards(t, host, on_shard=measure)
    measure(None)
    shard = max(
        (
            int(piece.data.nbytes)
            for t in targets
            for piece in t.value.addressable_shards
        ),
        default=0,
    )
    return ShardedLoad(
        variables=len(targets),
        largest_piece_bytes=piece,
        largest_shard_bytes=shard,
        largest_weight_bytes=largest,
    )


__all__ = ["ShardedLoad", "copy_into_shards", "on_host"]
