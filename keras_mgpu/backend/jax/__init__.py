"""What keras_mgpu does only on Keras's JAX backend.

Each module here is imported only where the JAX backend runs, so nothing in it
imports TensorFlow.

- `distribution`: the `keras.distribution` in force, its data-parallel size
  and this process's place among JAX's processes.
- `accumulation`: the gradient-accumulation step behind
  `GradientAccumulationOptimizer` (one `keras.ops.cond` per call, the inner
  optimizer's `stateless_apply` in the update branch).
- `reduction`: the per-device train step behind
  `GradientAccumulationOptimizer(reduction="per_update")` (gradients of each
  device's shard, reduced once per accumulation window).
- `train_function`: a train function JAX traces afresh (its trace cache
  would hand back an earlier trace of an equal `model.train_step`).
- `recompute`: the recompute engine (`jax.checkpoint`) behind `RecomputeGrad`
  and `apply_recompute`.
- `recompute_memory`: what a function's backward pass keeps (saved
  residuals, the peak of values alive at once), read from its jaxpr.
- `memory`: `memory_stats()` reads, the devices a distribution uses, the
  preallocation note (the monitors).
- `compiled_memory`: what XLA's compiled train step needs for a batch
  (memory analysis, not run), for `find_batch_size`.
- `collectives`: the compiled train step's collectives and their bytes,
  read from XLA's HLO text (`keras_mgpu.monitoring.communication`).
- `variables`: variables laid out like a reference variable.
"""
