"""What keras_mgpu reaches only through TensorFlow's private API, behind the
same small interfaces as `keras_mgpu/backend/jax/`.

Imported only on TensorFlow (Keras 3 or tf_keras).

- `kv_store`: the coordination service's key-value store of a
  `MultiWorkerMirroredStrategy` cluster, and the collective abort
  (`WorkerWatchdog`).
"""
