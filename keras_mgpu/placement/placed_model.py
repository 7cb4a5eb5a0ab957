"""`PlacedModel`: the functional model `apply_placement` returns."""

from __future__ import annotations

import functools
from typing import Any

from keras_mgpu._flavour import keras_of, register_serializable, tf
from keras_mgpu.placement.colocation import (
    colocate_unplaced_ops,
    gradients_stay_on_their_devices,
    optimizer_chain,
)
from keras_mgpu.placement.devices import check_strategy

# Placement is Keras 3 only, whatever TF_USE_LEGACY_KERAS says.
keras = keras_of("keras3")


@functools.partial(register_serializable, flavour="keras3")
class PlacedModel(keras.Model):
    """A functional model whose layers run on several devices.

    Built by `keras_mgpu.apply_placement`; its layers are `PlacedLayer`s
    (and, with micro-batches, the placed graph called once per
    micro-batch between `MicroBatchSplit` and `MicroBatchConcat`). It is
    a plain functional model (Keras's functional subclassing) in every
    respect but one: its training step places the ops Keras creates
    outside the layers (loss, optimizer update, clipping, accumulation) on
    the device of their data, so each variable is updated on its own
    device (see `keras_mgpu.placement.colocation`).

    Trains with `model.fit` under the default strategy or
    `OneDeviceStrategy`; a replicating strategy is refused with a
    `ValueError`. Saved and loaded like any functional model (`.keras`),
    placement included.

    Args:
        inputs: as for `keras.Model(inputs, outputs)`.
        outputs: as for `keras.Model(inputs, outputs)`.
        name: str or None, the model's name.

    Example:

    ```python
    placed = keras_mgpu.apply_placement(model, ["/gpu:0", "/gpu:1"])
    isinstance(placed, keras_mgpu.placement.PlacedModel)  # True
    ```
    """

    def __init__(
        self, inputs: Any, outputs: Any, name: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(inputs=inputs, outputs=outputs, name=name, **kwargs)

    def _build_optimizer_next_to_variables(self) -> None:
        """Create the optimizer's variables eagerly (before the first step
        is traced).

        Keras asks each optimizer variable to be colocated with its model
        variable (`strategy.extended.colocate_vars_with`), which works
        eagerly; but Keras 3.15 builds an unbuilt optimizer inside the
        first training step's graph, where the variables are lifted out of
        the colocation scope and all land on the default device (measured:
        every Adam slot on device 0).
        """
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or optimizer.built:
            return
        with tf.init_scope():
            optimizer.build(self.trainable_variables)

    def train_step(self, data: Any) -> Any:
        check_strategy("training the placed model", self.distribute_strategy)
        for optimizer in optimizer_chain(self.optimizer):
            # Keras 3.15 TF optimizers keep the strategy in scope when they
            # were made (private `_distribution_strategy`); one made under
            # MirroredStrategy fails in `apply` with a bare AssertionError.
            check_strategy(
                "its optimizer was created under a replicating strategy",
                getattr(optimizer, "_distribution_strategy", None),
            )
        self._build_optimizer_next_to_variables()
        with (
            colocate_unplaced_ops(),
            gradients_stay_on_their_devices(self.optimizer),
        ):
            return super().train_step(data)
