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

    import keras_mgpu
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

    # What is not multi-process on JAX yet refuses at construction.
    callbacks = keras_mgpu.callbacks
    out["refusals"] = {
        "WorkerWatchdog": _error(lambda: callbacks.WorkerWatchdog()),
        "StragglerMonitor": _error(lambda: callbacks.StragglerMonitor()),
        "MemoryMonitor(gather_workers=True)": _error(
            lambda: callbacks.MemoryMonitor(gather_workers=True)
        ),
    }
    return out
