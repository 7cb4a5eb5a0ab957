"""keras_mgpu: drop-in Keras components for training on many devices.

Gradient accumulation that is exact under `tf.distribute` and
`keras.distribution`, learning-rate scaling and warmup counted in optimizer
updates, memory and GPU-load monitors that log next to the loss, and
gradient checkpointing. Built on Keras 3 (TensorFlow or JAX backend), or on
tf_keras when `TF_USE_LEGACY_KERAS=1`; `keras_mgpu.backend` says which
components run on which backend.

The names below are loaded on first use (PEP 562), so `import keras_mgpu`
and the `keras-mgpu` command line start without TensorFlow; the Keras flavour
is nevertheless fixed by the environment at `import keras_mgpu`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from keras_mgpu import _flavour_switch  # noqa: F401  (fixes the flavour now)

__version__ = "0.2.0"

# Public name -> module that defines it.
_EXPORTS = {
    "GradientAccumulationOptimizer": "keras_mgpu.optimizers",
    "RecomputeGrad": "keras_mgpu.layers",
    "Warmup": "keras_mgpu.schedules",
    "apply_placement": "keras_mgpu.placement",
    "apply_recompute": "keras_mgpu.layers",
    "configure_batch": "keras_mgpu.batch_size",
    "find_batch_size": "keras_mgpu.batch_size",
    "global_batch_size": "keras_mgpu.distribute",
    "num_replicas_in_sync": "keras_mgpu.distribute",
    "placement_report": "keras_mgpu.placement",
    "plan_batch": "keras_mgpu.batch_size",
    "plan_memory": "keras_mgpu.batch_size",
    "recomputed_layers": "keras_mgpu.layers",
    "scaled_learning_rate": "keras_mgpu.schedules",
    "strip_placement": "keras_mgpu.placement",
    "strip_recompute": "keras_mgpu.layers",
}
_SUBMODULES = (
    "backend",
    "batch_size",
    "callbacks",
    "compression",
    "distribute",
    "layers",
    "monitoring",
    "normalization",
    "optimizers",
    "placement",
    "schedules",
    "sharding",
)

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:  # what the lazy loading resolves to, for type checkers
    from keras_mgpu import (
        backend,  # noqa: F401
        batch_size,  # noqa: F401
        callbacks,  # noqa: F401
        compression,  # noqa: F401
        distribute,  # noqa: F401
        layers,  # noqa: F401
        monitoring,  # noqa: F401
        normalization,  # noqa: F401
        optimizers,  # noqa: F401
        placement,  # noqa: F401
        schedules,  # noqa: F401
        sharding,  # noqa: F401
    )
    from keras_mgpu.batch_size import (
        configure_batch,  # noqa: F401
        find_batch_size,  # noqa: F401
        plan_batch,  # noqa: F401
        plan_memory,  # noqa: F401
    )
    from keras_mgpu.distribute import (
        global_batch_size,  # noqa: F401
        num_replicas_in_sync,  # noqa: F401
    )
    from keras_mgpu.layers import (
        RecomputeGrad,  # noqa: F401
        apply_recompute,  # noqa: F401
        recomputed_layers,  # noqa: F401
        strip_recompute,  # noqa: F401
    )
    from keras_mgpu.optimizers import GradientAccumulationOptimizer  # noqa: F401
    from keras_mgpu.placement import (
        apply_placement,  # noqa: F401
        placement_report,  # noqa: F401
        strip_placement,  # noqa: F401
    )
    from keras_mgpu.schedules import (
        Warmup,  # noqa: F401
        scaled_learning_rate,  # noqa: F401
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"keras_mgpu.{name}")
    else:
        raise AttributeError(f"module 'keras_mgpu' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
