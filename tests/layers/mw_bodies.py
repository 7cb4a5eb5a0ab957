"""Bodies run in MultiWorkerMirrored worker processes (tests/_processes.py).

Keras 3.15 `model.fit` fails under MultiWorkerMirroredStrategy
(keras-team/keras#20585), so this trains with a custom loop and
`strategy.run`.
"""

from __future__ import annotations


def recompute_body(task_index: int) -> dict:
    """Train plain and RecomputeGrad models 3 steps; report the difference."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    import numpy as np
    from layers._recompute_helpers import data, make_pair

    from keras_mgpu import _flavour

    keras = _flavour.keras
    keras.utils.set_random_seed(1234)
    with strategy.scope():
        plain, wrapped = make_pair(True)
        optimizers = [keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)]
    x, y = data(32)
    global_batch = 16
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat()
    )
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    dataset = dataset.with_options(options)

    losses = {}
    for name, model, optimizer in (
        ("plain", plain, optimizers[0]),
        ("wrapped", wrapped, optimizers[1]),
    ):

        def replica_step(inputs, model=model, optimizer=optimizer):
            features, labels = inputs
            with tf.GradientTape() as tape:
                out = model(features, training=True)
                per_example = tf.reduce_sum(tf.square(out - labels), axis=1)
                loss = tf.reduce_sum(per_example) / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(
                zip(grads, model.trainable_variables, strict=True)
            )
            return loss

        @tf.function
        def train_step(iterator, replica_step=replica_step):
            loss = strategy.run(replica_step, args=(next(iterator),))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        losses[name] = [float(train_step(iterator)) for _ in range(3)]
    diff = max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for a, b in zip(plain.weights, wrapped.weights, strict=True)
    )
    return {
        "task": task_index,
        "replicas": int(strategy.num_replicas_in_sync),
        "losses": losses["wrapped"],
        "plain_losses": losses["plain"],
        "max_weight_diff": diff,
    }
