"""Model parallelism on JAX for any Keras model: a
`keras.distribution.LayoutMap` planned from the model (`plan_layout_map`),
and a checker and report for any layout map (`check_layout_map`,
`LayoutReport`), and the optimizer's state split over the data axis
(`shard_optimizer_state`, ZeRO-1/2), and a model loaded into its shards
(`on_host`, `copy_into_shards`). JAX only; on TensorFlow
`keras_mgpu.apply_placement` splits a model across devices layer by layer.
"""

from keras_mgpu.sharding.check import LayoutReport, check_layout_map
from keras_mgpu.sharding.load import ShardedLoad, copy_into_shards, on_host
from keras_mgpu.sharding.plan import plan_layout_map
from keras_mgpu.sharding.state import (
    StateShardingReport,
    shard_optimizer_state,
)

__all__ = [
    "LayoutReport",
    "ShardedLoad",
    "StateShardingReport",
    "check_layout_map",
    "copy_into_shards",
    "on_host",
    "plan_layout_map",
    "shard_optimizer_state",
]
