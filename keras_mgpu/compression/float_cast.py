"""float16 / bfloat16 all-reduce of the mean gradient, float16 scaled so
that the sum cannot overflow."""

from __future__ import annotations

from typing import Any

from keras_mgpu._flavour import tf
from keras_mgpu._validation import check_choice
from keras_mgpu.backend import ON_JAX_NO_COMPRESSION, require_backend
from keras_mgpu.compression.base import GradientCompression, Reduction
from keras_mgpu.compression.reduce import all_reduce_sum

# float16's largest finite value is 65504. Every partial sum of the scaled
# shares is bounded by the sum over replicas of each replica's largest
# magnitude; scaling that bound into (2**14, 2**15] leaves a factor 2 of
# headroom for rounding (each rounding adds at most 2**-11 relative) and
# keeps float16's full 11-bit precision, which is the same anywhere in its
# normal range: only values below 2**-24 of the bound fall into subnormals.
_FLOAT16_TARGET_EXPONENT = 15
# float32 powers of two stay finite and normal within 2**±126.
_MAX_SCALE_EXPONENT = 126.0


def _largest_magnitude_or_inf(grad: tf.Tensor) -> tf.Tensor:
    """max |grad| as float32 (0 for an empty tensor), or +inf when any
    element is not finite: summed over replicas, the bound then says
    "not finite" on every replica."""
    grad = tf.cast(grad, tf.float32)
    largest = tf.maximum(tf.reduce_max(tf.abs(grad)), 0.0)
    finite = tf.reduce_all(tf.math.is_finite(grad))
    return tf.where(finite, largest, float("inf"))


def power_of_two_scales(bounds: tf.Tensor) -> tf.Tensor:
    """For each (summed) bound, the power of two `s` with `bound * s` in
    (2**14, 2**15] (1 for a zero or non-finite bound). Multiplying and
    dividing by a power of two is exact."""
    usable = tf.math.is_finite(bounds) & (bounds > 0.0)
    safe = tf.where(usable, bounds, tf.ones_like(bounds))
    exponent = tf.floor(
        _FLOAT16_TARGET_EXPONENT - tf.math.log(safe) / tf.math.log(2.0)
    )
    exponent = tf.clip_by_value(
        exponent, -_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT
    )
    scales = tf.pow(2.0, exponent)
    # log2 in float32 may be off by one ulp at a power of two: step back
    # where the bound would land above the target.
    too_large = safe * scales > 2.0**_FLOAT16_TARGET_EXPONENT
    scales = tf.where(too_large, scales / 2.0, scales)
    return tf.where(usable, scales, tf.ones_like(scales))


class FloatCompression(GradientCompression):
    """Send each replica's share of the mean gradient in 16-bit floats.

    Every dense gradient is cast to `dtype` before the all-reduce (which then
    sums in that dtype) and back to its own dtype after: half the bytes of
    float32. Sparse gradients (`tf.IndexedSlices`) are sent as they are.

    - **float16** (5-bit exponent, 11-bit significand) overflows above 65504
      and loses values below 6e-8. Before the cast each gradient is scaled
      by a power of two chosen from the sum over replicas of every replica's
      largest magnitude for that gradient, so that no partial sum of the
      all-reduce can exceed 2**15 and small values keep their precision.
      That bound costs one small float32 all-reduce (one number per
      gradient tensor) which also carries the "finite?" check, so float16
      sends as many messages per update as the uncompressed path.
    - **bfloat16** (float32's 8-bit exponent, 8-bit significand) cannot
      overflow where float32 does not, so it is cast without scaling;
      rounding costs about 3 significant digits (relative error below
      2**-8 per element and addition).

    Use through `GradientAccumulationOptimizer(..., compression="float16")`
    or `"bfloat16"`; with one replica nothing is cast.

    Args:
        dtype: "float16" or "bfloat16".

    Example:

    ```python
    import keras
    import keras_mgpu

    optimizer = keras_mgpu.GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1), accumulation_steps=1, compression="float16"
    )
    ```
    """

    def __init__(self, dtype: str = "float16") -> None:
        require_backend(
            "FloatCompression",
            ("tensorflow",),
            instead=ON_JAX_NO_COMPRESSION,
        )
        self.dtype = check_choice(dtype, "dtype", ("float16", "bfloat16"))
        self.method = self.dtype

    def get_config(self) -> dict:
        return {"method": self.method}

    def __repr__(self) -> str:
        return f"FloatCompression({self.dtype!r})"

    def all_reduce(self, context: Any, grads: list, states: list) -> Reduction:
        del states
        wire = tf.float16 if self.dtype == "float16" else tf.bfloat16
        if self.dtype == "float16":
            bounds = tf.stack([_largest_magnitude_or_inf(g) for g in grads])
            bounds = context.all_reduce(tf.distribute.ReduceOp.SUM, bounds)
            finite = tf.reduce_all(tf.math.is_finite(bounds))
            scales = tf.unstack(power_of_two_scales(bounds))
        else:
            finite = tf.constant(True)
            scales = [None] * len(grads)
        payload = [
            tf.cast(g if s is None else g * tf.cast(s, g.dtype), wire)
            for g, s in zip(grads, scales)
        ]
        reduced = all_reduce_sum(context, payload)
        means = [
            _unscale(tf.cast(r, g.dtype), s)
            for r, g, s in zip(reduced, grads, scales)
        ]
        return Reduction(means, finite, [()] * len(grads))


def _unscale(value: tf.Tensor, scale: Any) -> tf.Tensor:
    return value if scale is None else value / tf.cast(scale, value.dtype)
