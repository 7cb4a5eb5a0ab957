"""Pipelining: cut each batch into micro-batches inside the step.

The placed model's graph is called once per micro-batch, between a layer
that splits every input and one that concatenates every output. No
schedule is written down: stage s of micro-batch m depends only on stage
s-1 of micro-batch m, so TensorFlow's executor runs stage s on m while
stage s+1 works on m-1 (GPipe's fill-and-drain schedule falls out of the
dataflow). The loss sees the concatenated batch, so the gradients are the
un-pipelined model's (mean over the batch), to float rounding, for layers
that treat examples independently.
"""

from __future__ import annotations

import contextlib
from typing import Any

from keras_mgpu._flavour import keras, register_serializable, tf
from keras_mgpu._validation import check_int
from keras_mgpu.placement import micro_batch_groups
from keras_mgpu.placement._graph import producer
from keras_mgpu.placement.devices import canonical_device, device_exists


def _on(device: str):
    return (
        tf.device(device) if device_exists(device) else contextlib.nullcontext()
    )


def micro_batch_sizes(batch: Any, micro_batches: int) -> Any:
    """Sizes of `micro_batches` pieces of `batch`, differing by at most one
    (the first `batch % micro_batches` get one more), as a tensor."""
    base = batch // micro_batches
    extra = batch % micro_batches
    return base + tf.cast(tf.range(micro_batches) < extra, batch.dtype)


@register_serializable
class MicroBatchSplit(keras.layers.Layer):
    """Cuts a batch into `micro_batches` pieces along the first axis.

    Pieces differ in size by at most one example. In training, a batch
    smaller than `micro_batches` raises (an empty micro-batch would give
    BatchNormalization NaN statistics); in inference empty pieces are
    harmless and allowed.

    Args:
        micro_batches: int >= 2.
        device: str, where the split runs (the first stage's device).
        **kwargs: base `Layer` arguments.
    """

    def __init__(self, micro_batches: int, device: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.micro_batches = check_int(
            micro_batches, "micro_batches", minimum=2
        )
        self.device = canonical_device(device, "device")
        self.supports_jit = False

    def call(self, inputs: Any, training: bool | None = None) -> list:
        micro_batch_groups.open_group()
        with _on(self.device):
            batch = tf.shape(inputs, out_type=tf.int32)[0]
            if training:
                check = tf.debugging.assert_greater_equal(
                    batch,
                    self.micro_batches,
                    message=(
                        "Argument `micro_batches` of the placed model is "
                        f"{self.micro_batches}, so each training batch needs "
                        f"at least {self.micro_batches} examples (an empty "
                        "micro-batch would give BatchNormalization NaN "
                        "statistics). The last batch of a dataset is often "
                        "smaller: batch with drop_remainder=True."
                    ),
                )
                with tf.control_dependencies([check]):
                    batch = tf.identity(batch)
            sizes = micro_batch_sizes(batch, self.micro_batches)
            return tf.split(inputs, sizes, num=self.micro_batches, axis=0)

    def compute_output_shape(self, input_shape: Any) -> list:
        shape = (None, *tuple(input_shape)[1:])
        return [shape] * self.micro_batches

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(micro_batches=self.micro_batches, device=self.device)
        return config


@register_serializable
class MicroBatchConcat(keras.layers.Layer):
    """Concatenates micro-batch outputs (and their masks) along the first
    axis, in order.

    Args:
        device: str, where the concatenation runs (the device of the stage
            that computes this output).
        **kwargs: base `Layer` arguments (`name`: the placed model names it
            after the output layer, so output names do not change).
    """

    def __init__(self, device: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.device = canonical_device(device, "device")
        self.supports_masking = True
        self.supports_jit = False

    def call(self, inputs: list) -> Any:
        micro_batch_groups.close_group()
        with _on(self.device):
            return tf.concat(list(inputs), axis=0)

    def compute_mask(self, inputs: list, mask: Any = None) -> Any:
        if mask is None or any(m is None for m in mask):
            return None
        with _on(self.device):
            return tf.concat(list(mask), axis=0)

    def compute_output_shape(self, input_shape: list) -> tuple:
        return (None, *tuple(input_shape[0])[1:])

    def get_config(self) -> dict:
        config = super().get_config()
        config["device"] = self.device
        return config


def pipelined(stages: Any, micro_batches: int, first: str, last: dict):
    """(inputs, outputs) of a graph that runs the functional model `stages`
    once per micro-batch.

    Args:
        stages: the placed functional model.
        micro_batches: int >= 2.
        first: device of the splits.
        last: {output layer name: device} for the concatenations.
    """
    inputs = keras.tree.map_structure(
        lambda t: keras.Input(
            batch_shape=t.shape, dtype=t.dtype, name=producer(t).name
        ),
        stages.input,
    )
    flat_inputs = keras.tree.flatten(inputs)
    pieces = [
        MicroBatchSplit(micro_batches, first, name=f"micro_batch_split_{i}")(x)
        for i, x in enumerate(flat_inputs)
    ]
    per_micro_batch = []
    for m in range(micro_batches):
        args = keras.tree.pack_sequence_as(
            inputs, [piece[m] for piece in pieces]
        )
        per_micro_batch.append(keras.tree.flatten(stages(args)))
    output_names = [producer(t).name for t in keras.tree.flatten(stages.output)]
    flat_outputs = [
        MicroBatchConcat(last[out_name], name=out_name)(
            [outs[k] for outs in per_micro_batch]
        )
        for k, out_name in enumerate(output_names)
    ]
    outputs = keras.tree.pack_sequence_as(stages.output, flat_outputs)
    return inputs, outputs
