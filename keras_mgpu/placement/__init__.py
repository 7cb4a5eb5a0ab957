"""Model parallelism: split one network across devices, pipeline it, and
report where everything went (Keras 3 models, TensorFlow backend; a tf_keras
model gets a clear `NotImplementedError`)."""

from keras_mgpu.placement.apply_placement import (
    apply_placement,
    strip_placement,
)
from keras_mgpu.placement.placed_layer import PlacedLayer, PlacedOperation
from keras_mgpu.placement.placed_model import PlacedModel
from keras_mgpu.placement.report import placement_report

__all__ = [
    "PlacedLayer",
    "PlacedModel",
    "PlacedOperation",
    "apply_placement",
    "placement_report",
    "strip_placement",
]
