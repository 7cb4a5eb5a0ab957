"""Learning-rate schedules and scaling rules."""

from keras_mgpu.schedules._optimizer_lr import current_learning_rate
from keras_mgpu.schedules.scaling import scaled_learning_rate, scaling_factor
from keras_mgpu.schedules.warmup import Warmup

__all__ = [
    "Warmup",
    "current_learning_rate",
    "scaled_learning_rate",
    "scaling_factor",
]
