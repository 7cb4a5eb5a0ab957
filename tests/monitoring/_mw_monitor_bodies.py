"""Worker body: both monitors on a MultiWorkerMirrored worker.

Keras 3.15 `fit` fails under MultiWorkerMirroredStrategy (keras#20585), so
the callbacks are driven by a custom loop, as a user would.
"""

from __future__ import annotations

import warnings


def monitor_body(task_index: int, gather: bool = False):
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    from keras_mgpu._flavour import keras
    from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    monitors = [
        MemoryMonitor(gather_workers=gather),
        GPULoadMonitor(interval=0.01, gather_workers=gather),
    ]

    @tf.function
    def step(x):
        def replica(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        return strategy.run(replica, args=(x,))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in monitors:
            m.set_model(model)
            m.on_train_begin()
        logs = {}
        for m in monitors:
            m.on_epoch_begin(0)
        for _ in range(3):
            step(tf.ones((8, 4)))
        for m in monitors:
            m.on_epoch_end(0, logs)
        for m in monitors:
            m.on_train_end()
    keys = [key for m in monitors for key in m.keys]
    return {
        "logs": {k: float(v) for k, v in logs.items()},
        "keys": keys,
    }
