"""Optimizer wrappers: gradient accumulation under any strategy.

`GradientAccumulationOptimizer` is the class of the package's default
flavour (`TF_USE_LEGACY_KERAS`); given an inner optimizer of the other
flavour it builds that flavour's class instead, so it follows the objects
it is given.
"""

from __future__ import annotations

from typing import Any

from keras_mgpu._flavour import IS_TF_KERAS, object_flavour
from keras_mgpu.optimizers import _accumulation_common

if IS_TF_KERAS:
    from keras_mgpu.optimizers.gradient_accumulation_tf_keras import (
        GradientAccumulationOptimizer,
    )
else:
    from keras_mgpu.optimizers.gradient_accumulation import (
        GradientAccumulationOptimizer,
    )


def _wrapper_class_for(inner_optimizer: Any) -> type | None:
    """The `GradientAccumulationOptimizer` class for `inner_optimizer`'s
    flavour (None when it belongs to neither)."""
    flavour = object_flavour(inner_optimizer)
    if flavour == "keras3":
        from keras_mgpu.optimizers import gradient_accumulation

        return gradient_accumulation.GradientAccumulationOptimizer
    if flavour == "tf_keras":
        from keras_mgpu.optimizers import gradient_accumulation_tf_keras

        return gradient_accumulation_tf_keras.GradientAccumulationOptimizer
    return None


# Constructing a flavour's class with the other flavour's inner optimizer
# builds the other class (`AccumulationProtocol.__new__` asks this lookup).
_accumulation_common.install_flavour_lookup(_wrapper_class_for)

__all__ = ["GradientAccumulationOptimizer"]
