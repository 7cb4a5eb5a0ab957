"""Learning-rate scaling rules for a larger global batch (Goyal et al. 2017).

The global batch that one update sees is derived with
`keras_mgpu.distribute.global_batch_size` (per-replica batch x replicas in
sync, every worker included, x accumulation steps). Replicas are those of the
`tf.distribute` strategy in scope on TensorFlow, and the data-parallel size
of the `keras.distribution` in force on JAX. The rules themselves are plain
Python arithmetic, the same on every backend.
"""

from __future__ import annotations

import math
from typing import Any

from keras_mgpu._validation import (
    check_choice,
    check_int,
    check_number,
    reject_unknown,
    renamed_argument,
)

SCALING_RULES = ("linear", "sqrt")


def scaling_factor(
    global_batch_size: int,
    base_batch_size: int,
    *,
    scaling_rule: str = "linear",
    **deprecated: Any,
) -> float:
    """Factor by which the learning rate grows with the batch.

    `global_batch_size / base_batch_size` for the "linear" rule (Goyal et
    al. 2017), its square root for the "sqrt" rule (Krizhevsky 2014; often
    preferred for Adam-like optimizers).
    """
    scaling_rule = renamed_argument(
        "scaling_factor",
        deprecated,
        "rule",
        "scaling_rule",
        scaling_rule,
        "linear",
    )
    reject_unknown("scaling_factor", deprecated)
    check_int(global_batch_size, "global_batch_size", minimum=1)
    check_int(base_batch_size, "base_batch_size", minimum=1)
    check_choice(scaling_rule, "scaling_rule", SCALING_RULES)
    ratio = global_batch_size / base_batch_size
    return ratio if scaling_rule == "linear" else math.sqrt(ratio)


def scaled_learning_rate(
    base_learning_rate: float,
    global_batch_size: int,
    base_batch_size: int,
    *,
    scaling_rule: str = "linear",
    **deprecated: Any,
) -> float:
    """The learning rate for `global_batch_size`, given the one tuned for
    `base_batch_size`.

    Args:
        base_learning_rate: float > 0, the learning rate tuned at
            `base_batch_size`.
        global_batch_size: int >= 1, examples per optimizer update (see
            `keras_mgpu.global_batch_size`).
        base_batch_size: int >= 1, the batch `base_learning_rate` was tuned
            for.
        scaling_rule: "linear" (default) or "sqrt". (Called `rule`
            before 0.2; the old name works, with a `FutureWarning`, until
            0.3.)

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        lr = keras_mgpu.scaled_learning_rate(
            0.1, keras_mgpu.global_batch_size(32), base_batch_size=256
        )
    ```

    On JAX, in the scope of a `keras.distribution` instead:

    ```python
    with keras.distribution.DataParallel().scope():
        lr = keras_mgpu.scaled_learning_rate(
            0.1, keras_mgpu.global_batch_size(32), base_batch_size=256
        )
    ```
    """
    base_learning_rate = check_number(
        base_learning_rate,
        "base_learning_rate",
        minimum=0.0,
        exclusive_minimum=True,
    )
    scaling_rule = renamed_argument(
        "scaled_learning_rate",
        deprecated,
        "rule",
        "scaling_rule",
        scaling_rule,
        "linear",
    )
    reject_unknown("scaled_learning_rate", deprecated)
    return base_learning_rate * scaling_factor(
        global_batch_size, base_batch_size, scaling_rule=scaling_rule
    )
