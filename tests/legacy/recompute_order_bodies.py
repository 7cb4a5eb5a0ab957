"""A tf.function training step's allocator peak, plain vs recomputed in
place, with TensorFlow's executor on one inter-op thread: another order of
the ready ops than the default pool's (the order a loaded machine may also
produce). Run in a process of its own (tests/_processes.py), oneDNN on."""

from __future__ import annotations


def one_thread_peaks(task_index: int) -> dict:
    """{"plain": MiB, "recompute": MiB} of the tf.function step of
    tests/layers/memory_bodies.py, inter-op parallelism 1."""
    import tensorflow as tf

    # Before anything starts TensorFlow's runtime.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import numpy as np
    from layers import memory_bodies as bodies

    rng = np.random.default_rng(0)
    x = tf.constant(
        rng.normal(size=(bodies.BATCH, bodies.WIDTH)).astype("float32")
    )
    peaks = {}
    for case in ("plain", "recompute"):
        model = bodies._model(case == "recompute")

        @tf.function
        def traced_step(model=model):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(x, training=True)))
            return tape.gradient(loss, model.trainable_variables)

        peaks[case] = bodies._peak_mib(
            lambda f=traced_step: [g.numpy() for g in f()], repeats=3
        )
    return peaks
