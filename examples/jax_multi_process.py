"""Multi-process training on JAX: one program over every process's devices,
started from Slurm's, Keras's or TF_CONFIG's variables.

Every process runs this same script. `keras_mgpu.distribute.start_cluster()`
reads the launcher's variables (`srun`'s SLURM_*, Keras's
KERAS_DISTRIBUTION_*, or a TF_CONFIG), joins `jax.distributed` with bounded
waits (gloo collectives on CPU) and returns a `DataParallel` over all
processes' devices. Every process holds the same full arrays;
`shard_across_processes` gives each its slice of every global batch, so the
run trains on exactly the batches one process would: each sample once per
epoch, a new agreed order each epoch.

Run:
    python examples/jax_multi_process.py           # launches 2 local processes
    python examples/jax_multi_process.py --quick   # seconds
    python examples/jax_multi_process.py --quick --local-launcher slurm
                                  # the same, through Slurm's variables
    srun -n 4 python examples/jax_multi_process.py # Slurm (one per task)
"""

import argparse
import os
import socket
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

LAUNCHER_VARIABLES = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "TF_CONFIG",
    "SLURM_NTASKS",
)


def launcher_variables(launcher, port, processes, rank):
    """The variables `launcher` gives process `rank` of a cluster on
    127.0.0.1 whose coordinator listens at `port`: Keras's own, or those
    `srun -n PROCESSES` sets on one node (to try the Slurm path without
    Slurm)."""
    if launcher == "slurm":
        return {
            "SLURM_NTASKS": str(processes),
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "127.0.0.1",
            "KERAS_MGPU_COORDINATOR_PORT": str(port),
        }
    return {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": str(processes),
        "KERAS_DISTRIBUTION_PROCESS_ID": str(rank),
    }


def launch_local(args, launcher="keras", processes=2, devices=2):
    """Start `processes` copies of this script on 127.0.0.1 with the
    `launcher`'s variables, each with `devices` CPU devices; wait for all
    of them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = []
    for rank in range(processes):
        env = dict(
            os.environ,
            KERAS_BACKEND="jax",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
            **launcher_variables(launcher, port, processes, rank),
        )
        children.append(
            subprocess.Popen([sys.executable, __file__, *args], env=env)
        )
    try:
        codes = [child.wait(timeout=600) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return max(codes)


def train(quick):
    import keras
    import numpy as np

    import keras_mgpu
    from keras_mgpu.distribute import shard_across_processes, worker_info

    distribution = keras_mgpu.distribute.start_cluster(
        auto_shard_dataset=False, initialization_timeout=120
    )
    info = worker_info()
    joined = keras_mgpu.distribute.cluster_from_environment().source
    keras.utils.set_random_seed(0)  # the same initial weights everywhere
    samples = 256 if quick else 4096
    rng = np.random.default_rng(0)  # every process: the same full arrays
    x = rng.normal(size=(samples, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1))).astype("float32")
    with distribution.scope():
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=keras_mgpu.optimizers.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.05), accumulation_steps=2
            ),
            loss="mse",
        )
        data = shard_across_processes(x, y, batch_size=32, seed=0)
        history = model.fit(
            data,
            epochs=2 if quick else 5,
            callbacks=[keras_mgpu.callbacks.LearningRateWarmup(warmup_steps=4)],
            verbose=0,
        )
    checksum = sum(float(np.abs(w).sum()) for w in model.get_weights())
    # One write per line: the processes share the launcher's stdout, and
    # print() unbuffered writes the text and its newline separately, so two
    # processes' lines could run together.
    sys.stdout.write(
        f"{info['task_name']} (through {joined}'s variables): "
        f"{info['num_workers']} processes, "
        f"{len(distribution.device_mesh.devices.flat)} devices, "
        f"loss {history.history['loss'][-1]:.4f}, "
        f"weights checksum {checksum:.6f}\n"
    )
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--local-launcher",
        choices=("keras", "slurm"),
        default="keras",
        help="outside a cluster: start the 2 local processes with Keras's "
        "variables or with those srun sets",
    )
    args = parser.parse_args()
    if not any(os.environ.get(v) for v in LAUNCHER_VARIABLES):
        sys.exit(launch_local(sys.argv[1:], args.local_launcher))
    train(args.quick)


if __name__ == "__main__":
    main()
