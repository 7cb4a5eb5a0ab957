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
