"""Worker body for tests/compression/test_multi_worker_compression.py.

Each of 2 workers (one replica each) trains the demo CNN with Keras 3
`model.fit` (after `enable_multi_worker_fit()`) once per compression
method and returns, per method, the bytes it handed to the collectives per
update (CrossDeviceByteCounter) and the weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GLOBAL_BATCH = 16  # 8 per worker
UPDATES = 2
METHODS = ("float32", "float16", "bfloat16", "power_sgd")


def _method(name: str):
    from keras_mgpu.compression import PowerSGD

    return {
        "float32": None,
        "float16": "float16",
        "bfloat16": "bfloat16",
        "power_sgd": PowerSGD(rank=2, start_after_updates=0),
    }[name]


def compression_scenarios(task_index: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_mgpu
    from keras_mgpu.compression import CrossDeviceByteCounter
    from keras_mgpu.demo import build_model

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras_mgpu.distribute.enable_multi_worker_fit()
    counter = CrossDeviceByteCounter(strategy)
    rng = np.random.default_rng(0)
    samples = GLOBAL_BATCH * (1 + UPDATES)
    x = rng.uniform(size=(samples, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    results: dict = {"replicas": strategy.num_replicas_in_sync}
    for name in METHODS:
        with strategy.scope():
            keras.utils.set_random_seed(5)
            model = build_model(recompute=False)
            model.compile(
                optimizer=keras_mgpu.GradientAccumulationOptimizer(
                    keras.optimizers.SGD(0.05), 1, compression=_method(name)
                ),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
            )
        fit = dict(batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        # The first fit traces and learns shapes (one probe reduction).
        model.fit(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], **fit)
        counter.reset()
        model.fit(x[GLOBAL_BATCH:], y[GLOBAL_BATCH:], **fit)
        results[name] = {
            "records": [
                dict(r, shape=list(r["shape"])) for r in counter.records()
            ],
            "weights": [w.tolist() for w in model.get_weights()],
        }
    counter.remove()
    return results
