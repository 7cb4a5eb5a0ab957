"""What keras_mgpu does only on Keras's JAX backend.

Each module here is imported only where the JAX backend runs, so nothing in it
imports TensorFlow.

- `distribution`: the `keras.distribution` in force, its data-parallel size
  and this process's place among JAX's processes.
- `train_function`: a train function JAX traces afresh (its trace cache
  would hand back an earlier trace of an equal `model.train_step`).
"""
