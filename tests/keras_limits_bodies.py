"""Process bodies for tests/test_keras_limits.py (plain Keras, no keras_mgpu
component): each returns the error Keras raised, or None if it trained."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _tiny_fit(strategy, **fit_kw):
    import numpy as np

    from keras_mgpu._flavour import keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((16, 3), "float32")
    model.fit(x, np.ones((16, 1), "float32"), batch_size=4, verbose=0, **fit_kw)


def multi_worker_fit(task_index: int) -> dict:
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    try:
        _tiny_fit(strategy)
    except Exception as exc:  # the limit under test
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"error": None}


def parameter_server_fit(task_index: int) -> dict:
    """An in-process cluster (2 workers, 1 parameter server) on 127.0.0.1."""
    import tensorflow as tf
    from _processes import free_ports

    ports = free_ports(3)
    cluster = tf.train.ClusterSpec(
        {
            "worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
            "ps": [f"127.0.0.1:{ports[2]}"],
        }
    )
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = 3
    for index in range(2):
        tf.distribute.Server(
            cluster,
            job_name="worker",
            task_index=index,
            config=config,
            protocol="grpc",
            start=True,
        )
    tf.distribute.Server(
        cluster, job_name="ps", task_index=0, protocol="grpc", start=True
    )
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, rpc_layer="grpc"
    )
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    try:
        _tiny_fit(strategy, steps_per_epoch=2)
    except Exception as exc:  # the limit under test
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return {"error": None}


def mirrored_steps_per_execution(task_index: int) -> dict:
    """steps_per_execution=4 under MirroredStrategy with its default
    CollectiveAllReduce: plain Keras, then with our wrapper.

    A process of its own: a CollectiveAllReduce group cannot share a process
    with the test fixture's other mirrored strategies.
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    import numpy as np

    from keras_mgpu import GradientAccumulationOptimizer
    from keras_mgpu._flavour import keras

    results = {}
    for label in ("plain", "wrapper"):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD()
            if label == "wrapper":
                optimizer = GradientAccumulationOptimizer(optimizer, 2)
            model.compile(
                optimizer=optimizer, loss="mse", steps_per_execution=4
            )
        x = np.ones((16, 3), "float32")
        try:
            model.fit(x, np.ones((16, 1)), batch_size=4, verbose=0)
            results[label] = None
        except Exception as exc:  # the limit under test
            results[label] = f"{type(exc).__name__}: {exc}"[:3000]
    return results
