"""Benchmark: BatchNormalization when batches are split, and the remedies.

A network nobody here wrote, `keras.applications.MobileNetV2(alpha=0.35)`
(52 BatchNormalization layers, 0.42M parameters, random init), trained on
the demo's data (scikit-learn's 8x8 digits, `keras_mgpu.demo.
load_digits_split`, upsampled to 32x32x3) with the same global batch, the
same number of optimizer updates, the same learning rate and the same
sample order in every case:

- `large`: one batch of `--batch` per update (the reference);
- `accum_kK`: `GradientAccumulationOptimizer` over K micro-batches;
- `pipeline_mM`: `apply_placement(model, 2 devices, micro_batches=M)`;
- `replicas_rR`: `MirroredStrategy` over R logical CPU devices
  (`ReductionToOneDevice`, so several sizes can run in one process);
- remedies from `keras_mgpu.normalization`: `use_window_statistics`
  (`*_window`, `*_momentum`), `synchronize_batchnorm` (`*_sync`),
  `convert_batchnorm_to_groupnorm` (`groupnorm_k8`, from scratch under
  K=8 accumulation: GroupNorm does not depend on the batch, so K=8 equals
  the large batch up to float rounding; at `--groupnorm-lr`, 1e-3, since
  the GroupNorm network does not train at the BatchNorm cases' 3e-3) and
  `freeze_batchnorm`
  (`finetune_*`: fine-tuning, starting from the weights of the same
  seed's `large` run, `--finetune-updates` more updates at
  `--finetune-lr`, compared with the large batch fine-tuned likewise);
- `fixed_*`: from the same trained weights, `--fixed-updates` updates at
  learning rate 0. The weights stay those of the reference, so the drift
  of the moving statistics from `fixed_large` is their bookkeeping alone
  (from scratch, the drift also holds every difference of the trained
  weights, which follow another path from the first update on).

Reported per case (one JSON line, mean and standard deviation over the
seeds): test accuracy and loss evaluated with the moving statistics (what
`predict` uses), test accuracy in training mode (the test set normalised
by its own statistics, one batch: tells weights from moving statistics),
and the drift of the moving statistics from the reference run of the
same seed after the same updates: for each BatchNormalization layer, the
relative L2 distance `|a - ref| / |ref|` of `moving_mean` and of
`moving_variance`, averaged over layers. Each case line carries the
deltas against its reference (`large`, or `finetune_large`) measured in
the same run, and the time per update (median over seeds, first update
excluded; 2 shared cores: the logical devices do not run in parallel, so
only relative costs mean anything).

MobileNetV2's BatchNormalization momentum is 0.999: after a few hundred
updates its moving statistics have barely left their initial values and
every case evaluates badly. The benchmark sets `--bn-momentum` (0.9 by
default) on every BatchNormalization layer before training; say so when
quoting the numbers.

    python benchmarks/bench_batchnorm.py             # 3 seeds, all cases
    python benchmarks/bench_batchnorm.py --quick     # 1 seed, few updates
    python benchmarks/bench_batchnorm.py --cases large,accum_k8,accum_k8_window
    python benchmarks/bench_batchnorm.py --list
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name: (kind, splits, remedy, start)
#   kind: "large" | "accum" | "pipeline" | "replicas"
#   splits: K, M or R (1 for large)
#   remedy: None | "window" | "momentum" | "sync" | "groupnorm" | "freeze"
#   start: "scratch" | "finetune" (from the same seed's `large` weights)
#     | "fixed" (from the same seed's `large` weights, learning rate 0:
#     only the moving statistics change, so their drift is bookkeeping)
CASES = {
    "large": ("large", 1, None, "scratch"),
    "accum_k2": ("accum", 2, None, "scratch"),
    "accum_k4": ("accum", 4, None, "scratch"),
    "accum_k8": ("accum", 8, None, "scratch"),
    "pipeline_m2": ("pipeline", 2, None, "scratch"),
    "pipeline_m4": ("pipeline", 4, None, "scratch"),
    "replicas_r2": ("replicas", 2, None, "scratch"),
    "replicas_r4": ("replicas", 4, None, "scratch"),
    "accum_k4_window": ("accum", 4, "window", "scratch"),
    "accum_k8_window": ("accum", 8, "window", "scratch"),
    "accum_k4_momentum": ("accum", 4, "momentum", "scratch"),
    "pipeline_m4_window": ("pipeline", 4, "window", "scratch"),
    "replicas_r2_sync": ("replicas", 2, "sync", "scratch"),
    "replicas_r4_sync": ("replicas", 4, "sync", "scratch"),
    "groupnorm_k8": ("accum", 8, "groupnorm", "scratch"),
    "finetune_large": ("large", 1, None, "finetune"),
    "finetune_k8": ("accum", 8, None, "finetune"),
    "finetune_k8_freeze": ("accum", 8, "freeze", "finetune"),
    "fixed_large": ("large", 1, None, "fixed"),
    "fixed_k8": ("accum", 8, None, "fixed"),
    "fixed_k8_window": ("accum", 8, "window", "fixed"),
    "fixed_k8_momentum": ("accum", 8, "momentum", "fixed"),
    "fixed_r4": ("replicas", 4, None, "fixed"),
    "fixed_r4_sync": ("replicas", 4, "sync", "fixed"),
}
REFERENCES = {"scratch": "large", "finetune": "finetune_large"}
REFERENCES["fixed"] = "fixed_large"


def _updates(start: str, args) -> int:
    return {
        "scratch": args.updates,
        "finetune": args.finetune_updates,
        "fixed": args.fixed_updates,
    }[start]


def _learning_rate(start: str, args, remedy: str | None = None) -> float:
    if remedy == "groupnorm":
        return args.groupnorm_lr
    return {"scratch": args.lr, "finetune": args.finetune_lr, "fixed": 0.0}[
        start
    ]


QUICK_CASES = ("large", "accum_k4", "accum_k4_window", "replicas_r2")
PIPELINE_DEVICES = 2


def configure_devices(count: int) -> list[str]:
    """`count` logical CPU devices (before TensorFlow starts)."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count
    )
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def load_data():
    """The demo's digits, 8x8x1 in [0, 1]; upsampled to 32x32x3 on the
    fly (nearest neighbour, grey to three channels)."""
    from keras_mgpu.demo import load_digits_split

    return load_digits_split(seed=0)


