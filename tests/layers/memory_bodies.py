"""Allocator peaks of one training step, plain vs recomputed in place, run
in a process of its own (tests/_processes.py) with oneDNN on: TensorFlow
keeps CPU allocator statistics only then (keras-facts.md).

Works under both Keras flavours (the child's TF_USE_LEGACY_KERAS decides).
"""

from __future__ import annotations

BLOCKS, WIDTH, BATCH = 8, 128, 1024

# Measured (8 residual blocks, width 128, batch 1024): plain 30 / 22 MiB
# eager / tf.function, recomputed 15 / 9 MiB (0.5 / 0.4); before the eager
# forward stopped recording on the outer tape, 26 MiB eager (0.87).
MAX_RATIO = 0.65


def assert_recompute_saves_memory(peaks: dict) -> None:
    for mode, peak in peaks.items():
        assert peak["plain"] > 10, (mode, peaks)  # statistics are live
        ratio = peak["recompute"] / peak["plain"]
        assert ratio <= MAX_RATIO, (mode, round(ratio, 2), peaks)


def _model(recompute: bool):
    from keras_mgpu._flavour import keras
    from keras_mgpu.layers import apply_recompute

    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTH,))
    x = inputs
    for i in range(BLOCKS):
        block = keras.Sequential(
            [
                keras.layers.Dense(4 * WIDTH, activation="relu"),
                keras.layers.Dense(WIDTH),
            ],
            name=f"block_{i}",
        )
        x = keras.layers.Add()([x, block(x)])
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    if recompute:
        apply_recompute(
            model, lambda layer: layer.name.startswith("block_"), in_place=True
        )
    return model


def _peak_mib(run, repeats: int = 1) -> float:
    """Allocator peak of `run()` above what was resident before it; with
    `repeats`, the least of that many runs (which ops run side by side, and
    so which transients overlap, changes from run to run under load)."""
    import tensorflow as tf

    run()  # warm up (traces under tf.function, builds the optimizer)
    run()
    peaks = []
    for _ in range(repeats):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        run()
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        peaks.append((peak - before) / 2**20)
    return min(peaks)


def _case_peaks(model, x, y) -> dict:
    import numpy as np
    import tensorflow as tf

    from keras_mgpu._flavour import keras

    def tape_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
        return [
            g.numpy() for g in tape.gradient(loss, model.trainable_variables)
        ]

    @tf.function
    def traced_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    peaks = {
        "eager": _peak_mib(tape_step),
        "tf_function": _peak_mib(lambda: [g.numpy() for g in traced_step()]),
    }
    model.compile(
        optimizer=keras.optimizers.SGD(0.01), loss="mse", run_eagerly=True
    )
    peaks["fit_run_eagerly"] = _peak_mib(
        lambda: np.asarray(model.train_on_batch(x, y)).ravel()
    )
    return peaks


