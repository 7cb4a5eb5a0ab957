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


def _peak_mib(run) -> float:
    """Allocator peak of `run()` above what was resident before it."""
    import tensorflow as tf

    run()  # warm up (traces under tf.function, builds the optimizer)
    run()
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    run()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return (peak - before) / 2**20


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
# smaller: blocks of DEEP_DEPTH Dense DEEP_WIDTH ReLU layers, so that one
# layer's activation is exactly 1 MiB (DEEP_BATCH * DEEP_WIDTH float32).
DEEP_BLOCKS, DEEP_DEPTH, DEEP_WIDTH, DEEP_BATCH = 8, 4, 512, 512


def _deep_model(recompute: bool):
    # Imported here: the child's TF_USE_LEGACY_KERAS picks the flavour.
    from layers.graph_size import deep_mlp

    return deep_mlp(
        "in_place" if recompute else "none",
        blocks=DEEP_BLOCKS,
        depth=DEEP_DEPTH,
        width=DEEP_WIDTH,
    )


def deep_mlp_peaks(task_index: int) -> dict:
    """Allocator peaks (MiB) of one `train_on_batch` step of the deep MLP,
    plain and recomputed per block in place, and the size of one layer's
    activation (MiB)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(DEEP_BATCH, DEEP_WIDTH)).astype("float32")
    y = rng.normal(size=(DEEP_BATCH, 1)).astype("float32")
    peaks = {"activation": DEEP_BATCH * DEEP_WIDTH * 4 / 2**20}
    for case in ("plain", "recompute"):
        model = _deep_model(case == "recompute")
        peaks[case] = _peak_mib(
            lambda m=model: np.asarray(m.train_on_batch(x, y)).ravel()
        )
    return peaks


def assert_recompute_keeps_only_its_floor(peaks: dict) -> None:
    """Plain training holds every layer's output when the backward pass
    starts (`blocks * depth + 1` activations with the input); per-block
    recompute holds the input and the block boundaries below the block being
    recomputed, and that block's `depth` activations: `blocks + depth`.
    Everything else at the peak (the incoming gradient, a weight gradient,
    an input gradient, SGD's copy of a variable still being read) the two
    hold alike or the recomputed step holds fewer. So the recomputed peak
    is at most the plain peak less the activations it does not keep, within
    one activation."""
    a = peaks["activation"]
    kept_plain = DEEP_BLOCKS * DEEP_DEPTH + 1
    kept_recompute = DEEP_BLOCKS + DEEP_DEPTH
    assert peaks["plain"] >= kept_plain * a, peaks  # statistics are live
    bound = peaks["plain"] - (kept_plain - kept_recompute) * a
    assert peaks["recompute"] <= bound + a, (bound, peaks)
