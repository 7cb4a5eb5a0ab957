"""Run a compression method's `all_reduce` on given per-replica shares.

Each replica of a `MirroredStrategy` (ReductionToOneDevice, as in the
conftest matrix) gets its own share of every gradient; the state variables
are created and written the way `GradientAccumulationOptimizer` does
(`ON_READ`, `SUM` for per-replica values, `ONLY_FIRST_REPLICA` otherwise).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def make_states(strategy, method, shapes: list) -> list:
    """The state variables `method` asks for, for variables of `shapes`."""
    states = []
    with strategy.scope():
        for index, shape in enumerate(shapes):
            reference = tf.Variable(tf.zeros(shape))
            variables = []
            for spec in method.state_specs(reference, index):
                initial = (
                    np.zeros(spec.shape, "float32")
                    if spec.initial_value is None
                    else spec.initial_value().astype("float32")
                )
                variables.append(
                    tf.Variable(
                        initial,
                        trainable=False,
                        synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=(
                            tf.VariableAggregation.SUM
                            if spec.per_replica
                            else tf.VariableAggregation.ONLY_FIRST_REPLICA
                        ),
                    )
                )
            states.append(tuple(variables))
    return states


def reduce_shares(strategy, method, shares: list, states=None) -> dict:
    """`shares[r][k]`: replica r's share of gradient k (NumPy arrays).

    Returns the means and finite flag of every replica, after writing the
    state values back as an applied update would.
    """
    count = len(shares[0])
    stacked = [
        tf.constant(np.stack([replica[k] for replica in shares]))
        for k in range(count)
    ]
    states = states if states is not None else [()] * count

    def replica_fn():
        context = tf.distribute.get_replica_context()
        index = context.replica_id_in_sync_group
        grads = [tf.gather(s, index) for s in stacked]
        reduction = method.all_reduce(context, grads, states)
        for variables, values in zip(states, reduction.state_values):
            for variable, value in zip(variables if values else (), values):
                variable.assign(value)
        return reduction.means, reduction.finite

    means, finite = strategy.run(replica_fn)
    local = strategy.experimental_local_results
    return {
        "means": [[t.numpy() for t in local(m)] for m in means],
        "finite": [bool(f.numpy()) for f in local(finite)],
    }


def local_values(strategy, variable) -> list:
    """Each replica's copy of an `ON_READ` variable."""
    return [v.numpy() for v in strategy.experimental_local_results(variable)]
