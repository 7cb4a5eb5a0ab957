"""Process bodies for tests/distribute/test_jax_cluster_jax.py.

`run_all` runs in every process of one 2-process x 2-CPU-device JAX cluster
(started by `keras_mgpu.testing.run_workers`) and returns every check's
observations; the test module compares them with one process's runs.
"""

from __future__ import annotations

SAMPLES = 32
BATCH = 8  # global
EPOCHS = 3
FEATURES = 3


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    y = (x @ np.array([[0.5], [-1.0], [2.0]], "float32")).astype("float32")
    y += rng.normal(scale=0.1, size=y.shape).astype("float32")
    return x, y


def initial_weights():
    import numpy as np

    rng = np.random.default_rng(1)
    return [
        rng.normal(size=(FEATURES, 4)).astype("float32"),
        np.zeros(4, "float32"),
        rng.normal(size=(4, 1)).astype("float32"),
        np.zeros(1, "float32"),
    ]


def build_model(optimizer):
    import keras

    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.set_weights(initial_weights())
    model.compile(optimizer=optimizer, loss="mse")
    return model


def headline_optimizer():
    import keras

    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    return GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), accumulation_steps=2
    )


def headline_callbacks():
    from keras_mgpu.callbacks import LearningRateWarmup, MemoryMonitor

    return [LearningRateWarmup(warmup_steps=3), MemoryMonitor()]


def _epoch_ids(dataset, epochs):
    """Per epoch, the sample ids (column 0) of every batch in order."""
    orders = []
    for _ in range(epochs):
        dataset.on_epoch_begin()
        epoch = []
        for index in range(len(dataset)):
            batch = dataset[index]
            first = batch[0] if isinstance(batch, tuple) else batch
            epoch.append([int(v) for v in first[:, 0]])
        orders.append(epoch)
        dataset.on_epoch_end()
    return orders


def _error(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the type is reported)
        return f"{type(error).__name__}: {error}"
    return None


def run_all():
    import jax
    import keras
    import numpy as np

    from keras_mgpu.distribute import shard_across_processes, worker_info

    out = {"worker_info": worker_info()}
    out["devices"] = (len(jax.devices()), jax.local_device_count())
    ids = np.arange(SAMPLES, dtype="float32")[:, None]

    distribution = keras.distribution.DataParallel(
        devices=jax.devices(), auto_shard_dataset=True
    )
    out["auto_shard_error"] = _error(
        lambda: shard_across_processes(
            ids, batch_size=BATCH, distribution=distribution
        )
    )
    distribution.auto_shard_dataset = False
    with distribution.scope():
        # Arrays: agreed orders, a new one every epoch, seeded re-runs.
        keras.utils.set_random_seed(5)
        out["shuffled"] = _epoch_ids(
            shard_across_processes(ids, batch_size=BATCH), EPOCHS
        )
        keras.utils.set_random_seed(5)
        out["shuffled_again"] = _epoch_ids(
            shard_across_processes(ids, batch_size=BATCH), EPOCHS
        )
        out["seed_7"] = _epoch_ids(
            shard_across_processes(ids, ids, batch_size=BATCH, seed=7), 1
        )
        out["unshuffled"] = _epoch_ids(
            shard_across_processes(ids, batch_size=BATCH, shuffle=False), 1
        )
        # Batches that cannot be split: 6 over 2 processes x 2 devices.
        out["bad_batch"] = _error(
            lambda: shard_across_processes(ids, batch_size=6)
        )
        out["bad_last_batch"] = _error(
            lambda: shard_across_processes(ids[:30], batch_size=BATCH)
        )
        out["dropped_last_batch"] = len(
            shard_across_processes(
                ids[:30], batch_size=BATCH, drop_remainder=True
            )
        )

        class Global(keras.utils.PyDataset):
            def __len__(self):
                return SAMPLES // BATCH

            def __getitem__(self, index):
                rows = ids[index * BATCH : (index + 1) * BATCH]
                return rows, rows

        out["py_dataset"] = _epoch_ids(shard_across_processes(Global()), 1)
        generator = shard_across_processes(
            (ids[i : i + BATCH],) for i in range(0, SAMPLES, BATCH)
        )
        out["generator"] = [[int(v) for v in b[0][:, 0]] for b in generator]
        uneven = shard_across_processes(iter([ids[:6]]))
        out["generator_error"] = _error(lambda: next(uneven))

        # tf.data: a seeded shuffle, two epochs, cut per process.
        import tensorflow as tf

        def seeded():
            return (
                tf.data.Dataset.from_tensor_slices(ids)
                .shuffle(SAMPLES, seed=3)
                .batch(BATCH)
            )

        def tf_epochs(dataset):
            return [
                [[int(v) for v in b[:, 0]] for b in dataset]
                for _ in range(EPOCHS)
            ]

        out["tf_data"] = tf_epochs(shard_across_processes(seeded()))
        out["tf_data_whole"] = tf_epochs(seeded())  # one process's batches

        # Multi-process fit, shuffled: equal to one process on the same
        # global batches (the test replays the orders).
        x, y = data()
        model = build_model(keras.optimizers.SGD(0.05))
        model.fit(
            shard_across_processes(x, y, batch_size=BATCH, seed=3),
            epochs=EPOCHS,
            verbose=0,
        )
        out["shuffled_fit"] = [np.asarray(w) for w in model.get_weights()]

        # The headline: accumulation + warmup + memory monitor.
        model = build_model(headline_optimizer())
        history = model.fit(
            shard_across_processes(x, y, batch_size=BATCH, shuffle=False),
            epochs=EPOCHS,
            callbacks=headline_callbacks(),
            verbose=0,
        )
        out["headline"] = [np.asarray(w) for w in model.get_weights()]
        out["headline_logs"] = sorted(history.history)
        out["iterations"] = int(model.optimizer.iterations)

    out.update(model_parallel_fit())
    out.update(sharded_state_fit())

    return out


