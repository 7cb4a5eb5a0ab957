"""On TensorFlow the JAX cluster helpers refuse by name; the variables still
parse (pure Python)."""

from __future__ import annotations

import numpy as np
import pytest

from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.distribute import (
    ClusterSpec,
    cluster_from_environment,
    shard_across_processes,
    start_cluster,
)


def test_start_cluster_refuses_naming_the_tensorflow_way():
    with pytest.raises(
        BackendNotSupportedError, match="MultiWorkerMirroredStrategy"
    ):
        start_cluster({})


def test_shard_across_processes_refuses_naming_enable_multi_worker_fit():
    with pytest.raises(
        BackendNotSupportedError, match="enable_multi_worker_fit"
    ):
        shard_across_processes(np.ones((4, 1)), batch_size=2)


def test_variables_parse_on_tensorflow_too():
    environ = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NODELIST": ""}
    environ["SLURM_JOB_NODELIST"] = "n[1-2]"
    assert cluster_from_environment(environ, coordinator_port=9) == (
        ClusterSpec("n1:9", 2, 1, "slurm")
    )


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