def step_peaks(task_index: int) -> dict:
    """{mode: {"plain": MiB, "recompute": MiB}} for one training step in
    an eager GradientTape step (a custom loop), the same step under
    tf.function, and `train_on_batch` with `run_eagerly=True`."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(BATCH, WIDTH)).astype("float32"))
    y = tf.constant(rng.normal(size=(BATCH, 1)).astype("float32"))
    results: dict = {"eager": {}, "tf_function": {}, "fit_run_eagerly": {}}
    for case in ("plain", "recompute"):
        peaks = _case_peaks(_model(case == "recompute"), x, y)
        for mode, peak in peaks.items():
            results[mode][case] = peak
    return results


# The deep MLP of the recompute benchmark (`bench_recompute.py --deep`),
# smaller: blocks of DEEP_DEPTH Dense DEEP_WIDTH ReLU layers. One layer's
# activation is 2 MiB (DEEP_BATCH * DEEP_WIDTH float32), a kernel 1/8 of
# that: weight-sized buffers, whose number at the peak varies with which
# ops run side by side, weigh little against what is counted.
DEEP_BLOCKS, DEEP_DEPTH, DEEP_WIDTH, DEEP_BATCH = 8, 4, 256, 2048


def _deep_model(case: str):
    # Imported here: the child's TF_USE_LEGACY_KERAS picks the flavour.
    from layers.graph_size import deep_mlp

    return deep_mlp(
        {"plain": "none", "recompute": "in_place"}.get(case, case),
        blocks=DEEP_BLOCKS,
        depth=DEEP_DEPTH,
        width=DEEP_WIDTH,
    )


# Activations each case keeps at its peak (plain: the input and every
# layer's output): per block, the input, the boundaries of the 7 blocks
# below the last and the last block's 4; min_memory on blocks, segments of
# 2, 2, 1, 1, 1, 1 blocks (at most 10 with the input); on the 32 layers,
# segments of 8, 7, 6, 5, 4, 2 (9). tests/layers/test_min_memory_segments.py
# derives the last two.
KEPT = {
    "plain": DEEP_BLOCKS * DEEP_DEPTH + 1,
    "recompute": DEEP_BLOCKS + DEEP_DEPTH,
    "min_memory": 10,
    "min_memory_layers": 9,
}


def deep_mlp_peaks(task_index: int) -> dict:
    """Allocator peaks (MiB) of one `train_on_batch` step of the deep MLP,
    plain and recomputed per block in place, and the size of one layer's
    activation (MiB)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(DEEP_BATCH, DEEP_WIDTH)).astype("float32")
    y = rng.normal(size=(DEEP_BATCH, 1)).astype("float32")
    from keras_mgpu._flavour import IS_TF_KERAS

    peaks = {
        "activation": DEEP_BATCH * DEEP_WIDTH * 4 / 2**20,
        "weight": DEEP_WIDTH * DEEP_WIDTH * 4 / 2**20,
        # tf_keras's SGD computes `m * momentum` for every variable (momentum
        # slots exist at momentum 0) as the step starts, since it does not
        # wait for a gradient, and holds it until that variable's update: one
        # kernel-sized buffer per Dense layer all step.
        "optimizer_buffers": DEEP_BLOCKS * DEEP_DEPTH if IS_TF_KERAS else 0,
    }
    cases = ["plain", "recompute"]
    if not IS_TF_KERAS:  # segments need a Keras 3 functional graph
        cases += ["min_memory", "min_memory_layers"]
    for case in cases:
        model = _deep_model(case)
        peaks[case] = _peak_mib(
            lambda m=model: np.asarray(m.train_on_batch(x, y)).ravel(),
            repeats=5,
        )
    return peaks


# Besides the activations it keeps, a step holds at its peak the buffers of
# one layer's backward (the incoming gradient and the input gradient), a
# buffer of the input batch's size allocated as the step starts (together
# 3 activations) and up to 4 weight gradients (the next layers' are
# computed while the updates run).
# Measured in activations (least of 5 steps, 3 runs): plain 33 + 1.9-2,
# per block 12 + 1.8-2.8, min_memory on blocks 10 + 2-2.9, on layers
# 9 + 2.8-2.9. Keeping block_0's activations (+3) goes over (seen: 32.25
# MiB against 31); equal segments on the layers (sqrt, 11 counted) measured
# 12.1-13 activations in all, under min_memory's bound, so the plan itself
# is checked by count (tests/layers/test_min_memory_segments.py).
BACKWARD_ACTIVATIONS, BACKWARD_WEIGHTS = 3, 4


def assert_recompute_keeps_only_its_floor(peaks: dict) -> None:
    """Plain training holds every layer's output when the backward pass
    starts (`blocks * depth + 1` activations with the input); a recomputed
    step holds what its plan keeps (`KEPT`) and one layer's backward
    buffers (tf_keras: and its optimizer's buffers), nothing more: keeping
    one block more (per block) fails it."""
    a, w = peaks["activation"], peaks["weight"]
    weights = BACKWARD_WEIGHTS + peaks["optimizer_buffers"]
    # Statistics are live; under tf_keras this fails when its SGD stops
    # holding a buffer per variable all step (docs/compatibility.md).
    held = KEPT["plain"] * a + peaks["optimizer_buffers"] * w
    assert peaks["plain"] >= held, ("plain holds less than counted", peaks)
    for case in KEPT:
        if case == "plain" or case not in peaks:
            continue
        bound = (KEPT[case] + BACKWARD_ACTIVATIONS) * a + weights * w
        assert peaks[case] <= bound, (case, bound, peaks)