def mlp_for_layouts():
    """Wide enough to be sharded: 16 -> 64 -> 64 -> 1, seeded weights."""
    import keras

    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="tanh", name="fc1"),
            keras.layers.Dense(64, activation="tanh", name="fc2"),
            keras.layers.Dense(1, name="out"),
        ],
        name="mlp",
    )


def model_parallel_data():
    import numpy as np

    rng = np.random.default_rng(2)
    x = rng.normal(size=(SAMPLES, 16)).astype("float32")
    return x, rng.normal(size=(SAMPLES, 1)).astype("float32")


def model_parallel_fit():
    """A planned LayoutMap over a (batch 2, model 2) mesh of both processes'
    devices: weights split along "model" within a process and along
    "batch" across them, so no process holds a whole weight. Returns the
    weights gathered on every process, and what Keras's own readers do."""
    import os
    import tempfile

    import jax
    import keras
    import numpy as np
    from jax.experimental import multihost_utils

    from keras_mgpu.distribute import shard_across_processes
    from keras_mgpu.sharding import plan_layout_map

    x, y = model_parallel_data()
    plain = mlp_for_layouts()
    initial = plain.get_weights()
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], devices=jax.devices()
    )
    layout_map = plan_layout_map(plain, mesh, min_shard_bytes=0)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch", auto_shard_dataset=False
    )
    out = {}
    with distribution.scope():
        model = mlp_for_layouts()
        model.set_weights(initial)
        model.compile(keras.optimizers.SGD(0.05), "mse")
        kernel = model.get_layer("fc1").kernel.value
        out["mp_kernel_spec"] = str(kernel.sharding.spec)
        out["mp_fully_addressable"] = bool(kernel.is_fully_addressable)
        model.fit(
            shard_across_processes(x, y, batch_size=BATCH, shuffle=False),
            epochs=EPOCHS,
            verbose=0,
        )
        out["mp_weights"] = [
            np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
            for v in model.weights
        ]
        folder = tempfile.mkdtemp()
        out["mp_keras_limits"] = {
            "get_weights": _error(model.get_weights),
            "save": _error(lambda: model.save(os.path.join(folder, "m.keras"))),
            "save_weights": _error(
                lambda: model.save_weights(os.path.join(folder, "m.weights.h5"))
            ),
        }
    return out


def sharded_state_optimizer():
    import keras

    from keras_mgpu import GradientAccumulationOptimizer

    return GradientAccumulationOptimizer(keras.optimizers.Adam(0.01), 2)


def sharded_state_fit():
    """`DataParallel` over both processes' 4 devices, the optimizer state
    (Adam's moments, the accumulators) split along the batch axis across
    the processes, recompute with offload: weights gathered on every
    process, the state's layout and bytes per device."""
    import jax
    import keras
    import numpy as np
    from jax.experimental import multihost_utils

    import keras_mgpu
    from keras_mgpu.distribute import shard_across_processes
    from keras_mgpu.sharding import shard_optimizer_state

    x, y = model_parallel_data()
    distribution = keras.distribution.DataParallel(
        devices=jax.devices(), auto_shard_dataset=False
    )
    out = {}
    with distribution.scope():
        model = mlp_for_layouts()
        keras_mgpu.apply_recompute(model, offload=True)
        model.compile(sharded_state_optimizer(), "mse")
        report = shard_optimizer_state(model, min_shard_bytes=0)
        model.fit(
            shard_across_processes(x, y, batch_size=BATCH, shuffle=False),
            epochs=EPOCHS,
            verbose=0,
        )
        out["zero_sharded"] = sorted(report.sharded)
        out["zero_bytes"] = (
            report.bytes_per_device_before,
            report.bytes_per_device_after,
        )
        kernel = [
            v
            for v in model.optimizer.variables
            if v.path.endswith("fc2_kernel_accumulator")
        ][0]
        out["zero_accumulator_spec"] = str(kernel.value.sharding.spec)
        out["zero_weights"] = [
            np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
            for v in model.weights
        ]
    return out
