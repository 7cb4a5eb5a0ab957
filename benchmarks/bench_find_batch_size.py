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

    python benchmarks/bench_find_batch_size.py
    python benchmarks/bench_find_batch_size.py --repeats 3 --budget-mb 6
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--budget-mb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

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
