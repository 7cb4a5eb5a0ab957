"""Benchmark: how long the batch-size search takes, next to one epoch of
the demo.

The demo's model (the digits CNN with its recomputed block) and data, under
`MirroredStrategy` on 2 logical CPU devices (or the GPUs present), with
the demo's target global batch. Timed, in one process:

- `configure_batch` (memory search on a copy, plan, optimizer) with a
  tight budget (`--budget-mb`, default 4 MB: the search has to bracket the
  answer), and with the default budget (90% of the device's memory; on CPU
  of the host memory available, so the micro-batch is capped by the global
  batch and the search stops early);
- one epoch of the demo's training at each plan: the first epoch (which
  traces the train function) and a later one.

TensorFlow's CPU allocator statistics need oneDNN, so this script turns it
on before TensorFlow starts. Prints one JSON line per case and a line of
ratios (search time / epoch time).

`--spread N` measures instead what `SAFETY_MARGIN` has to cover, N times:
`find_batch_size` on the wide MLP of issue 19 (148 MB budget) in a fresh
process, then `fit` at its answer for `--fit-steps` steps in another fresh
process; one JSON line per repeat with the probe's measured peak, the fit's
per-step peaks (min, median, max over the first 12 and over all steps) and
their ratio to the probe's. `--load` runs a CPU-burning process meanwhile.

    python benchmarks/bench_find_batch_size.py
    python benchmarks/bench_find_batch_size.py --repeats 3 --budget-mb 6
    python benchmarks/bench_find_batch_size.py --spread 3 [--load]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _EpochTimes:
    """Wall time of each epoch of a `fit` (a Keras callback, built lazily
    so the flavour is fixed first)."""

    def __new__(cls):
        from keras_mgpu._flavour import keras

        class EpochTimes(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seconds = []

            def on_epoch_begin(self, epoch, logs=None):
                self._start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds.append(time.perf_counter() - self._start)

        return EpochTimes()


def search(demo, config, strategy, data, budget_mb):
    """Seconds of one `configure_batch` on the demo model, and its setup."""
    from keras_mgpu import configure_batch

    plain = dataclasses.replace(config, accumulation=False)
    model, _ = demo._compiled_model(plain, strategy)
    start = time.perf_counter()
    setup = configure_batch(
        model,
        (data[0], data[1]),
        config.global_batch_size,
        base_batch_size=demo.BASE_BATCH_SIZE,
        memory_budget_mb=budget_mb,
        max_batch_size=len(data[0]) // strategy.num_replicas_in_sync,
        strategy=strategy,
        verbose=0,
    )
    return time.perf_counter() - start, setup


def epochs(demo, config, strategy, data, setup, count):
    """Wall time of each of `count` epochs of the demo's training at the
    plan of `setup`."""
    from keras_mgpu._flavour import keras

    steps = setup.accumulation_steps
    config = dataclasses.replace(
        config,
        batch_size=setup.per_replica_batch_size,
        accumulation=steps > 1,
        accumulation_steps=steps,
    )
    keras.utils.set_random_seed(config.seed)
    train, test, _ = demo._datasets(config, strategy.num_replicas_in_sync, data)
    model, _ = demo._compiled_model(config, strategy)
    timer = _EpochTimes()
    model.fit(
        train, epochs=count, verbose=0, callbacks=setup.callbacks + [timer]
    )
    return timer.seconds


def _in_fresh_process(call: str, env: dict) -> dict:
    """`call` (an expression on `tests/batch_size/probe_bodies.py`) in a
    fresh Python process: its JSON result."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import json, sys; sys.path[:0] = [{!r}, {!r}]\n"
        "from batch_size import probe_bodies as bodies\n"
        "print('RESULT ' + json.dumps(bodies.{}))"
    ).format(root, os.path.join(root, "tests"), call)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def spread(repeats: int, fit_steps: int, load: bool) -> None:
    """The probe's measured peak against a fresh `fit`'s step peaks."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="3")
    burner = None
    if load:
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            found = _in_fresh_process("find_for_fresh_fit(0)", env)
            search_s = time.perf_counter() - start
            batch = found["batch_size"]
            fit = _in_fresh_process(
                f"fresh_fit_peaks(0, {batch}, {fit_steps})", env
            )["peaks"]
            probe = found["measured_peak_mb"]
            steady = fit[1:]  # the first step creates the optimizer state
            row = {
                "load": load,
                "batch_size": batch,
                "budget_mb": found["budget_mb"],
                "search_budget_mb": round(found["search_budget_mb"], 1),
                "probe_peak_mb": round(probe, 1),
                "fit_min_mb": round(min(steady), 1),
                "fit_median_mb": round(statistics.median(steady), 1),
                "fit_max_12_mb": round(max(fit[:12]), 1),
                "fit_max_mb": round(max(fit), 1),
                "ratio_12": round(max(fit[:12]) / probe, 3),
                "ratio": round(max(fit) / probe, 3),
                "search_s": round(search_s, 1),
                "loadavg": round(os.getloadavg()[0], 1),
            }
            print(json.dumps(row), flush=True)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--budget-mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--spread", type=int, default=0, metavar="REPEATS")
    parser.add_argument("--fit-steps", type=int, default=30)
    parser.add_argument("--load", action="store_true")
    args = parser.parse_args()
    if args.spread:
        spread(args.spread, args.fit_steps, args.load)
        return

    from keras_mgpu import demo

    devices = demo.configure_devices(args.devices)
    from keras_mgpu._flavour import tf

    strategy = tf.distribute.MirroredStrategy(devices=devices["devices"])
    config = demo.DemoConfig(
        output_dir="", global_batch_size=args.global_batch, progress=False
    )
    data = demo.load_digits_split(config.seed)
    rows = []
    for case, budget in (("tight_budget", args.budget_mb), ("default", None)):
        times = []
        for _ in range(args.repeats):
            seconds, setup = search(demo, config, strategy, data, budget)
            times.append(seconds)
        epoch_seconds = epochs(demo, config, strategy, data, setup, args.epochs)
        found = setup.search
        row = {
            "case": case,
            "device": devices["kind"],
            "replicas": strategy.num_replicas_in_sync,
            "global_batch": args.global_batch,
            "budget_mb": round(found.budget_mb, 1),
            "largest_batch": found.batch_size,
            "limited_by": found.limited_by,
            "probe_steps": len(found.measurements),
            "plan": str(setup.plan),
            "search_s_median": round(statistics.median(times), 2),
            "search_s_all": [round(t, 2) for t in times],
            "first_epoch_s": round(epoch_seconds[0], 2),
            "later_epoch_s": round(statistics.median(epoch_seconds[1:]), 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        json.dumps(
            {
                f"{row['case']}_search_over_first_epoch": round(
                    row["search_s_median"] / row["first_epoch_s"], 2
                )
                for row in rows
            }
            | {
                f"{row['case']}_search_over_later_epoch": round(
                    row["search_s_median"] / row["later_epoch_s"], 2
                )
                for row in rows
            }
        )
    )


if __name__ == "__main__":
    main()
