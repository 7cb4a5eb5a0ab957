"""Test bodies that run in processes of their own (see tests/_processes.py).

Each returns plain lists so the parent can compare against its own
one-device reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ACCUMULATION = 3
PER_REPLICA_BATCH = 4
UPDATES = 4


def _data(samples):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 6)).astype("float32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    return x, y


def _model():
    from keras_mgpu._flavour import keras

    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def _inner():
    from keras_mgpu._flavour import keras

    return keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.5)


def reference_weights(num_replicas: int) -> list:
    """Plain inner optimizer, one device, batch K·R·per-replica batch."""

    global_micro = num_replicas * PER_REPLICA_BATCH
    x, y = _data(global_micro * ACCUMULATION * UPDATES)
    model = _model()
    model.compile(optimizer=_inner(), loss="mse")
    model.fit(
        x, y, batch_size=global_micro * ACCUMULATION, shuffle=False, verbose=0
    )
    return [w.tolist() for w in model.get_weights()]


def multi_worker_custom_loop(task_index: int) -> dict:
    """GradientAccumulationOptimizer in a custom loop under MWMS.

    Keras 3.15's `model.fit` fails under MultiWorkerMirroredStrategy
    (keras-team/keras#20585), so this is the loop users write there.
    """
    import tensorflow as tf

    from keras_mgpu import GradientAccumulationOptimizer
    from keras_mgpu._flavour import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    global_micro = replicas * PER_REPLICA_BATCH
    x, y = _data(global_micro * ACCUMULATION * UPDATES)

    def dataset_fn(context):
        # Worker w takes rows [w*b, (w+1)*b) of every global micro-batch, so
        # the union over workers is the plain large batch, in order.
        start = context.input_pipeline_id * PER_REPLICA_BATCH
        index = [
            i
            for step in range(0, len(x), global_micro)
            for i in range(step + start, step + start + PER_REPLICA_BATCH)
        ]
        ds = tf.data.Dataset.from_tensor_slices((x[index], y[index]))
        return ds.batch(PER_REPLICA_BATCH)

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = _model()
        optimizer = GradientAccumulationOptimizer(_inner(), ACCUMULATION)
        loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(inputs):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                # Keras losses divide by the replicas in sync under a
                # strategy, so the replicas' gradients sum to the mean.
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

        strategy.run(replica_step, args=inputs)

    for batch in dataset:
        train_step(batch)
    return {
        "replicas": replicas,
        "iterations": int(optimizer.iterations.numpy()),
        "micro_steps": int(optimizer.micro_steps.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
    }


def mirrored_default_cross_device_ops(task_index: int) -> dict:
    """model.fit under MirroredStrategy with the cross-device ops users get.

    Runs in a fresh process: on CPU the default CollectiveAllReduce pins its
    group size at first use, so it cannot share a process with the fixture's
    other mirrored strategies.
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    from keras_mgpu import GradientAccumulationOptimizer

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    global_micro = 2 * PER_REPLICA_BATCH
    x, y = _data(global_micro * ACCUMULATION * UPDATES)
    with strategy.scope():
        model = _model()
        model.compile(
            optimizer=GradientAccumulationOptimizer(_inner(), ACCUMULATION),
            loss="mse",
        )
    model.fit(x, y, batch_size=global_micro, shuffle=False, verbose=0)
    return {
        # Private attribute, read only to prove which all-reduce ran.
        "cross_device_ops": type(
            getattr(strategy.extended, "_cross_device_ops", None)
        ).__name__,
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
        "reference": reference_weights(2),
    }
