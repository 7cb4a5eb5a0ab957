"""Entry point of the processes `keras_mgpu.testing.run_workers` starts."""

import importlib
import json
import os
import pickle
import sys


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the process that started it dies (Linux
    `prctl(PR_SET_PDEATHSIG)`; elsewhere the caller's reaper process alone
    does it). Set here rather than in a `preexec_fn`: forking a process
    that runs JAX's threads to run Python code before `exec` is unsafe."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl
        os._exit(1)


def main() -> None:
    spec = json.loads(sys.argv[1])
    if "parent" in spec:
        die_with_parent(spec["parent"])
    if spec["cpu_devices"] > 1 and spec.get("backend") != "jax":
        from keras_mgpu.testing.devices import configure_cpu_devices

        configure_cpu_devices(spec["cpu_devices"])
    if spec.get("backend") == "jax":
        # XLA_FLAGS (devices) came with the environment. Join the cluster
        # before anything starts JAX's backend, with waits
        # bounded by the caller's timeout.
        from keras_mgpu.distribute.cluster import start_cluster

        seconds = max(int(spec["timeout"]), 1)
        start_cluster(
            initialization_timeout=seconds,
            heartbeat_timeout=min(seconds, 60),
            distribution=None,
        )
    module_name, qualname = spec["target"].split(":")
    function = importlib.import_module(module_name)
    for part in qualname.split("."):
        function = getattr(function, part)
    with open(os.path.join(spec["workdir"], "args.pkl"), "rb") as f:
        args = pickle.load(f)
    result = function(*args)
    path = os.path.join(spec["workdir"], f"result_{spec['index']}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
