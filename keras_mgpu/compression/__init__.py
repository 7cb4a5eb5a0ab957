"""Gradient compression: fewer bytes across devices and workers per update.

`GradientAccumulationOptimizer(..., compression=...)` sends the window's mean
gradient across devices once per update, in the form chosen here:

- `"float16"` / `"bfloat16"` (`FloatCompression`): half the bytes of
  float32; float16 scaled so the sum cannot overflow.
- `PowerSGD(rank=r, start_after_updates=n)`: rank-r factors of each weight
  matrix with error feedback and warm start (Vogels et al., 2019).

`CrossDeviceByteCounter(strategy)` measures what each replica sends. A
method of your own subclasses `GradientCompression`; its `state_specs` and
`all_reduce` return `keras_mgpu.compression.base.StateSpec` and `Reduction`.
"""

from keras_mgpu.compression.base import GradientCompression
from keras_mgpu.compression.byte_counter import CrossDeviceByteCounter
from keras_mgpu.compression.float_cast import FloatCompression
from keras_mgpu.compression.power_sgd import PowerSGD
from keras_mgpu.compression.registry import get, serialize

__all__ = [
    "CrossDeviceByteCounter",
    "FloatCompression",
    "GradientCompression",
    "PowerSGD",
    "get",
    "serialize",
]
