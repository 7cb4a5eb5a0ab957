"""Worker bodies for tests/distribute/test_mw_data_order.py.

Every scenario trains a tiny model whose first input column is the sample
id; its `train_step` records, per worker, the ids of every batch it trained
on, and a callback cuts the record into epochs. The test then checks, per
epoch, that the workers' ids together are every sample exactly once, and
across epochs that the order changes (or repeats, for the seeded re-run).
"""

from __future__ import annotations

import os
import random
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES = 64
BATCH = 8  # global
EPOCHS = 3
FEATURES = 3
REFERENCE_SEED = 11


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    ids = np.arange(SAMPLES, dtype="float32")[:, None]
    x = np.concatenate(
        [ids, rng.normal(size=(SAMPLES, FEATURES)).astype("float32")], axis=1
    )
    y = rng.normal(size=(SAMPLES, 1)).astype("float32")
    return x, y


def _recording_model(seen: list):
    """A Dense model on x[:, 1:] that appends each batch's ids to `seen`."""
    import keras
    import numpy as np
    import tensorflow as tf

    def record(ids):
        seen.extend(int(i) for i in np.asarray(ids))
        return np.int64(0)

    class Recording(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs[:, 1:])

        def train_step(self, data):
            ids = tf.cast(data[0][:, 0], tf.int64)
            tf.numpy_function(record, [ids], tf.int64, stateful=True)
            return super().train_step(data)

    return Recording()


def _fit(strategy, x, y=None, seed=None, **kwargs) -> dict:
    """Fit EPOCHS epochs; the ids this worker saw, per epoch, the final
    weights and the MultiWorkerFitWarnings."""
    import keras
    import tensorflow as tf

    if seed is not None:
        keras.utils.set_random_seed(seed)
    else:
        # As in a process nobody seeded (an earlier scenario's seed would
        # otherwise keep Python's `random` in step on both workers).
        tf.random.set_seed(None)
        random.seed()
    seen: list = []
    epochs: list = []
    initial: list = []

    class Cut(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            initial.extend(w.tolist() for w in self.model.get_weights())

        def on_epoch_end(self, epoch, logs=None):
            epochs.append(list(seen))
            seen.clear()

    with strategy.scope():
        model = _recording_model(seen)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, epochs=EPOCHS, verbose=0, callbacks=[Cut()], **kwargs)
    return {
        "epochs": epochs,
        "weights": [w.tolist() for w in model.get_weights()],
        "initial": initial,
        "warnings": [
            str(w.message)
            for w in caught
            if type(w.message).__name__ == "MultiWorkerFitWarning"
        ],
    }


def _reference(x, y) -> list:
    """One process, default strategy, the same global batches in order."""
    import keras

    keras.utils.set_random_seed(REFERENCE_SEED)
    model = _recording_model([])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return [w.tolist() for w in model.get_weights()]


def _py_dataset(x, y, shuffle_workers: int = 1):
    import keras

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=shuffle_workers)

        def __len__(self):
            return SAMPLES // BATCH

        def __getitem__(self, index):
            part = slice(index * BATCH, (index + 1) * BATCH)
            return x[part], y[part]

    return Batches()


def _aligned(array):
    """A copy of `array` whose data start on a 64-byte boundary (where
    TensorFlow wraps a NumPy array without copying it)."""
    import numpy as np

    buffer = np.empty(array.nbytes + 64, dtype=np.uint8)
    start = -buffer.ctypes.data % 64
    out = buffer[start : start + array.nbytes].view(array.dtype)
    out = out.reshape(array.shape)
    out[...] = array
    return out


