"""Samples/s of plain Keras `fit`, of `fit` with `ThroughputMonitor`, and
(on JAX) of a hand-written `jax.jit` loop of the same model: what the
monitor costs, what it reports, and how far Keras is from the loop.

One process, one compiled model per case; the cases run interleaved
repeat by repeat (the order rotates) so machine noise hits all alike. The
rate of a `fit` case is the wall clock of its last epoch (from epoch begin
to epoch end, where Keras has synced the logs: compile left out); the
monitor's own `perf/samples_per_sec` is printed beside it. The jit loop
runs the same number of steps on the same batches, SGD, timed after a
warm-up step and a `block_until_ready`. Prints one JSON line per case
(median over repeats) and one with the ratios.

    KERAS_BACKEND=jax python benchmarks/bench_throughput.py --quick
    KERAS_BACKEND=tensorflow python benchmarks/bench_throughput.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")


def _model(keras, features: int, width: int, classes: int):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(classes),
        ]
    )
    model.compile(
        keras.optimizers.SGD(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 60, 3

    import keras
    import numpy as np

    from keras_mgpu.callbacks import ThroughputMonitor

    backend = keras.backend.backend()
    features, classes = 64, 10
    samples = args.steps * args.batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.integers(0, classes, size=(samples,)).astype("int32")

    class EpochClock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

    models = {
        "plain": _model(keras, features, args.width, classes),
        "monitor": _model(keras, features, args.width, classes),
    }

    def run_fit(case: str) -> dict:
        clock = EpochClock()
        callbacks = [clock]
        monitor = None
        if case == "monitor":
            monitor = ThroughputMonitor(window_size=args.steps // 2)
            callbacks.insert(0, monitor)
        models[case].fit(
            x,
            y,
            batch_size=args.batch,
            epochs=2,
            verbose=0,
            shuffle=False,
            callbacks=callbacks,
        )
        result = {"samples_per_sec": samples / clock.seconds}
        if monitor is not None:
            result["reported_samples_per_sec"] = monitor.last[
                "perf/samples_per_sec"
            ]
        return result

    runners = {"plain": run_fit, "monitor": run_fit}
    if backend == "jax":
        runners["jit_loop"] = _jit_loop(keras, args, x, y, features, classes)

    results: dict[str, list[dict]] = {case: [] for case in runners}
    cases = list(runners)
    for repeat in range(args.repeats):
        order = cases[repeat % len(cases) :] + cases[: repeat % len(cases)]
        for case in order:
            results[case].append(runners[case](case))
    medians = {}
    for case, rows in results.items():
        line = {"bench": "throughput", "backend": backend, "case": case}
        for key in rows[0]:
            line[key] = statistics.median(r[key] for r in rows)
        line.update(
            steps=args.steps,
            batch=args.batch,
            width=args.width,
            repeats=args.repeats,
        )
        medians[case] = line["samples_per_sec"]
        print(json.dumps(line))
    ratios = {
        "monitor_over_plain": medians["monitor"] / medians["plain"],
    }
    if "jit_loop" in medians:
        ratios["plain_over_jit_loop"] = medians["plain"] / medians["jit_loop"]
    print(json.dumps({"bench": "throughput_ratios", **ratios}))


def _jit_loop(keras, args, x, y, features, classes):
    """The same model and SGD in a hand-written `jax.jit` step."""
    import jax
    import jax.numpy as jnp

    model = _model(keras, features, args.width, classes)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(weights, xb, yb):
        logits, _ = model.stateless_call(weights, non_trainable, xb)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, yb[:, None], 1))

    @jax.jit
    def step(weights, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(weights, xb, yb)
        return [w - 0.01 * g for w, g in zip(weights, grads)], loss

    # NumPy batches, copied to the device by each call, as `fit` does.
    batches = [
        (x[i : i + args.batch], y[i : i + args.batch])
        for i in range(0, len(x), args.batch)
    ]

    def run(case: str) -> dict:
        weights = trainable
        weights, loss = step(weights, *batches[0])  # compiled here
        jax.block_until_ready(loss)
        start = time.perf_counter()
        for xb, yb in batches:
            weights, loss = step(weights, xb, yb)
        jax.block_until_ready(loss)
        return {"samples_per_sec": len(x) / (time.perf_counter() - start)}

    return run


if __name__ == "__main__":
    main()
