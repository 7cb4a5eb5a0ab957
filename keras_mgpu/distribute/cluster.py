"""Start a multi-process JAX cluster from a launcher's variables and return
the distribution that spans it."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keras_mgpu.backend import require_backend

#: The port of the coordinator (process 0) when only a host is known
#: (Slurm): override with `coordinator_port=` or `KERAS_MGPU_COORDINATOR_PORT`.
DEFAULT_COORDINATOR_PORT = 29512


@dataclass(frozen=True)
class ClusterSpec:
    """Where process 0 listens, how many processes, which one this is, and
    which variables said so (`source`)."""

    coordinator_address: str
    num_processes: int
    process_id: int
    source: str


def cluster_from_environment(
    environ: Mapping[str, str] | None = None,
    coordinator_port: int | None = None,
) -> ClusterSpec | None:
    """Read the cluster from a launcher's variables; None when none is set.

    Looked for in this order (the first that is set wins):

    1. Keras's own: `KERAS_DISTRIBUTION_JOB_ADDRESSES` ("host:port" of
       process 0, or every process's, comma-separated),
       `KERAS_DISTRIBUTION_NUM_PROCESSES`, `KERAS_DISTRIBUTION_PROCESS_ID`.
    2. `TF_CONFIG` (`{"cluster": {"chief": [...], "worker": [...]},
       "task": {"type": ..., "index": ...}}`): the collective members are
       the chief then the workers; process 0 (the first) is the coordinator,
       at its address.
    3. Slurm (`srun`): `SLURM_NTASKS`, `SLURM_PROCID` and the first host of
       `SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`), at
       `coordinator_port`, else `KERAS_MGPU_COORDINATOR_PORT`, else
       `DEFAULT_COORDINATOR_PORT`.

    Pure parsing, on every backend. Bad values raise `ValueError` naming
    the variable and the value.

    Args:
        environ: the variables to read. Defaults to `os.environ`.
        coordinator_port: int, the coordinator's port where the variables
            give only a host (Slurm).

    Returns:
        A `ClusterSpec`, or None without any of these variables.

    Example:

    ```python
    spec = cluster_from_environment(
        {"SLURM_NTASKS": "2", "SLURM_PROCID": "1",
         "SLURM_JOB_NODELIST": "node[07-08]"})
    # ClusterSpec("node07:29512", 2, 1, "slurm")
    ```
    """
    env = os.environ if environ is None else environ
    if env.get("KERAS_DISTRIBUTION_JOB_ADDRESSES"):
        return _from_keras(env)
    if env.get("TF_CONFIG"):
        return _from_tf_config(env["TF_CONFIG"])
    if env.get("SLURM_NTASKS") or env.get("SLURM_PROCID"):
        return _from_slurm(env, coordinator_port)
    return None


def _int_var(env: Mapping[str, str], name: str, low: int) -> int:
    value = env.get(name)
    try:
        number = int(str(value).strip())
    except ValueError:
        number = None
    if number is None or number < low:
        raise ValueError(
            f"Environment variable `{name}` must be an integer >= {low}. "
            f"Received: {name}={value!r}"
        )
    return number


def _check_id(name: str, process_id: int, count: int, count_name: str):
    if process_id >= count:
        raise ValueError(
            f"Environment variable `{name}` must be below {count_name}="
            f"{count}. Received: {name}={process_id}"
        )


def _check_address(name: str, address: str) -> str:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"`{name}` must hold 'host:port' addresses. Received: "
            f"{name}={address!r}"
        )
    return address.strip()


def _from_keras(env: Mapping[str, str]) -> ClusterSpec:
    name = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
    addresses = [a for a in env[name].split(",") if a.strip()]
    addresses = [_check_address(name, a) for a in addresses]
    count = _int_var(env, "KERAS_DISTRIBUTION_NUM_PROCESSES", 1)
    if len(addresses) > 1 and len(addresses) != count:
        raise ValueError(
            f"`{name}` lists {len(addresses)} addresses but "
            f"KERAS_DISTRIBUTION_NUM_PROCESSES={count}: give one per "
            f"process, or only process 0's. Received: {name}={env[name]!r}"
        )
    process_id = _int_var(env, "KERAS_DISTRIBUTION_PROCESS_ID", 0)
    _check_id(
        "KERAS_DISTRIBUTION_PROCESS_ID",
        process_id,
        count,
        "KERAS_DISTRIBUTION_NUM_PROCESSES",
    )
    return ClusterSpec(addresses[0], count, process_id, "keras")


def _from_tf_config(text: str) -> ClusterSpec:
    from keras_mgpu.distribute.strategy import cluster_members

    try:
        config = json.loads(text)
        cluster = config["cluster"]
        task = config["task"]
        task_type, index = str(task["type"]), int(task.get("index", 0))
        members = cluster_members(cluster)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            "Environment variable `TF_CONFIG` must be JSON with 'cluster' "
            "({'chief': [...], 'worker': [...]}) and 'task' ({'type', "
            f"'index'}}) ({error}). Received: TF_CONFIG={text!r}"
        ) from None
    names = [(t, i) for t, i, _ in members]
    if (task_type, index) not in names:
        raise ValueError(
            "Environment variable `TF_CONFIG` names a task that is not a "
            "collective member (only 'chief' and 'worker' tasks join a JAX "
            f"cluster). Received: task={task!r}, members={names}"
        )
    address = _check_address("TF_CONFIG", members[0][2])
    return ClusterSpec(
        address, len(members), names.index((task_type, index)), "tf_config"
    )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-05,9],cpu1" -> "gpu03"."""
    match = re.match(r"\s*([^,\[\]]+)(?:\[([^\]]+)\])?", nodelist)
    if not match or not match.group(1).strip():
        raise ValueError(
            "Environment variable `SLURM_JOB_NODELIST` must be a Slurm node "
            f"list ('node[01-04],other'). Received: {nodelist!r}"
        )
    prefix, ranges = match.group(1).strip(), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first.isdigit():
        raise ValueError(
            "Environment variable `SLURM_JOB_NODELIST` must be a Slurm node "
            f"list ('node[01-04],other'). Received: {nodelist!r}"
        )
    return prefix + first


