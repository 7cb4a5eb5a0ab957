"""Bodies of the multi-process tf_keras tests (run by tests/_processes.py).

Each function runs in a fresh process with `TF_USE_LEGACY_KERAS=1` and
returns JSON-able results; the assertions live in the test modules.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

PER_REPLICA_BATCH = 4
ACCUMULATION_STEPS = 2
FEATURES = 5
BASE_LR = 0.01


def _data(samples: int) -> tuple:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = rng.normal(size=(samples, 2)).astype("float32")
    return x, y


def _model(keras, accumulate: bool, learning_rate=BASE_LR):
    """Two Dense layers; with `accumulate`, each wrapped in RecomputeGrad
    and the optimizer in GradientAccumulationOptimizer."""
    from keras_mgpu.layers import apply_recompute
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(2),
        ]
    )
    optimizer = keras.optimizers.Adam(learning_rate, global_clipnorm=0.1)
    if accumulate:
        model = apply_recompute(model, in_place=False)
        optimizer = GradientAccumulationOptimizer(optimizer, ACCUMULATION_STEPS)
    model.compile(optimizer, loss="mse")
    return model


def _callbacks(
    keras, window: int, warmup_callback: bool, gather: bool = False
) -> list:
    """LR scaling ×2 (base batch = half the examples per update), warmup
    over 2 updates (this callback, or else a Warmup schedule), and both
    monitors."""
    from keras_mgpu.callbacks import (
        GPULoadMonitor,
        LearningRateScaler,
        LearningRateWarmup,
        MemoryMonitor,
    )

    callbacks = [
        LearningRateScaler(
            base_batch_size=window // 2,
            per_replica_batch_size=PER_REPLICA_BATCH,
            verbose=0,
        )
    ]
    if warmup_callback:
        callbacks.append(LearningRateWarmup(warmup_steps=2))
    return callbacks + [
        MemoryMonitor(warn_fraction=None, gather_workers=gather),
        GPULoadMonitor(interval=0.05, gather_workers=gather),
    ]


def _reference(keras, x, y, window: int, updates: int) -> list:
    """Plain optimizer, one step per window of `window` samples, with the
    learning rate the components must produce: warmup over 2 updates to
    twice the base rate."""
    model = _model(
        keras,
        accumulate=False,
        learning_rate=keras.optimizers.schedules.PiecewiseConstantDecay(
            [0, 1], [0.0, BASE_LR, 2 * BASE_LR]
        ),
    )
    model.fit(
        x[: window * updates],
        y[: window * updates],
        batch_size=window,
        shuffle=False,
        verbose=0,
    )
    return model.get_weights()


def _monitor_keys(history) -> bool:
    keys = set(history.history)
    return any(k.startswith("mem/") for k in keys) and any(
        k.startswith(("gpu/", "cpu/")) for k in keys
    )


def _sharded_creator(tf, keras, x, y):
    """DatasetCreator: pipeline i takes samples i, i+n, i+2n, ..."""

    def dataset_fn(input_context):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id
        )
        return ds.batch(PER_REPLICA_BATCH).repeat()

    return keras.utils.experimental.DatasetCreator(dataset_fn)


def _max_abs_diff(a: list, b: list) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def _accumulator_sum(optimizer) -> float:
    return float(sum(np.abs(a.numpy()).sum() for a in optimizer.accumulators))


def multi_worker_body(task_index: int) -> dict:
    """MultiWorkerMirrored (2 workers × 1 replica): `model.fit` with
    accumulation, RecomputeGrad, the LR scaler and warmup callbacks and both
    monitors; stop one micro-batch into a window, checkpoint, restore into a
    new model, finish the run; compare with one device at batch K·R·b."""
    from keras_mgpu._flavour import keras, tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    window = PER_REPLICA_BATCH * replicas * ACCUMULATION_STEPS
    updates = 3
    x, y = _data(window * updates)
    reference = _reference(keras, x, y, window, updates)

    micro_steps = ACCUMULATION_STEPS * updates
    first = ACCUMULATION_STEPS + 1  # stops one micro-batch into a window
    with strategy.scope():
        model = _model(keras, accumulate=True)
    history = model.fit(
        _sharded_creator(tf, keras, x, y),
        steps_per_epoch=first,
        epochs=1,
        verbose=0,
        callbacks=_callbacks(keras, window, warmup_callback=True, gather=True),
    )
    pending = int(model.optimizer.pending_steps.numpy())
    accumulator_sum = _accumulator_sum(model.optimizer)
    # Every worker saves (the collective reads need all of them).
    ckpt_dir = os.path.join(tempfile.mkdtemp(), f"task{task_index}")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(os.path.join(ckpt_dir, "ckpt"))

    with strategy.scope():
        restored = _model(keras, accumulate=True)
        restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        path
    ).assert_consumed()
    restored_pending = int(restored.optimizer.pending_steps.numpy())
    restored_sum = _accumulator_sum(restored.optimizer)
    # The second fit reads the samples the first did not consume.
    skip = first * PER_REPLICA_BATCH * replicas
    restored.fit(
        _sharded_creator(tf, keras, x[skip:], y[skip:]),
        steps_per_epoch=micro_steps - first,
        epochs=1,
        verbose=0,
        callbacks=_callbacks(keras, window, warmup_callback=True),
    )
    return {
        "replicas": replicas,
        "pending_at_save": pending,
        "pending_restored": restored_pending,
        "accumulator_sum": accumulator_sum,
        "accumulator_sum_restored": restored_sum,
        "iterations": int(restored.optimizer.iterations.numpy()),
        "micro_steps": int(restored.optimizer.micro_steps.numpy()),
        "max_abs_diff": _max_abs_diff(reference, restored.get_weights()),
        "monitor_keys": _monitor_keys(history),
        "gathered_rss": [
            history.history.get(f"mem/w{w}_host_rss_mb", [None])[-1]
            for w in range(2)
        ],
    }


def parameter_server_body(task_index: int, num_ps: int = 2) -> dict:
    """ParameterServerStrategy on an in-process cluster (1 worker, `num_ps`
    parameter servers on 127.0.0.1): `model.fit` with a DatasetCreator,
    accumulation, RecomputeGrad, a Warmup schedule, the LR scaler and both
    monitors equals one device at batch K·b."""
    from _processes import free_ports

    from keras_mgpu._flavour import keras, tf
    from keras_mgpu.optimizers import GradientAccumulationOptimizer
    from keras_mgpu.schedules import Warmup

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
    servers = [  # noqa: F841 - kept alive until the function returns
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
        model = _model(keras, accumulate=True, learning_rate=Warmup(BASE_LR, 2))
        compression_error = None
        try:  # gradients go to the parameter servers: nothing to compress
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1), 2, compression="float16"
            )
        except ValueError as exc:
            compression_error = str(exc)
    history = model.fit(
        _sharded_creator(tf, keras, x, y),
        steps_per_epoch=ACCUMULATION_STEPS * updates,
        epochs=1,
        verbose=0,
        callbacks=_callbacks(keras, window, warmup_callback=False),
    )
    devices = sorted(
        {a.device.split("/device")[0] for a in model.optimizer.accumulators}
    )
    return {
        "max_abs_diff": _max_abs_diff(reference, model.get_weights()),
        "iterations": int(model.optimizer.iterations.numpy()),
        "micro_steps": int(model.optimizer.micro_steps.numpy()),
        "pending": int(model.optimizer.pending_steps.numpy()),
        "accumulator_devices": devices,
        "monitor_keys": _monitor_keys(history),
        "compression_error": compression_error,
    }
