"""Keras masks on tensors, read and attached the way each Keras flavour does.

Backend-neutral helpers that both the recomputation engines need: the JAX one
(`keras_mgpu.backend.jax.recompute`) and the TensorFlow one in
`keras_mgpu.layers._recompute_engine`. They live here, below both, so the
backend never imports a feature package. Private Keras hooks, each isolated
in one function naming the version it was read from.
"""

from __future__ import annotations

from typing import Any

from keras_mgpu._flavour import IS_TF_KERAS


def get_keras_mask(tensor: Any) -> Any:
    """The Keras mask attached to `tensor`, or None.

    Keras 3.15 keeps masks in `keras.src.backend.common.masking` (an
    attribute, or a side table for tensors that refuse attributes); tf_keras
    2.x uses the `_keras_mask` attribute. Neither is public.
    """
    if IS_TF_KERAS:
        return getattr(tensor, "_keras_mask", None)
    from keras.src.backend.common.masking import get_keras_mask as get

    return get(tensor)


def set_keras_mask(tensor: Any, mask: Any) -> None:
    """Attach `mask` to `tensor` the way Keras does (see `get_keras_mask`)."""
    if IS_TF_KERAS:
        try:
            tensor._keras_mask = mask
        except AttributeError:
            pass
        return
    from keras.src.backend.common.masking import set_keras_mask as put

    put(tensor, mask)


__all__ = ["get_keras_mask", "set_keras_mask"]
