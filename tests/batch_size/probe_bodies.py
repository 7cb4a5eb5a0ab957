"""Batch-size probe bodies that run in processes of their own (see
tests/_processes.py): with TensorFlow's CPU allocator statistics
(`TF_ENABLE_ONEDNN_OPTS=1`, which must be set before TensorFlow starts) and
in multi-worker clusters.

`TF_NUM_INTEROP_THREADS=1` in the real-peak process: with parallel ops the
order in which buffers are freed varies from step to step, and the peak
with it (up to ~10% for the MLP). What remains is a dependence on the
process's history (see `_remeasuring_search`).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# (model, budget MB): each search takes a few seconds on 2 cores.
REAL_PEAK_BUDGETS = {"cnn": 48.0, "mlp": 32.0}
# The re-measurement's second batch, far enough above the answer to lie
# beyond the drift of the allocator's figures with the process's history.
ABOVE = 1.25


def cnn(keras):
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((12, 12, 3)),
            *[
                layers.Conv2D(16, 3, padding="same", activation="relu")
                for _ in range(4)
            ],
            layers.Flatten(),
            layers.Dense(512, activation="relu"),
            layers.Dense(10),
        ],
        name="cnn",
    )


def mlp(keras):
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((64,)),
            *[layers.Dense(256, activation="relu") for _ in range(6)],
            layers.Dense(10),
        ],
        name="mlp",
    )


def _data(name):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (12, 12, 3) if name == "cnn" else (64,)
    x = rng.random((64, *shape), dtype="float32")
    y = rng.integers(0, 10, 64)
    return x, y


def _compiled(name):
    from keras_mgpu._flavour import keras

    keras.utils.set_random_seed(0)
    model = {"cnn": cnn, "mlp": mlp}[name](keras)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _remeasuring_search(remeasured: list, confirmations: list):
    """The search, followed by a re-measurement with the same copy of its
    answer and of a batch `ABOVE` times the bracket's upper end.

    The allocator counts whole chunks in use, and a request may be served
    by a larger chunk that an earlier, larger step freed: the same step's
    peak drifts by up to ~15% with which batch sizes ran before (measured
    on CPU with oneDNN, whose allocator serves large requests from
    TensorFlow's BFC allocator, as on GPUs)."""
    from keras_mgpu.batch_size import finder as module

    search = module.search_batch_size

    def search_then_remeasure(measure, *args, **kwargs):
        outcome = search(measure, *args, **kwargs)
        confirmations.extend(
            (m.batch_size, m.peak_mb)
            for m in outcome.measurements
            if m.confirmation
        )
        best = outcome.best.batch_size
        # Above the bracket's upper end: where the answer's confirmation
        # did not fit, the answer stepped down below it, possibly far.
        top = max(best, outcome.upper_bound or best)
        for batch in (best, round(top * ABOVE)):
            remeasured.append(measure(batch)[0])
        return outcome

    module.search_batch_size = search_then_remeasure
    return search


def real_peaks(task_index: int) -> dict:
    """find_batch_size on a CNN and an MLP, with the allocator's real
    figures, and a re-measurement of its answer and of the bracket's upper
    end."""
    from keras_mgpu import find_batch_size
    from keras_mgpu.batch_size import finder as module
    from keras_mgpu.batch_size.search import resolution

    results = {}
    for name, budget in REAL_PEAK_BUDGETS.items():
        model, data = _compiled(name), _data(name)
        remeasured: list = []
        confirmations: list = []
        search = _remeasuring_search(remeasured, confirmations)
        try:
            r = find_batch_size(model, data, memory_budget_mb=budget)
        finally:
            module.search_batch_size = search
        results[name] = {
            "batch_size": r.batch_size,
            "upper_bound": r.upper_bound,
            "resolution": resolution(r.batch_size, 1),
            "peak_mb": r.peak_mb,
            "measured_peak_mb": r.measured_peak_mb,
            "fixed_mb": r.fixed_mb,
            "per_sample_mb": r.per_sample_mb,
            "budget_mb": r.budget_mb,
            "search_budget_mb": r.search_budget_mb,
            "limited_by": r.limited_by,
            "measurements": r.measurements,
            "seconds": r.search_seconds,
            "remeasured": remeasured,
            "confirmations": confirmations,
        }
    return results


def no_allocator_stats(task_index: int) -> dict:
    """find_batch_size with the real reader in a process started with
    oneDNN off (`TF_ENABLE_ONEDNN_OPTS=0`), where TensorFlow keeps no CPU
    allocator statistics: the error's class and message."""
    from keras_mgpu import find_batch_size
    from keras_mgpu.batch_size import AllocatorStatsUnavailable

    model, (x, y) = _compiled("mlp"), _data("mlp")
    try:
        find_batch_size(model, (x[:16], y[:16]), memory_budget_mb=100.0)
    except AllocatorStatsUnavailable as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None, "message": ""}