def _from_slurm(
    env: Mapping[str, str], coordinator_port: int | None
) -> ClusterSpec:
    count = _int_var(env, "SLURM_NTASKS", 1)
    process_id = _int_var(env, "SLURM_PROCID", 0)
    _check_id("SLURM_PROCID", process_id, count, "SLURM_NTASKS")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ValueError(
            "Environment variable `SLURM_JOB_NODELIST` (or "
            "SLURM_STEP_NODELIST) must name the job's nodes (run under "
            "srun/sbatch). Received: SLURM_JOB_NODELIST=None"
        )
    if coordinator_port is None:
        if env.get("KERAS_MGPU_COORDINATOR_PORT"):
            coordinator_port = _int_var(env, "KERAS_MGPU_COORDINATOR_PORT", 1)
        else:
            coordinator_port = DEFAULT_COORDINATOR_PORT
    host = first_slurm_host(nodelist)
    address = _check_address(
        "KERAS_MGPU_COORDINATOR_PORT", f"{host}:{coordinator_port}"
    )
    return ClusterSpec(address, count, process_id, "slurm")


def start_cluster(
    environ: Mapping[str, str] | None = None,
    *,
    coordinator_port: int | None = None,
    cpu_collectives: str | None = "gloo",
    initialization_timeout: int = 120,
    heartbeat_timeout: int = 60,
    distribution: str | None = "data_parallel",
    auto_shard_dataset: bool = True,
) -> Any:
    """Join this process to a multi-process JAX cluster described by the
    launcher's variables, and return a `keras.distribution.DataParallel`
    over every process's devices.

    Call it first in every process, before anything runs on JAX. The
    cluster comes from `cluster_from_environment` (Keras's
    `KERAS_DISTRIBUTION_*` variables, `TF_CONFIG`, or Slurm's). Unlike
    `keras.distribution.initialize()`, the waits are bounded
    (`initialization_timeout` for every process to arrive,
    `heartbeat_timeout` before a silent process is declared dead) and CPU
    processes get cross-process collectives (gloo). Without any of the
    variables it starts nothing: one process, its own devices. Calling it
    again after the cluster started returns a new distribution and starts
    nothing.

    JAX only: on TensorFlow it raises `BackendNotSupportedError` (use
    `tf.distribute.MultiWorkerMirroredStrategy`, which reads `TF_CONFIG`
    itself, and `keras_mgpu.distribute.enable_multi_worker_fit()`).

    Args:
        environ: the variables to read. Defaults to `os.environ`.
        coordinator_port: int, process 0's port where the variables give
            only its host (Slurm).
        cpu_collectives: str or None, JAX's CPU collectives across
            processes ("gloo", "mpi"; None leaves JAX's setting). Defaults
            to "gloo".
        initialization_timeout: int > 0, seconds for all processes to meet.
        heartbeat_timeout: int > 0, seconds without a heartbeat before JAX
            declares a process dead and stops the others.
        distribution: "data_parallel" (a `DataParallel` over
            `jax.devices()`, every process's) or None (return None: build
            your own, e.g. a `ModelParallel`).
        auto_shard_dataset: bool, passed to the `DataParallel`. Keras
            shards only `tf.data` itself; for NumPy arrays, `PyDataset`s and
            generators use `keras_mgpu.distribute.shard_across_processes`
            and set it False.

    Returns:
        The distribution, or None for `distribution=None`.

    Raises:
        ValueError: a bad argument, or a variable that does not parse
            (named in the message).

    Example:

    ```python
    # srun -n 2 python train.py   (or KERAS_DISTRIBUTION_* / TF_CONFIG)
    import keras_mgpu

    distribution = keras_mgpu.distribute.start_cluster()
    with distribution.scope():
        model = build_model()
        model.compile(...)
        # A tf.data dataset of global batches: Keras shards it across the
        # processes. NumPy arrays: see `shard_across_processes`.
        model.fit(dataset, epochs=2)
        model.evaluate(dataset)
    ```
    """
    require_backend(
        "keras_mgpu.distribute.start_cluster",
        ("jax",),
        instead=(
            "tf.distribute.MultiWorkerMirroredStrategy (it reads TF_CONFIG) "
            "with keras_mgpu.distribute.enable_multi_worker_fit()"
        ),
    )
    for name, value in (
        ("initialization_timeout", initialization_timeout),
        ("heartbeat_timeout", heartbeat_timeout),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"Argument `{name}` must be an integer >= 1 (seconds). "
                f"Received: {name}={value!r}"
            )
    if cpu_collectives not in (None, "gloo", "mpi"):
        raise ValueError(
            "Argument `cpu_collectives` must be 'gloo', 'mpi' or None. "
            f"Received: cpu_collectives={cpu_collectives!r}"
        )
    if distribution not in (None, "data_parallel"):
        raise ValueError(
            "Argument `distribution` must be 'data_parallel' or None. "
            f"Received: distribution={distribution!r}"
        )
    spec = cluster_from_environment(environ, coordinator_port)
    from keras_mgpu.backend.jax import cluster

    if spec is not None and not cluster.is_initialized():
        cluster.initialize(
            spec.coordinator_address,
            spec.num_processes,
            spec.process_id,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout=heartbeat_timeout,
            cpu_collectives=cpu_collectives,
        )
    if distribution is None:
        return None
    import keras

    return keras.distribution.DataParallel(
        devices=cluster.all_devices(), auto_shard_dataset=auto_shard_dataset
    )
