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
