"""The code under test: a regression model with its own `train_step`, and
a function each worker of a cluster runs."""

import keras
import numpy as np
import tensorflow as tf


class ClippedRegressor(keras.Model):
    """A custom train step: gradients clipped by global norm *after* they
    are summed over replicas (clipping each replica's share would depend
    on the number of replicas)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        replica = tf.distribute.get_replica_context()
        grads = replica.all_reduce("sum", grads)
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        # Keras's apply sums over replicas again: hand it each replica's share.
        grads = [g / replica.num_replicas_in_sync for g in grads]
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def build_model() -> keras.Model:
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    model = ClippedRegressor(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    return model


def data(samples: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 8)).astype("float32")
    return x, (3.0 * x[:, :1] + 1.0).astype("float32")


def train_on_cluster(epochs: int) -> list:
    """What each worker runs: the weights after `epochs` epochs."""
    import keras_mgpu

    keras_mgpu.distribute.enable_multi_worker_fit()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return [w.tolist() for w in model.get_weights()]
