"""`cluster_from_environment`, `start_cluster` and `shard_across_processes`
in one process. JAX: the launchers' variables, bad input named, one process
fed whole. TensorFlow: the JAX cluster helpers refuse by name, the
variables still parse (pure Python: the tables run in the JAX job only, each
TensorFlow test costing its session clean-up), and the tf.data path of
`shard_across_processes` cuts each process's part of a batch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.distribute import (
    ClusterSpec,
    cluster_from_environment,
    shard_across_processes,
    start_cluster,
)
from keras_mgpu.distribute.cluster import (
    DEFAULT_COORDINATOR_PORT,
    first_slurm_host,
)

pytestmark = pytest.mark.backends("tensorflow", "jax")
jax_only = pytest.mark.backends("jax")
tensorflow_only = pytest.mark.backends("tensorflow")


def _tf_config(cluster, task_type, index):
    return {
        "TF_CONFIG": json.dumps(
            {"cluster": cluster, "task": {"type": task_type, "index": index}}
        )
    }


@jax_only
@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, None),
        (
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "4",
                "KERAS_DISTRIBUTION_PROCESS_ID": "3",
            },
            ClusterSpec("10.0.0.1:1234", 4, 3, "keras"),
        ),
        (
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "a:1,b:2",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                "KERAS_DISTRIBUTION_PROCESS_ID": "1",
                "TF_CONFIG": "ignored: Keras's variables come first",
            },
            ClusterSpec("a:1", 2, 1, "keras"),
        ),
        (
            _tf_config({"worker": ["h0:5000", "h1:5001"]}, "worker", 1),
            ClusterSpec("h0:5000", 2, 1, "tf_config"),
        ),
        (  # the chief is process 0 and the coordinator
            _tf_config(
                {"chief": ["c:7000"], "worker": ["w0:1", "w1:2"]}, "worker", 0
            ),
            ClusterSpec("c:7000", 3, 1, "tf_config"),
        ),
        (
            {
                "SLURM_NTASKS": "8",
                "SLURM_PROCID": "5",
                "SLURM_JOB_NODELIST": "gpu[07-10,12],cpu1",
            },
            ClusterSpec(f"gpu07:{DEFAULT_COORDINATOR_PORT}", 8, 5, "slurm"),
        ),
        (
            {
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": "0",
                "SLURM_JOB_NODELIST": "all",
                "SLURM_STEP_NODELIST": "node3",
                "KERAS_MGPU_COORDINATOR_PORT": "4444",
            },
            ClusterSpec("node3:4444", 2, 0, "slurm"),
        ),
    ],
)
def test_the_launchers_variables(environ, expected):
    assert cluster_from_environment(environ) == expected


@jax_only
@pytest.mark.parametrize(
    "environ, match",
    [
        (
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                "KERAS_DISTRIBUTION_PROCESS_ID": "0",
            },
            "KERAS_DISTRIBUTION_JOB_ADDRESSES.*'host:port'.*'10.0.0.1'",
        ),
        (
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "a:1",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "two",
                "KERAS_DISTRIBUTION_PROCESS_ID": "0",
            },
            "KERAS_DISTRIBUTION_NUM_PROCESSES.*>= 1.*'two'",
        ),
        (
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "a:1",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
            },
            "KERAS_DISTRIBUTION_PROCESS_ID.*None",
        ),
        (
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "a:1",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                "KERAS_DISTRIBUTION_PROCESS_ID": "2",
            },
            "KERAS_DISTRIBUTION_PROCESS_ID.*below "
            "KERAS_DISTRIBUTION_NUM_PROCESSES=2.*=2",
        ),
        (
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "a:1,b:2,c:3",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                "KERAS_DISTRIBUTION_PROCESS_ID": "0",
            },
            "lists 3 addresses but KERAS_DISTRIBUTION_NUM_PROCESSES=2",
        ),
        ({"TF_CONFIG": "{not json"}, "TF_CONFIG.*JSON"),
        (
            _tf_config(
                {"worker": ["a:1"], "evaluator": ["e:2"]}, "evaluator", 0
            ),
            "TF_CONFIG.*not a collective member.*evaluator",
        ),
        (
            _tf_config({"worker": ["a:1"]}, "worker", 3),
            "TF_CONFIG.*not a collective member",
        ),
        (
            {
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": "2",
                "SLURM_JOB_NODELIST": "n1",
            },
            "SLURM_PROCID.*below SLURM_NTASKS=2",
        ),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
            "SLURM_JOB_NODELIST",
        ),
        (
            {
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": "0",
                "SLURM_JOB_NODELIST": "n[a-b]",
            },
            "SLURM_JOB_NODELIST.*node list",
        ),
        (
            {
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": "0",
                "SLURM_JOB_NODELIST": "n1",
                "KERAS_MGPU_COORDINATOR_PORT": "0",
            },
            "KERAS_MGPU_COORDINATOR_PORT.*>= 1",
        ),
    ],
)
def test_bad_variables_are_named(environ, match):
    with pytest.raises(ValueError, match=match):
        cluster_from_environment(environ)


@jax_only
@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("n1", "n1"),
        ("gpu[003-005]", "gpu003"),
        ("a[9,2],b", "a9"),
        ("x,y", "x"),
    ],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


@jax_only
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"initialization_timeout": 0}, "initialization_timeout.*>= 1"),
        ({"heartbeat_timeout": 1.5}, "heartbeat_timeout.*>= 1"),
        ({"cpu_collectives": "nccl"}, "cpu_collectives.*'gloo'.*'nccl'"),
        ({"distribution": "model_parallel"}, "distribution.*'data_parallel'"),
    ],
)
def test_start_cluster_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        start_cluster({}, **kwargs)


@jax_only
def test_start_cluster_without_variables_is_one_process():
    import jax

    distribution = start_cluster({})
    assert list(distribution.device_mesh.devices.flat) == jax.devices()
    assert start_cluster({}, distribution=None) is None
    assert jax.process_count() == 1


@jax_only
def test_one_process_gets_whole_batches_in_the_agreed_order():
    x = np.arange(16, dtype="float32")[:, None]
    data = shard_across_processes(x, x, batch_size=4, seed=1)
    first = [data[i][0][:, 0].tolist() for i in range(len(data))]
    order = np.random.default_rng([1, 0]).permutation(16)
    assert first == [order[i : i + 4].tolist() for i in range(0, 16, 4)]
    # the index asked for is ignored (fit(shuffle=True) reorders indices)
    assert data[3][0][:, 0].tolist() != first[3] or len(data) == 1


def _two_input_model_with_add_loss():
    import keras

    class SquaredOutputLoss(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.mean(x**2))
            return x

    keras.utils.set_random_seed(0)
    x1, x2 = keras.Input((3,)), keras.Input((2,))
    joined = keras.layers.Concatenate()([x1, x2])
    outputs = SquaredOutputLoss()(keras.layers.Dense(1)(joined))
    model = keras.Model([x1, x2], outputs)
    model.compile(keras.optimizers.SGD(0.1))
    return model


@jax_only
@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_of_inputs_without_targets_is_the_inputs(container):
    """`shard_across_processes([x1, x2])` is `fit(x=[x1, x2])` (Keras packs
    a list `x` alone as the inputs): it was served as `(x1, x2)`, which
    Keras reads as `(x, y)`, and a model trained by `add_loss` failed."""
    rng = np.random.default_rng(0)
    x = container(
        (rng.normal(size=(8, 3)).astype("float32"),)
        + (rng.normal(size=(8, 2)).astype("float32"),)
    )
    plain = _two_input_model_with_add_loss()
    plain.fit(x=x, batch_size=4, epochs=2, shuffle=False, verbose=0)
    ours = _two_input_model_with_add_loss()
    data = shard_across_processes(x, batch_size=4, shuffle=False)
    ours.fit(data, epochs=2, verbose=0)
    for a, b in zip(plain.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert not np.allclose(plain.get_weights()[0], 0.0)


class _Batches:
    """A PyDataset of 4 batches, batch i all i, that records its calls."""

    def __new__(cls, calls):
        import keras

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return 4

            def __getitem__(self, index):
                calls.append(index)
                x = np.full((4, 1), index, "float32")
                return x, x

            def on_epoch_end(self):
                calls.append("end")

        return Batches()


def _fit_three_epochs(data, steps_per_epoch, shuffle):
    import warnings

    import keras

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's "ran out of data"
        model.fit(
            data,
            epochs=3,
            steps_per_epoch=steps_per_epoch,
            shuffle=shuffle,
            verbose=0,
        )


@jax_only
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("steps_per_epoch", [None, 3])
def test_a_py_dataset_is_served_as_keras_serves_it(steps_per_epoch, shuffle):
    """The wrapped PyDataset's batches are read in the order Keras reads a
    plain one without shuffling, epoch after epoch; with `steps_per_epoch`
    shorter than the data, an epoch goes on where the last stopped (it
    restarted at batch 0 before)."""
    plain, wrapped = [], []
    _fit_three_epochs(_Batches(plain), steps_per_epoch, False)
    _fit_three_epochs(
        shard_across_processes(_Batches(wrapped)), steps_per_epoch, shuffle
    )
    assert wrapped == plain
    if steps_per_epoch:
        assert [c for c in plain if c != "end"][:5] == [0, 0, 1, 2, 3]


@jax_only
@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: shard_across_processes(np.ones((4, 1))),
            ValueError,
            "batch_size.*>= 1.*None",
        ),
        (
            lambda: shard_across_processes(
                np.ones((4, 1)), batch_size=4, shuffle=1
            ),
            TypeError,
            "shuffle",
        ),
        (
            lambda: shard_across_processes(iter([]), batch_size=4),
            ValueError,
            "batch_size.*NumPy arrays only",
        ),
        (lambda: shard_across_processes(5), TypeError, "x.*int"),
        (
            lambda: shard_across_processes(
                (np.ones((4, 1)), np.ones((5, 1))), batch_size=2
            ),
            ValueError,
            "same number of rows.*4, 5",
        ),
    ],
)
def test_bad_data_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------
# TensorFlow: the JAX cluster helpers refuse; the tf.data path
# ----------------------------------------------------------------------
@tensorflow_only
def test_start_cluster_refuses_naming_the_tensorflow_way():
    with pytest.raises(
        BackendNotSupportedError, match="MultiWorkerMirroredStrategy"
    ):
        start_cluster({})


@tensorflow_only
def test_shard_across_processes_refuses_naming_enable_multi_worker_fit():
    with pytest.raises(
        BackendNotSupportedError, match="enable_multi_worker_fit"
    ):
        shard_across_processes(np.ones((4, 1)), batch_size=2)


@tensorflow_only
def test_variables_parse_on_tensorflow_too():
    environ = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NODELIST": ""}
    environ["SLURM_JOB_NODELIST"] = "n[1-2]"
    assert cluster_from_environment(environ, coordinator_port=9) == (
        ClusterSpec("n1:9", 2, 1, "slurm")
    )


@tensorflow_only
@pytest.mark.parametrize("index", [0, 1])
def test_tf_data_batches_are_cut_per_process(index):
    """The tf.data path of shard_across_processes (the JAX cluster test
    does not import TensorFlow): process `index` of 2 keeps its half of
    every global batch; a batch that does not split is an error."""
    from types import SimpleNamespace

    import tensorflow as tf

    from keras_mgpu.distribute.process_data import _tf_dataset_slices

    layout = SimpleNamespace(num_processes=2, index=index, parallel=4, unit=4)
    ids = np.arange(16, dtype="float32")
    data = tf.data.Dataset.from_tensor_slices((ids, ids)).batch(8)
    got = [x.numpy().tolist() for x, _ in _tf_dataset_slices(data, layout)]
    assert got == [
        ids[start + 4 * index : start + 4 * index + 4].tolist()
        for start in (0, 8)
    ]
    uneven = tf.data.Dataset.from_tensor_slices(ids[:6]).batch(6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="multiple of 4"):
        list(_tf_dataset_slices(uneven, layout))
