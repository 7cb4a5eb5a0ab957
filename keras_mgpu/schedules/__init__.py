"""Learning-rate schedules and scaling rules."""

from keras_mgpu.schedules.scaling import scaled_learning_rate, scaling_factor
from keras_mgpu.schedules.warmup import Warmup

__all__ = ["Warmup", "scaled_learning_rate", "scaling_factor"]
