"""Join this process to a JAX cluster: `jax.distributed` with bounded waits,
the gloo CPU collectives, and one random seed agreed by every process.

`keras.distribution.initialize()` does the first step without time-outs
(JAX's defaults: 300 s to meet, 100 s of missed heartbeats) and leaves CPU
processes without cross-process collectives (JAX's default CPU collectives
are none: a `DataParallel` over two processes' CPU devices fails at its
first all-reduce). Here both are explicit.
"""

from __future__ import annotations

from typing import Any


def is_initialized() -> bool:
    """Whether `jax.distributed` was initialized in this process."""
    import jax

    return bool(jax.distributed.is_initialized())


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    initialization_timeout: int,
    heartbeat_timeout: int,
    cpu_collectives: str | None,
) -> None:
    """Start `jax.distributed` (before any JAX computation) and agree on a
    Keras random seed, so every process creates the same initial weights."""
    import jax

    if cpu_collectives is not None:
        # Read when the CPU client is created: set before anything runs.
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
    )
    agree_on_seed()


def agree_on_seed() -> int:
    """The Keras global seed every process uses: the one set already if any
    (`keras.utils.set_random_seed` on every process), else one drawn on
    process 0 and broadcast (Keras's `initialize` does the same with a sum
    of per-process draws)."""
    import numpy as np

    seed = _keras_global_seed()
    if seed is not None:
        return seed
    from jax.experimental import multihost_utils

    from keras_mgpu.backend.seeds import set_random_seed

    draw = np.asarray(np.random.randint(0, 2**31 - 1), dtype=np.int32)
    seed = int(multihost_utils.broadcast_one_to_all(draw))
    # Keras's `set_random_seed` imports TensorFlow whenever it is installed
    # (seconds per process); this one seeds alike without it.
    set_random_seed(seed)
    return seed


def _keras_global_seed() -> int | None:
    try:  # Keras 3.15: not exported
        from keras.src.utils import rng_utils

        return rng_utils.get_random_seed()
    except (ImportError, AttributeError):
        return None


def process_local_devices() -> int:
    import jax

    return int(jax.local_device_count())


def all_devices() -> list[Any]:
    import jax

    return list(jax.devices())


def broadcast_int(value: int) -> int:
    """Process 0's `value`, on every process (a collective: every process
    must call it, in the same order)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(
        multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32))
    )