# Each worker's own budget: worker 1 has less, so both must get its answer.
WORKER_BUDGETS_MB = (20.0, 14.0)
# Explicit, so each worker's own measurements can be judged against its
# budget (by default each worker derives its own margin; the result
# carries the chosen worker's).
WORKER_SAFETY_MARGIN = 0.2
WORKER_GLOBAL_BATCH = 8192


def multi_worker_configure(task_index: int) -> dict:
    """configure_batch on every worker of a MultiWorkerMirroredStrategy
    cluster (Keras 3 `fit` does not run there yet, so only the search and
    the plan), each with its own memory budget."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    from keras_mgpu import configure_batch

    with strategy.scope():
        model = _compiled("mlp")
    setup = configure_batch(
        model,
        _data("mlp"),
        WORKER_GLOBAL_BATCH,
        base_batch_size=256,
        memory_budget_mb=WORKER_BUDGETS_MB[task_index],
        safety_margin=WORKER_SAFETY_MARGIN,
        verbose=0,
    )
    search = setup.search
    return {
        "replicas": setup.num_replicas,
        "device": search.device,
        "batch_size": search.batch_size,
        "worker_batch_sizes": list(search.worker_batch_sizes),
        "own_measurements": search.measurements,
        "fixed_mb": search.fixed_mb,
        "safety_margin": search.safety_margin,
        "per_sample_mb": search.per_sample_mb,
        "per_replica_batch_size": setup.per_replica_batch_size,
        "accumulation_steps": setup.accumulation_steps,
        "learning_rate": setup.learning_rate,
        "optimizer": type(setup.optimizer).__name__,
        "explanation": setup.explanation,
    }


# The MLP of issue 19 (512 -> 6 x 1024, Adam) and its budget: the old probe
# (one `train_on_batch`, no margin) answered 2299 for 148 MB, and training
# at 2299 in a fresh process peaked at 152 MB.
FRESH_BUDGET_MB = 148.0
FRESH_STEPS = 12


def _relu_mlp(inputs, first, width, name):
    """A seeded, compiled Sequential: `first` layers, then 6 Dense(`width`,
    relu) and a Dense(10) head, with Adam (what the fresh-process tests
    measure)."""
    from keras_mgpu._flavour import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((inputs,)),
            *first(keras),
            *[layers.Dense(width, activation="relu") for _ in range(6)],
            layers.Dense(10),
        ],
        name=name,
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _wide_mlp():
    return _relu_mlp(512, lambda keras: [], 1024, "wide_mlp")


def _wide_data(samples):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.random((256, 512), dtype="float32")
    y = rng.integers(0, 10, 256)
    return np.resize(x, (samples, 512)), np.resize(y, (samples,))


def find_for_fresh_fit(task_index: int) -> dict:
    """find_batch_size for the wide MLP (allocator statistics on)."""
    from keras_mgpu import find_batch_size

    r = find_batch_size(
        _wide_mlp(), _wide_data(256), memory_budget_mb=FRESH_BUDGET_MB
    )
    return {
        "batch_size": r.batch_size,
        "peak_mb": r.peak_mb,
        "measured_peak_mb": r.measured_peak_mb,
        "budget_mb": r.budget_mb,
        "search_budget_mb": r.search_budget_mb,
        "measurements": r.measurements,
    }


def fresh_fit_peaks(
    task_index: int, batch_size: int, steps: int = FRESH_STEPS
) -> dict:
    """`fit` of the wide MLP at `batch_size` in this fresh process: the
    allocator peak of each of `steps` steps (the first, which traces,
    included), above what the process held before the model existed."""
    import tensorflow as tf

    from keras_mgpu._flavour import keras

    def peak_mb():
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20

    base = tf.config.experimental.get_memory_info("CPU:0")["current"] / 2**20
    model = _wide_mlp()
    dataset = tf.data.Dataset.from_tensors(_wide_data(batch_size))
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # the step has finished
            peaks.append(peak_mb() - base)

    model.fit(dataset.repeat(steps), epochs=1, verbose=0, callbacks=[Peaks()])
    return {"peaks": peaks}


# Issue 31: a model whose fixed memory (weights and Adam slots) is more
# than half the budget, as the wide MLP's of issue 19 is, yet cheap to
# step: the small MLP above with a 2M-float weight its output adds the mean
# of; the budget halfway between its fresh-process peaks at 256 and 4096
# samples. The former fixed 20% margin answered ~0.3 of the largest batch
# that fits.
BALLAST_SIZE = 2**21
NEAR_MAX_STEPS = 12
# Measured on the 2-core VM (oneDNN on, 12 steps of `fit` in a fresh
# process): 38.5 MB at 256 samples, 61.5 MB at 4096.
NEAR_MAX_BUDGET_MB = 50.0


def _ballast_layer(keras):
    @keras.saving.register_keras_serializable(package="probe_bodies")
    class Ballast(keras.layers.Layer):
        def __init__(self, size, **kwargs):
            super().__init__(**kwargs)
            self.size = size

        def build(self, input_shape):
            # Many small weights, as a model's layers have: one large
            # buffer makes the allocator's chunk reuse jump by its size.
            self.ballast = [
                self.add_weight(shape=(self.size // 16,), initializer="zeros")
                for _ in range(16)
            ]

        def call(self, x):
            return x + sum(keras.ops.mean(w) for w in self.ballast)

        def get_config(self):
            return {**super().get_config(), "size": self.size}

    return Ballast


def _ballast_mlp():
    return _relu_mlp(
        64,
        lambda keras: [_ballast_layer(keras)(BALLAST_SIZE)],
        256,
        "ballast_mlp",
    )


def _ballast_data(samples):
    import numpy as np

    x, y = _data("mlp")
    return np.resize(x, (samples, 64)), np.resize(y, (samples,))


def find_near_maximal(
    task_index: int, budget_mb: float, safety_margin=None
) -> dict:
    """find_batch_size for the ballast MLP (allocator statistics on)."""
    from keras_mgpu import find_batch_size

    # `safety_margin` only when given: the same body ran on 7d44a0f.
    extra = {} if safety_margin is None else {"safety_margin": safety_margin}
    r = find_batch_size(
        _ballast_mlp(), _ballast_data(64), memory_budget_mb=budget_mb, **extra
    )
    return {
        "batch_size": r.batch_size,
        "peak_mb": r.peak_mb,
        "measured_peak_mb": r.measured_peak_mb,
        "budget_mb": r.budget_mb,
        "search_budget_mb": r.search_budget_mb,
        "safety_margin": r.safety_margin,
        "measurements": r.measurements,
        "seconds": r.search_seconds,
    }


def fresh_ballast_peaks(task_index: int, *batch_sizes: int) -> dict:
    """`fit` of the ballast MLP at `batch_sizes[task_index]` (one process
    each, see `run_in_processes`) for `NEAR_MAX_STEPS` steps in this fresh
    process: each step's allocator peak above what the process held
    before the model existed."""
    batch_size, steps = batch_sizes[task_index], NEAR_MAX_STEPS
    import tensorflow as tf

    from keras_mgpu._flavour import keras

    def read(key):
        return tf.config.experimental.get_memory_info("CPU:0")[key] / 2**20

    base = read("current")
    model = _ballast_mlp()
    dataset = tf.data.Dataset.from_tensors(_ballast_data(batch_size))
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # the step has finished
            peaks.append(read("peak") - base)

    model.fit(dataset.repeat(steps), epochs=1, verbose=0, callbacks=[Peaks()])
    return {"peaks": peaks}