def _python_batches_kept(strategy, kind: str, copy: bool = True) -> dict:
    """Fit on a generator or PyDataset that yields views of 64-byte-aligned
    arrays; the rows of the user's x and y that changed during the fit.
    `copy=False` turns keras_mgpu's copy of such batches off."""
    import numpy as np

    from keras_mgpu.distribute import _keras_trainer_patch as patch

    x, y = _data()
    x, y = _aligned(x), _aligned(y)
    x0, y0 = x.copy(), y.copy()

    def batches():
        for _ in range(EPOCHS):
            for i in range(0, SAMPLES, BATCH):
                yield x[i : i + BATCH], y[i : i + BATCH]

    patch.COPY_PYTHON_BATCHES = copy
    try:
        if kind == "generator":
            _fit(strategy, batches(), steps_per_epoch=SAMPLES // BATCH)
        else:
            _fit(strategy, _py_dataset(x, y), shuffle=False)
    finally:
        patch.COPY_PYTHON_BATCHES = True
    return {
        "x_rows": np.flatnonzero(np.any(x != x0, axis=1)).tolist(),
        "y_rows": np.flatnonzero(np.any(y != y0, axis=1)).tolist(),
    }


def data_order_scenarios(task_index: int, seeded_only: bool = False) -> dict:
    """Every scenario; `seeded_only`: the seeded ones, in the same order,
    for a second cluster that checks a seeded run repeats exactly.

    The last scenario repeats the first (seeded arrays) after every other
    one: a fit that follows others in the same process, PyDataset and
    generator fits included, must train exactly as the first did. (It did
    not, by up to 0.1, while TensorFlow overwrote the labels of PyDataset
    and generator batches in the user's `y`: see
    `_keras_trainer_patch._copy_python_batches`.)
    """
    import tensorflow as tf

    import keras_mgpu

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert keras_mgpu.distribute.enable_multi_worker_fit()
    x, y = _data()
    results: dict = {}
    arrays = dict(batch_size=BATCH, shuffle=True)

    # Seeded runs: compared with the same runs of a second cluster.
    results["arrays_seeded"] = _fit(strategy, x, y, seed=1234, **arrays)
    if seeded_only:
        results["py_dataset_seeded"] = _fit(
            strategy, _py_dataset(x, y), seed=77, shuffle=True
        )
        return results

    # The reference for unshuffled input: one process, the same batches.
    results["reference"] = _reference(x, y)
    base = tf.data.Dataset.from_tensor_slices((x, y))
    results["tf_data"] = _fit(strategy, base.batch(BATCH), seed=REFERENCE_SEED)

    # NumPy arrays, shuffle=True (Keras's default).
    results["arrays"] = _fit(strategy, x, y, **arrays)
    # A seed set on one worker only (here: a different one on each):
    # the chief's decides, so the order is still agreed on.
    results["arrays_seed_per_worker"] = _fit(
        strategy, x, y, seed=100 + task_index, **arrays
    )

    # tf.data shuffled with a seed, without one, and under a global seed
    # that differs per worker. (TensorFlow combines an op seed with the
    # global seed: the one set per worker above must go first.)
    tf.random.set_seed(None)
    results["tf_data_seeded_shuffle"] = _fit(
        strategy, base.shuffle(SAMPLES, seed=5).batch(BATCH)
    )
    tf.random.set_seed(None)
    results["tf_data_unseeded_shuffle"] = _fit(
        strategy, base.shuffle(SAMPLES).batch(BATCH)
    )
    tf.random.set_seed(200 + task_index)
    results["tf_data_seed_per_worker"] = _fit(
        strategy, base.shuffle(SAMPLES).batch(BATCH)
    )

    # A generator: Keras cannot shard it; one that yields the same batches
    # on every worker is covered, and the warning says so.
    def batches():
        for _ in range(EPOCHS):
            for i in range(0, SAMPLES, BATCH):
                yield x[i : i + BATCH], y[i : i + BATCH]

    results["generator"] = _fit(
        strategy, batches(), steps_per_epoch=SAMPLES // BATCH
    )

    # PyDataset: shuffle=True (batch order) seeded and not, unshuffled.
    results["py_dataset_seeded"] = _fit(
        strategy, _py_dataset(x, y), seed=77, shuffle=True
    )
    results["py_dataset"] = _fit(strategy, _py_dataset(x, y), shuffle=True)
    results["py_dataset_unshuffled"] = _fit(
        strategy, _py_dataset(x, y), shuffle=False
    )
    # Python batches that are views of the user's arrays leave them alone
    # (and, with keras_mgpu's copy off, what TensorFlow does to them).
    for kind in ("generator", "py_dataset"):
        results[f"{kind}_views_kept"] = _python_batches_kept(strategy, kind)
    results["py_dataset_views_uncopied"] = _python_batches_kept(
        strategy, "py_dataset", copy=False
    )
    results["arrays_seeded_again"] = _fit(strategy, x, y, seed=1234, **arrays)
    return results