def _upsample(tf, x):
    x = tf.repeat(tf.repeat(x, 4, axis=1), 4, axis=2)
    return tf.tile(x, [1, 1, 1, 3])


def sample_order(n_train: int, samples: int, seed: int):
    """Training-set indices in the order every case of `seed` sees them:
    fresh permutations, concatenated."""
    import numpy as np

    rng = np.random.default_rng(seed)
    epochs = samples // n_train + 1
    order = np.concatenate([rng.permutation(n_train) for _ in range(epochs)])
    return order[:samples]


def dataset(tf, x, y, order, batch: int):
    xs = tf.constant(x)
    ys = tf.constant(y)

    def gather(i):
        return _upsample(tf, tf.gather(xs, i)), tf.gather(ys, i)

    return (
        tf.data.Dataset.from_tensor_slices(order)
        .batch(batch, drop_remainder=True)
        .map(gather)
        .prefetch(2)
    )


def build_network(keras, args):
    """MobileNetV2 (alpha `args.alpha`) or, with `--network resnet50`,
    ResNet50; 32x32x3, random init, logits; every BatchNormalization
    momentum set to `args.bn_momentum`."""
    common = dict(
        input_shape=(32, 32, 3),
        weights=None,
        classes=10,
        classifier_activation=None,
    )
    if args.network == "resnet50":
        model = keras.applications.ResNet50(**common)
    else:
        model = keras.applications.MobileNetV2(alpha=args.alpha, **common)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = args.bn_momentum
    return model


def _network_name(args) -> str:
    if args.network == "resnet50":
        return "ResNet50"
    return f"MobileNetV2(alpha={args.alpha})"


def _normalization():
    import keras_mgpu.normalization as normalization

    return normalization


def _remedy(name: str):
    function = getattr(_normalization(), name, None)
    if function is None:
        raise NotImplementedError(
            f"keras_mgpu.normalization.{name} is not available on this branch"
        )
    return function


def _replaced(result, model):
    # A remedy may change the model in place (and return None or the
    # model) or return a rebuilt copy.
    return model if result is None else result


