"""Model parallelism: split one network across devices, pipeline it, and
report where everything went (Keras 3, TensorFlow backend)."""

from keras_mgpu._flavour import IS_TF_KERAS

if IS_TF_KERAS:
    from keras_mgpu.placement._unavailable import (
        apply_placement,
        placement_report,
        strip_placement,
    )

    __all__ = ["apply_placement", "placement_report", "strip_placement"]
else:
    from keras_mgpu.placement.apply_placement import (
        apply_placement,
        strip_placement,
    )
    from keras_mgpu.placement.pipeline import MicroBatchConcat, MicroBatchSplit
    from keras_mgpu.placement.placed_layer import PlacedLayer, PlacedOperation
    from keras_mgpu.placement.placed_model import PlacedModel
    from keras_mgpu.placement.report import placement_report

    __all__ = [
        "MicroBatchConcat",
        "MicroBatchSplit",
        "PlacedLayer",
        "PlacedModel",
        "PlacedOperation",
        "apply_placement",
        "placement_report",
        "strip_placement",
    ]
