"""What `BackupAndRestore` needs from JAX across processes besides the
exact gather of small rows (the processes' agreement on a backup:
`processes.allgather_rows`): the check that the training state is
replicated.

Under `keras.distribution.DataParallel` every variable is replicated on
every device of every process: process 0 holds the whole state and writes
it; the others save privately (Keras's `save_weights` creates variables, a
collective every process must join) and every process reads the same file
at a restore. A variable split across processes (a `ModelParallel` layout
whose model axis spans several processes' devices) has parts no single
process holds: `save_weights` fails on it ("Fetching value for `jax.Array`
that spans non-addressable devices"), Keras does not gather. With the
model axis within each process, a multi-process `fit` with a backup did not
finish in our tests: sharded state is refused across processes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["sharded_variables"]


def sharded_variables(variables: Any) -> list[str]:
    """The paths of the variables that are not replicated on every device
    (sharded by a `ModelParallel` layout). Empty under `DataParallel`."""
    return [
        str(getattr(variable, "path", variable))
        for variable in variables
        if not _replicated(getattr(variable, "value", variable))
    ]


def _replicated(array: Any) -> bool:
    sharding = getattr(array, "sharding", None)
    return sharding is None or bool(sharding.is_fully_replicated)
