"""Variables made after a model was built, laid out like its own on JAX.

Keras fixes a variable's layout when it is created, from the
`keras.distribution` in force then. State that keras_mgpu adds to a built
layer (the window statistics' accumulators) must live on the same devices
as the layer's variables, or the jitted step is handed arrays on different
devices; when no distribution is in force at that moment, it takes the
layout of a variable of the layer instead.
"""

from __future__ import annotations

from typing import Any


def place_like(variable: Any, reference: Any) -> None:
    """Give `variable` the layout of `reference` (a variable of the same
    layer): the same layout for the same shape, replicated on its mesh
    otherwise. Nothing happens when `variable` got a layout already (a
    distribution was in force) or `reference` has none.

    Keras 3.15 keeps the layout on `Variable._layout` (private) and applies
    it in `_direct_assign`; both are isolated here.
    """
    import keras

    layout = getattr(reference, "_layout", None)
    if layout is None or getattr(variable, "_layout", None) is not None:
        return
    if not isinstance(layout, keras.distribution.TensorLayout):
        return
    if tuple(variable.shape) != tuple(reference.shape):
        layout = keras.distribution.TensorLayout(
            [None] * len(variable.shape), layout.device_mesh
        )
    variable._layout = layout
    variable._direct_assign(variable.value)


def relayout(variable: Any, axes: tuple, mesh: Any) -> None:
    """Lay `variable` out anew: `axes` (one mesh axis name or None per
    dimension) on `mesh` (a `keras.distribution.DeviceMesh`); its value is
    moved to the new shards (`jax.device_put`, across processes too), and
    every later assignment (a checkpoint's, `BackupAndRestore`'s) lands
    there as well (Keras 3.15: `Variable._layout`, applied in
    `_direct_assign`).
    """
    import keras

    variable._layout = keras.distribution.TensorLayout(tuple(axes), mesh)
    variable._direct_assign(variable.value)


def layout_axes(variable: Any) -> tuple:
    """The mesh axis (or None) each dimension of `variable` is split
    along: its Keras layout's axes, else its value's sharding, else none."""
    import keras

    layout = getattr(variable, "_layout", None)
    if isinstance(layout, keras.distribution.TensorLayout):
        return tuple(layout.axes)
    spec = getattr(getattr(variable.value, "sharding", None), "spec", None)
    rank = len(variable.shape)
    if spec is None:
        return (None,) * rank
    axes = list(spec) + [None] * (rank - len(spec))
    return tuple(axes[:rank])


def put_into_shards(
    variable: Any, host_value: Any, on_shard: Any = None
) -> None:
    """Assign `host_value` (a NumPy array, or anything `np.asarray`
    reads, in host memory) to `variable` where its value lies: each device
    receives only its own slice (`jax.make_array_from_callback`, across
    processes too: each process makes its addressable shards), so no
    device ever holds the whole array (Keras's `assign` of a NumPy value
    first makes it one array on the default device, then splits it).

    `on_shard(index)` is called before each shard is made (measurements).
    """
    import jax
    import numpy as np

    value = np.asarray(host_value)
    sharding = variable.value.sharding
    dtype = variable.value.dtype

    def shard(index):
        if on_shard is not None:
            on_shard(index)
        return np.asarray(value[index], dtype=dtype)

    variable.assign(
        jax.make_array_from_callback(tuple(variable.shape), sharding, shard)
    )


def largest_live_piece(exclude_ids: set) -> int:
    """The largest single shard (bytes on one device) of any live JAX array
    whose id is not in `exclude_ids`."""
    import jax

    return max(
        (
            int(shard.data.nbytes)
            for array in jax.live_arrays()
            if id(array) not in exclude_ids
            for shard in array.addressable_shards
        ),
        default=0,
    )


def live_array_ids() -> set:
    """The ids of the JAX arrays alive now."""
    import jax

    return {id(array) for array in jax.live_arrays()}


def bytes_per_device(variables: Any) -> dict:
    """Bytes of `variables`' values each device holds (their addressable
    shards), by device name."""
    per_device: dict = {}
    for variable in variables:
        for shard in getattr(variable.value, "addressable_shards", ()) or ():
            name = str(shard.device)
            per_device[name] = per_device.get(name, 0) + int(shard.data.nbytes)
    return per_device


def live_bytes_per_device(exclude: Any = ()) -> dict:
    """Bytes of every live JAX array's shards per device (`jax.live_arrays`),
    leaving out the arrays in `exclude` (by identity)."""
    import jax

    skip = {id(a) for a in exclude}
    per_device: dict = {}
    for array in jax.live_arrays():
        if id(array) in skip:
            continue
        for shard in array.addressable_shards:
            name = str(shard.device)
            per_device[name] = per_device.get(name, 0) + int(shard.data.nbytes)
    return per_device
