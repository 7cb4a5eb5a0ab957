"""Bodies of the multi-process tf_keras tests (run by tests/_processes.py).

Each function runs in a fresh process with `TF_USE_LEGACY_KERAS=1` and
returns JSON-able results; the assertions live in the test modules.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

PER_REPLICA_BATCH = 4
ACCUMULATION_STEPS = 2
FEATURES = 5


def _data(samples: int) -> tuple:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = rng.normal(size=(samples, 2)).astype("float32")
    return x, y


def _model(keras, accumulate: bool, clipnorm=None):
    from keras_mgpu.optimizers.gradient_accumulation_tf_keras import (
        GradientAccumulationOptimizer,
    )

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.layers.Dense(8, activation="tanh", input_shape=(FEATURES,)),
            keras.layers.Dense(2),
        ]
    )
    optimizer = keras.optimizers.Adam(0.01, global_clipnorm=clipnorm)
    if accumulate:
        optimizer = GradientAccumulationOptimizer(
            optimizer, ACCUMULATION_STEPS
        )
    model.compile(optimizer, loss="mse")
    return model


def _reference(keras, x, y, window: int, updates: int) -> list:
    """Plain optimizer, one step per window of `window` samples."""
    model = _model(keras, accumulate=False, clipnorm=0.1)
    model.fit(
        x[: window * updates],
        y[: window * updates],
        batch_size=window,
        shuffle=False,
        verbose=0,
    )
    return model.get_weights()


def _sharded_creator(tf, keras, x, y):
    """DatasetCreator: pipeline i takes samples i, i+n, i+2n, ..."""

    def dataset_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id
        )
        return ds.batch(PER_REPLICA_BATCH).repeat()

    return keras.utils.experimental.DatasetCreator(dataset_fn)


def multi_worker_body(task_index: int) -> dict:
    """MultiWorkerMirrored (2 workers × 1 replica): fit with accumulation,
    stop mid-window, checkpoint, restore into a new model, finish the run;
    compare with one device at batch K·R·b."""
    from keras_mgpu._flavour import keras
    from keras_mgpu._flavour import tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    window = PER_REPLICA_BATCH * replicas * ACCUMULATION_STEPS
    updates = 3
    x, y = _data(window * updates)
    reference = _reference(keras, x, y, window, updates)

    micro_steps = ACCUMULATION_STEPS * updates
    first = ACCUMULATION_STEPS + 1  # stops one micro-batch into a window
    with strategy.scope():
        model = _model(keras, accumulate=True, clipnorm=0.1)
    # Every micro-step reads the same sharded stream; the second fit skips
    # what the first consumed.
    model.fit(
        _sharded_creator(tf, keras, x, y),
        steps_per_epoch=first,
        epochs=1,
        verbose=0,
    )
    pending = int(model.optimizer.pending_steps.numpy())
    accumulator_sum = float(
        sum(np.abs(a.numpy()).sum() for a in model.optimizer.accumulators)
    )
    ckpt_dir = os.path.join(tempfile.mkdtemp(), f"task{task_index}")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(os.path.join(ckpt_dir, "ckpt"))

    with strategy.scope():
        restored = _model(keras, accumulate=True, clipnorm=0.1)
        restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        path
    ).assert_consumed()
    restored_pending = int(restored.optimizer.pending_steps.numpy())
    restored_sum = float(
        sum(np.abs(a.numpy()).sum() for a in restored.optimizer.accumulators)
    )
    rest = micro_steps - first
    skip = first * PER_REPLICA_BATCH * replicas
    restored.fit(
        _sharded_creator(tf, keras, x[skip:], y[skip:]),
        steps_per_epoch=rest,
        epochs=1,
        verbose=0,
    )
    diff = max(
        float(np.abs(a - b).max())
        for a, b in zip(reference, restored.get_weights())
    )
    return {
        "replicas": replicas,
        "pending_at_save": pending,
        "pending_restored": restored_pending,
        "accumulator_sum": accumulator_sum,
        "accumulator_sum_restored": restored_sum,
        "iterations": int(restored.optimizer.iterations.numpy()),
        "micro_steps": int(restored.optimizer.micro_steps.numpy()),
        "max_abs_diff": diff,
    }


def parameter_server_body(task_index: int, num_ps: int = 2) -> dict:
    """ParameterServerStrategy on an in-process cluster (1 worker, `num_ps`
    parameter servers on 127.0.0.1): `model.fit` with a DatasetCreator and
    accumulation equals one device at batch K·b."""
    from keras_mgpu._flavour import keras
    from keras_mgpu._flavour import tf
    from _processes import free_ports

    updates = 3
    window = PER_REPLICA_BATCH * ACCUMULATION_STEPS
    x, y = _data(window * updates)
    # The reference runs before this process joins the cluster.
    reference = _reference(keras, x, y, window, updates)

    ports = free_ports(1 + num_ps)
    cluster = {
        "worker": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{p}" for p in ports[1:]],
    }
    spec = tf.train.ClusterSpec(cluster)
    servers = [
        tf.distribute.Server(
            spec, job_name=job, task_index=index, protocol="grpc", start=True
        )
        for job in ("worker", "ps")
        for index in range(len(cluster[job]))
    ]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, rpc_layer="grpc"
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    with strategy.scope():
        model = _model(keras, accumulate=True, clipnorm=0.1)
    model.fit(
        _sharded_creator(tf, keras, x, y),
        steps_per_epoch=ACCUMULATION_STEPS * updates,
        epochs=1,
        verbose=0,
    )
    weights = model.get_weights()
    diff = max(
        float(np.abs(a - b).max()) for a, b in zip(reference, weights)
    )
    devices = sorted(
        {a.device.split("/device")[0] for a in model.optimizer.accumulators}
    )
    result = {
        "max_abs_diff": diff,
        "iterations": int(model.optimizer.iterations.numpy()),
        "micro_steps": int(model.optimizer.micro_steps.numpy()),
        "pending": int(model.optimizer.pending_steps.numpy()),
        "accumulator_devices": devices,
    }
    del servers
    return json.loads(json.dumps(result))