class UpdateTimer:
    """Wall time at the end of every training batch (micro-step)."""

    def __init__(self, keras):
        self.times: list[float] = []
        timer = self

        class _Callback(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                timer.times.append(time.perf_counter())

        self.callback = _Callback()

    def per_update(self, micro_steps: int) -> float | None:
        """Seconds per update, the first update (tracing) excluded."""
        updates = len(self.times) // micro_steps
        if updates < 2:
            return None
        first = self.times[micro_steps - 1]
        return (self.times[-1] - first) / (updates - 1)


def moving_statistics(model) -> dict:
    """{layer name: (moving_mean, moving_variance)} of every
    BatchNormalization layer (nested and placed layers included)."""
    import numpy as np

    stats = {}
    for layer in _normalization().batchnorm_layers(model):
        stats[layer.name] = (
            np.array(layer.moving_mean.numpy()),
            np.array(layer.moving_variance.numpy()),
        )
    return stats


def drift(stats: dict, reference: dict) -> dict | None:
    """Mean over layers of the relative L2 distance to the reference."""
    import numpy as np

    common = [name for name in reference if name in stats]
    if not common:
        return None
    out = {}
    for i, key in enumerate(("mean", "variance")):
        rel = [
            np.linalg.norm(stats[n][i] - reference[n][i])
            / max(np.linalg.norm(reference[n][i]), 1e-12)
            for n in common
        ]
        out[key] = float(np.mean(rel))
    return out


def training_mode_accuracy(tf, model, x_test, y_test) -> float | None:
    """Test accuracy with the test set normalised by its own batch
    statistics (one batch). The moving statistics this call updates are
    put back afterwards."""
    import numpy as np

    layers = _normalization().batchnorm_layers(model)
    saved = [(v, v.numpy()) for b in layers for v in b.non_trainable_weights]
    try:
        logits = model(_upsample(tf, tf.constant(x_test)), training=True)
        accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    except Exception as exc:  # noqa: BLE001 - report, do not stop the run
        print(f"# training-mode evaluation failed: {exc!r}", file=sys.stderr)
        accuracy = None
    for variable, value in saved:
        variable.assign(value)
    return accuracy


def _short(variable) -> str:
    return variable.name.split("/")[-1].split(":")[0]


def per_layer(network, flat: list) -> dict:
    """{layer name: {variable name: value}} of `network` holding the flat
    weights `flat`."""
    network.set_weights(flat)
    return {
        layer.name: {_short(v): v.numpy() for v in layer.weights}
        for layer in network.layers
        if layer.weights
    }


def _all_layers(model) -> list:
    return list(model._flatten_layers(include_self=False, recursive=True))


def load_layers(model, weights: dict, remedy: str | None) -> None:
    """Assign each layer of `model` (nested and placed layers included)
    the weights of the base network's layer of the same name, variable by
    variable name (a remedy may add variables, e.g. window accumulators)."""
    loaded = set()
    for layer in _all_layers(model):
        values = weights.get(layer.name)
        if values is None:
            continue
        own = {_short(v): v for v in layer.weights}
        if not all(
            key in own and tuple(own[key].shape) == value.shape
            for key, value in values.items()
        ):
            continue
        for key, value in values.items():
            own[key].assign(value)
        loaded.add(layer.name)
    missing = set(weights) - loaded
    if remedy == "groupnorm":  # the BatchNormalization layers are gone
        missing = {n for n in missing if "bn" not in n.lower()}
    if missing:
        raise RuntimeError(
            f"{len(missing)} layers not found in the case's model: "
            f"{sorted(missing)[:5]}"
        )


def _strategy(tf, replicas: int, devices: list[str]):
    return tf.distribute.MirroredStrategy(
        devices[:replicas],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )


def build_case(name: str, ctx: dict, args):
    """The compiled model of case `name` (seed 0's weights), its strategy,
    and a snapshot of every model and optimizer variable before
    training."""
    import tensorflow as tf

    from keras_mgpu import GradientAccumulationOptimizer
    from keras_mgpu._flavour import keras
    from keras_mgpu.placement import apply_placement

    kind, splits, remedy, start = CASES[name]
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    strategy = (
        _strategy(tf, splits, ctx["devices"])
        if kind == "replicas"
        else tf.distribute.get_strategy()
    )
    trained = start != "scratch"
    with strategy.scope():
        model = build_network(keras, args)
        load_layers(model, ctx["pretrained" if trained else "initial"][0], None)
        if remedy == "groupnorm":
            model = _replaced(
                _remedy("convert_batchnorm_to_groupnorm")(
                    model,
                    groups=args.groups,
                    min_values_per_group=args.min_values_per_group,
                ),
                model,
            )
        elif remedy == "sync":
            model = _replaced(_remedy("synchronize_batchnorm")(model), model)
        elif remedy == "freeze":
            model = _replaced(_remedy("freeze_batchnorm")(model), model)
        if kind == "pipeline":
            model = apply_placement(
                model,
                ctx["devices"][:PIPELINE_DEVICES],
                micro_batches=splits,
            )
        if remedy in ("window", "momentum"):
            model = _replaced(
                _remedy("use_window_statistics")(
                    model, window=splits, statistics=remedy
                ),
                model,
            )
        optimizer = keras.optimizers.Adam(_learning_rate(start, args, remedy))
        if kind == "accum":
            optimizer = GradientAccumulationOptimizer(optimizer, splits)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        optimizer.build(model.trainable_variables)
    snapshot = {id(v): v.numpy() for v in _state(model)}
    return model, strategy, snapshot


def _state(model) -> list:
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    variables = list(model.variables) + list(optimizer.variables)
    if inner is not None:
        variables += list(inner.variables)
    return variables


def reset(model, strategy, snapshot: dict, weights: dict, remedy) -> None:
    """Every variable back to its value before training (zero for one
    created since), then the base network's layers to `weights`."""
    import numpy as np

    with strategy.scope():
        for variable in _state(model):
            value = snapshot.get(id(variable))
            if value is None:
                value = np.zeros(variable.shape, variable.dtype)
            variable.assign(value)
        load_layers(model, weights, remedy)


def run_seed(name: str, seed: int, built, ctx: dict, args) -> dict:
    """Train case `name` for one seed; return its measurements."""
    import numpy as np
    import tensorflow as tf

    from keras_mgpu._flavour import keras

    kind, splits, remedy, start = CASES[name]
    model, strategy, snapshot = built
    trained = start != "scratch"
    weights = ctx["pretrained" if trained else "initial"][seed]
    reset(model, strategy, snapshot, weights, remedy)
    updates = _updates(start, args)
    x_train, y_train, x_test, y_test = ctx["data"]
    order = sample_order(
        len(x_train), updates * args.batch, seed + (1000 if trained else 0)
    )
    micro = splits if kind == "accum" else 1
    data = dataset(tf, x_train, y_train, order, args.batch // micro)
    timer = UpdateTimer(keras)
    began = time.perf_counter()
    model.fit(data, epochs=1, verbose=0, callbacks=[timer.callback])
    train_s = time.perf_counter() - began
    iterations = int(model.optimizer.iterations.numpy())
    if iterations != updates:
        raise RuntimeError(
            f"{name}: {iterations} optimizer updates instead of {updates}"
        )
    test = dataset(tf, x_test, y_test, np.arange(len(x_test)), len(x_test))
    loss, accuracy = model.evaluate(test, verbose=0)
    stats = moving_statistics(model)
    result = {
        "accuracy": float(accuracy),
        "loss": float(loss),
        "training_mode_accuracy": training_mode_accuracy(
            tf, model, x_test, y_test
        ),
        "stats": stats,
        "s_per_update": timer.per_update(micro),
        "train_s": train_s,
    }
    if name == "large":
        ctx["pretrained"][seed] = per_layer(ctx["network"], model.get_weights())
    return result


def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return round(mean, 4), round(std, 4)


def summarise(name: str, runs: dict, results: dict, args) -> dict:
    """One JSON row for case `name` over its seeds, with deltas against
    its reference measured in the same run."""
    kind, splits, remedy, start = CASES[name]
    reference = REFERENCES[start]
    row = {
        "benchmark": "batchnorm_split",
        "case": name,
        "split": kind,
        "splits": splits,
        "remedy": remedy,
        "start": start,
        "network": _network_name(args),
        "bn_momentum": args.bn_momentum,
        "global_batch": args.batch,
        "per_forward_batch": args.batch // splits,
        "updates": _updates(start, args),
        "learning_rate": _learning_rate(start, args, remedy),
        **(
            {
                "groups": args.groups,
                "min_values_per_group": args.min_values_per_group,
            }
            if remedy == "groupnorm"
            else {}
        ),
        "seeds": sorted(runs),
    }
    for key in ("accuracy", "loss", "training_mode_accuracy"):
        mean, std = _mean_std([r[key] for r in runs.values()])
        row[key] = mean
        row[f"{key}_std"] = std
    row["accuracy_per_seed"] = [
        round(runs[s]["accuracy"], 4) for s in sorted(runs)
    ]
    row["loss_per_seed"] = [round(runs[s]["loss"], 4) for s in sorted(runs)]
    times = [r["s_per_update"] for r in runs.values() if r["s_per_update"]]
    row["ms_per_update"] = (
        round(1000 * statistics.median(times), 1) if times else None
    )
    ref_runs = results.get(reference, {})
    if name != reference and ref_runs:
        drifts = [
            drift(r["stats"], ref_runs[s]["stats"])
            for s, r in runs.items()
            if s in ref_runs
        ]
        drifts = [d for d in drifts if d is not None]
        for key in ("mean", "variance"):
            mean, std = _mean_std([d[key] for d in drifts])
            row[f"drift_moving_{key}"] = mean
            row[f"drift_moving_{key}_std"] = std
        ref = summarise(reference, ref_runs, {}, args)
        row["reference"] = reference
        for key in ("accuracy", "loss", "training_mode_accuracy"):
            if row[key] is not None and ref[key] is not None:
                row[f"{key}_delta"] = round(row[key] - ref[key], 4)
        if row["ms_per_update"] and ref["ms_per_update"]:
            row["time_per_update_ratio"] = round(
                row["ms_per_update"] / ref["ms_per_update"], 3
            )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--list", action="store_true", help="list cases")
    parser.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names (default: all; the reference "
        "runs whenever a case needs it)",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--finetune-updates", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="global")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--finetune-lr", type=float, default=5e-4)
    parser.add_argument(
        "--fixed-updates",
        type=int,
        default=20,
        help="updates at learning rate 0 of the fixed_* cases",
    )
    parser.add_argument("--bn-momentum", type=float, default=0.9)
    parser.add_argument("--alpha", type=float, default=0.35)
    parser.add_argument(
        "--network",
        choices=["mobilenetv2", "resnet50"],
        default="mobilenetv2",
        help="resnet50: about 70x the multiply-adds per example (not run "
        "on the 2-core CPU)",
    )
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument(
        "--groupnorm-lr",
        type=float,
        default=1e-3,
        help="learning rate of groupnorm_k8 (at the default 3e-3 the "
        "GroupNorm network does not train: measured 10%% accuracy)",
    )
    parser.add_argument(
        "--min-values-per-group",
        type=int,
        default=16,
        help="convert_batchnorm_to_groupnorm's min_values_per_group (2: "
        "the paper's largest divisor of the channels up to --groups)",
    )
    parser.add_argument(
        "--fresh-per-seed",
        action="store_true",
        help="build and trace every case anew for each seed (slower; "
        "checks that resetting a built case changes nothing)",
    )
    args = parser.parse_args()
    if args.list:
        for name, spec in CASES.items():
            print(name, *spec)
        return
    if args.quick:
        args.seeds, args.updates, args.finetune_updates = 1, 12, 4
        args.fixed_updates = 4
    names = (
        args.cases.split(",")
        if args.cases
        else list(QUICK_CASES if args.quick else CASES)
    )
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; --list shows them")
    needed = set(names)
    for name in names:
        needed.add(REFERENCES[CASES[name][3]])
        needed.add("large")
    order = [n for n in CASES if n in needed]

    devices = configure_devices(4)
    from keras_mgpu._flavour import keras

    category = getattr(_normalization(), "BatchNormMicroBatchWarning", None)
    if category is not None:  # the cases without a remedy are deliberate
        warnings.simplefilter("ignore", category)
    seeds = list(range(args.seeds))
    ctx = {
        "devices": devices,
        "data": load_data(),
        "initial": {},
        "pretrained": {},
    }
    network = build_network(keras, args)
    ctx["network"] = network
    for seed in seeds:
        keras.utils.set_random_seed(seed)
        ctx["initial"][seed] = per_layer(
            network, build_network(keras, args).get_weights()
        )
    results: dict = {name: {} for name in order}
    began = time.perf_counter()
    # Case-major: a case is built and traced once and trained from each
    # seed's weights in turn (with --fresh-per-seed, rebuilt per seed).
    for name in order:
        error = None
        try:
            built = build_case(name, ctx, args)
            for seed in seeds:
                if seed and args.fresh_per_seed:
                    built = build_case(name, ctx, args)
                results[name][seed] = run_seed(name, seed, built, ctx, args)
                print(
                    f"# {name} seed {seed} done at "
                    f"{time.perf_counter() - began:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        except Exception as exc:  # noqa: BLE001 - report per case
            error = f"{type(exc).__name__}: {exc}"
        built = None
        if error is not None:
            row = {"benchmark": "batchnorm_split", "case": name}
            row["error"] = error
        else:
            row = summarise(name, results[name], results, args)
        print(json.dumps(row), flush=True)
    print(
        json.dumps(
            {
                "benchmark": "batchnorm_split_run",
                "seeds": len(seeds),
                "wall_s": round(time.perf_counter() - began, 1),
                "lr": args.lr,
                "finetune_lr": args.finetune_lr,
                "optimizer": "Adam",
                "cpu_devices": len(devices),
                "pipeline_devices": PIPELINE_DEVICES,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
