"""What keras_mgpu does only on Keras's JAX backend.

Each module here is imported only where the JAX backend runs, so nothing in it
imports TensorFlow.

- `distribution`: the `keras.distribution` in force, its data-parallel size
  and this process's place among JAX's processes.
- `recompute`: the recompute engine (`jax.checkpoint`) behind `RecomputeGrad`
  and `apply_recompute`.
- `recompute_memory`: what a function's backward pass keeps (saved
  residuals, the peak of values alive at once), read from its jaxpr.
"""
