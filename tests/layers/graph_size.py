"""Ops of a train step as it runs, plain and recomputed: a deterministic
stand-in for the step time recompute costs (shared by the Keras 3 and
tf_keras tests).

Recomputing a block should cost one extra forward of the block: its
MatMuls once more (a second gradient or a second replay would add more),
the variable reads that feed them, and a handful of small ops per block
(the anchor that keeps Grappler from hoisting the recomputation into the
forward pass). The count is taken after Grappler, on the graph TensorFlow
runs, so ops Grappler prunes cost nothing and are not counted.
"""

from __future__ import annotations

import functools

import numpy as np

from keras_mgpu._flavour import keras
from keras_mgpu.layers import apply_recompute

BLOCKS, DEPTH, WIDTH, BATCH = 3, 2, 8, 4


def deep_mlp(
    case: str, blocks: int = BLOCKS, depth: int = DEPTH, width: int = WIDTH
):
    """`blocks` blocks of `depth` Dense-ReLU layers of `width` and a head,
    compiled (SGD, MSE); case "none" (plain), "in_place" (each block's call
    recomputed), "wrapper" (each block in a `RecomputeGrad`), "sqrt" or
    "min_memory" (segments of blocks), or "min_memory_layers" (the same
    Dense layers not in blocks, in min_memory segments of layers). Also the
    deep MLP of tests/layers/memory_bodies.py."""
    keras.utils.set_random_seed(0)
    dense = [
        [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        for _ in range(blocks)
    ]
    if case == "min_memory_layers":
        flat = [layer for block in dense for layer in block]
        model = keras.Sequential(
            [keras.Input((width,)), *flat, keras.layers.Dense(1)]
        )
        apply_recompute(model, flat, policy="min_memory")
        model.compile(optimizer="sgd", loss="mse")
        return model
    layers = [
        keras.Sequential(block, name=f"block_{i}")
        for i, block in enumerate(dense)
    ]
    model = keras.Sequential(
        [keras.Input((width,)), *layers, keras.layers.Dense(1)]
    )

    def is_block(layer):
        return layer.name.startswith("block_")

    if case == "in_place":
        apply_recompute(model, layers=is_block, in_place=True)
    elif case == "wrapper":
        model = apply_recompute(model, layers=is_block, in_place=False)
    elif case in ("sqrt", "min_memory"):
        apply_recompute(model, layers=is_block, policy=case, in_place=True)
    model.compile(optimizer="sgd", loss="mse")
    return model


def optimized_train_graph(model) -> list:
    """The node ops of `model`'s train function after Grappler, from the
    run metadata of its first (tracing) step. TensorFlow 2.21's
    `context.enable_run_metadata` (private; no public equivalent)."""
    from tensorflow.python.eager import context

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, WIDTH)).astype("float32")
    y = rng.normal(size=(BATCH, 1)).astype("float32")
    context.enable_run_metadata()
    try:
        model.train_on_batch(x, y)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    main = max(
        metadata.function_graphs,
        key=lambda g: len(g.post_optimization_graph.node),
    )
    return [node.op for node in main.post_optimization_graph.node]


def count_matmuls(ops: list) -> int:
    # MatMul, _FusedMatMul (MatMul+BiasAdd+ReLU), oneDNN's _MklFusedMatMul.
    return sum("MatMul" in op for op in ops)


# Per recomputed block beyond the block's forward: the anchor (about 8
# scalar ops and one add), one read per variable that TensorFlow's
# `tf.custom_gradient` leaves in the graph (stateful, so Grappler keeps
# it), and a little slack.
PER_BLOCK_SLACK = 12


def forward_ops_per_block() -> int:
    """One Dense-ReLU runs as a fused MatMul and two variable reads."""
    return 3 * DEPTH


def extra_over_plain(index: int, cases: tuple) -> dict:
    """Child-process body (`_processes.run_in_process`): for each case, the
    MatMuls and ops its train step runs beyond the plain one's.

    Counted in a fresh process: run metadata covers every function that
    runs while it is on, and in a long-lived test process a function of an
    earlier test still running (a prefetch, a sampler) can be the largest
    graph (CI, 2026-11-25: 34 MatMuls fewer than plain)."""
    plain = optimized_train_graph(deep_mlp("none"))
    counts = {}
    for case in cases:
        recomputed = optimized_train_graph(deep_mlp(case))
        counts[case] = (
            count_matmuls(recomputed) - count_matmuls(plain),
            len(recomputed) - len(plain),
        )
    return counts


@functools.cache
def _counts(cases: tuple) -> dict:
    # One fresh process per test module, shared by its cases.
    from _processes import run_in_process

    return run_in_process(
        "layers.graph_size:extra_over_plain", timeout=300, args=(cases,)
    )


def assert_one_extra_forward(case: str, cases: tuple) -> None:
    """`case` (one of `cases`, all counted in one fresh process) runs its
    recomputed blocks' forward exactly once more, and few other ops."""
    extra_matmuls, extra_ops = _counts(tuple(cases))[case]
    # Exactly the recomputed blocks' MatMuls once more: no second forward,
    # no gradient taken twice.
    assert extra_matmuls == BLOCKS * DEPTH, (extra_matmuls, case)
    variables_per_block = 2 * DEPTH
    bound = BLOCKS * (
        forward_ops_per_block() + variables_per_block + PER_BLOCK_SLACK
    )
    assert 0 < extra_ops <= bound, (extra_ops, bound, case)
