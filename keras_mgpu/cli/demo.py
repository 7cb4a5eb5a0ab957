"""`keras-mgpu demo`: train a small CNN across devices with every
component on, print a summary table and write a PNG report.

TensorFlow: under `MirroredStrategy`. JAX (`KERAS_BACKEND=jax`): under
`keras.distribution.DataParallel`, with the components that construct on
JAX (the summary names those that refuse), TensorFlow not imported."""

from __future__ import annotations

import argparse
import json
import os
import textwrap
import time

from keras_mgpu.cli._common import (
    PROG,
    CommandError,
    gpu_mismatch_note,
    int_type,
    missing_modules,
    native_stderr_to,
    nvml_gpu_count,
    positive_float,
    requested_backend,
)

DEFAULT_BATCH_SIZE = 32  # the demo's per-replica micro-batch
MAX_CPU_DEVICES = 64


def add_parser(sub, parents: list) -> argparse.ArgumentParser:
    """Add `demo` to the subcommands `sub`."""
    demo = sub.add_parser(
        "demo",
        parents=parents,
        help="train a small CNN across devices with every component on",
        description=(
            "Train a small CNN on scikit-learn's 8x8 digits (no download) "
            "under MirroredStrategy (with KERAS_BACKEND=jax: "
            "keras.distribution.DataParallel), across the GPUs present or "
            "across logical CPU devices, with gradient accumulation, linear "
            "learning-rate scaling and warmup, the memory and load "
            "monitors and a recomputed block. Prints a summary table and "
            "writes a PNG report, the CSV log and summary.json. Turn "
            "components off to compare."
        ),
    )
    demo.add_argument(
        "--devices",
        type=int_type(1, MAX_CPU_DEVICES),
        default=None,
        metavar="N",
        help=(
            "without GPUs: logical CPU devices to split the host into "
            "(default 2); with GPUs: how many to use (default all)"
        ),
    )
    demo.add_argument(
        "--cpu",
        action="store_true",
        help="use logical CPU devices even when GPUs are present",
    )
    demo.add_argument(
        "--epochs", type=int_type(1, 1000), default=10, help="default 10"
    )
    demo.add_argument(
        "--batch-size",
        type=int_type(1),
        default=None,
        metavar="N",
        help=f"batch per replica and micro-step (default {DEFAULT_BATCH_SIZE})",
    )
    demo.add_argument(
        "--global-batch",
        type=int_type(1),
        default=None,
        metavar="N",
        help=(
            "examples per update: the largest micro-batch that fits in "
            "memory is measured (keras_mgpu.configure_batch) and "
            "accumulation makes up the rest; replaces --batch-size and "
            "--accumulation-steps"
        ),
    )
    demo.add_argument(
        "--memory-budget-mb",
        type=positive_float,
        default=None,
        metavar="MB",
        help=(
            "with --global-batch: memory budget of one replica's training "
            "step (default: 90%% of the device's memory)"
        ),
    )
    demo.add_argument(
        "--accumulation-steps",
        type=int_type(1),
        default=None,
        metavar="K",
        help="micro-batches per update (default 2)",
    )
    demo.add_argument(
        "--warmup-epochs",
        type=positive_float,
        default=None,
        metavar="E",
        help="length of the learning-rate warmup in epochs (default 2)",
    )
    demo.add_argument(
        "--model-parallel",
        action="store_true",
        help=(
            "split the CNN across the devices, one stage each "
            "(keras_mgpu.apply_placement), instead of mirroring it; "
            "needs 2 or more devices"
        ),
    )
    demo.add_argument(
        "--micro-batches",
        type=int_type(1, 1024),
        default=None,
        metavar="M",
        help="with --model-parallel: pipeline each batch as M micro-batches",
    )
    demo.add_argument("--seed", type=int_type(0), default=0, help="default 0")
    demo.add_argument(
        "--output",
        metavar="DIR",
        default=None,
        help="folder for the report, log and summary (default "
        "./keras_mgpu_runs/<timestamp>/)",
    )
    for name, what in (
        ("accumulation", "gradient accumulation"),
        ("warmup", "the learning-rate warmup"),
        ("scaling", "linear learning-rate scaling"),
        ("monitors", "the memory and load monitors"),
        ("recompute", "recomputing the conv block in the backward pass"),
    ):
        demo.add_argument(
            f"--no-{name}",
            dest=name,
            action="store_false",
            help=f"turn off {what}",
        )
    return demo


def _default_output_dir() -> str:
    base = os.path.join("keras_mgpu_runs", time.strftime("%Y%m%d-%H%M%S"))
    path, suffix = base, 1
    while os.path.exists(path):
        suffix += 1
        path = f"{base}-{suffix}"
    return path


def check_args(demo_parser: argparse.ArgumentParser, args) -> None:
    """Refuse option combinations that contradict each other."""
    if not args.accumulation and args.accumulation_steps is not None:
        demo_parser.error(
            "--accumulation-steps cannot be combined with --no-accumulation"
        )
    if args.global_batch is not None:
        for given, option in (
            (args.batch_size, "--batch-size"),
            (args.accumulation_steps, "--accumulation-steps"),
            (None if args.accumulation else True, "--no-accumulation"),
        ):
            if given is not None:
                demo_parser.error(
                    f"--global-batch cannot be combined with {option} (the "
                    "batch and accumulation come from the memory search)"
                )
    elif args.memory_budget_mb is not None:
        demo_parser.error("--memory-budget-mb needs --global-batch")
    if not args.warmup and args.warmup_epochs is not None:
        demo_parser.error("--warmup-epochs cannot be combined with --no-warmup")
    if args.micro_batches is not None and not args.model_parallel:
        demo_parser.error("--micro-batches needs --model-parallel")
    if args.model_parallel and args.devices == 1:
        demo_parser.error("--model-parallel needs 2 or more devices")
    if args.global_batch is not None and args.model_parallel:
        demo_parser.error(
            "--global-batch cannot be combined with --model-parallel (the "
            "memory search probes one device, a placed model spans several)"
        )
    batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    if args.micro_batches is not None and args.micro_batches > batch_size:
        demo_parser.error(
            f"--micro-batches {args.micro_batches} is larger than --batch-size "
            f"{batch_size}: each micro-batch needs an example"
        )
    if args.output is not None and os.path.isfile(args.output):
        demo_parser.error(f"--output {args.output!r} is a file; give a folder")


def _seconds_since_process_start() -> float | None:
    """Wall time since this process started, imports included."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # psutil is a dependency, but never fail on timing
        return None


def run(args) -> int:
    """Run the demo; return the exit code."""
    missing = missing_modules(
        {"sklearn": "scikit-learn", "matplotlib": "matplotlib"}
    )
    if missing:
        raise CommandError(
            f"the demo needs {' and '.join(missing)}. Install with: "
            'pip install "keras-mgpu[demo]"'
        )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow keeps CPU allocator statistics only with oneDNN on (off by
    # default on many CPUs); the demo is its own process, so it can ask for
    # them and show a peak-memory figure on a CPU-only machine too.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    output = args.output or _default_output_dir()
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as exc:
        raise CommandError(
            f"cannot create --output {output!r}: {exc}"
        ) from None
    jax = requested_backend() == "jax"
    tf_log = os.path.join(output, "jax.log" if jax else "tensorflow.log")
    with native_stderr_to(not args.verbose, tf_log):
        summary, devices = _train_demo(args, output)
    print()
    total = _seconds_since_process_start()
    print(demo_module().format_summary(summary, total))
    if total is not None:
        summary["total_seconds"] = total
        with open(os.path.join(output, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    for note in summary["notes"]:
        print(
            textwrap.fill(
                note,
                100,
                initial_indent="  note: ",
                subsequent_indent="        ",
            )
        )
    print(f"Report: {summary['report']}")
    print(
        f"Log:    {summary['csv']}  (redraw: {PROG} report "
        f"{_shell_path(summary['csv'])})"
    )
    if not args.verbose:
        whose = "JAX/XLA's" if jax else "TensorFlow's"
        print(f"{whose} own messages: {os.path.abspath(tf_log)}")
    return 0


def demo_module():
    """`keras_mgpu.demo`, imported on first use (it imports Keras, and
    TensorFlow on that backend)."""
    from keras_mgpu import demo

    return demo


def _refuse_on_jax(args) -> None:
    """Options that need a TensorFlow-only component, refused on JAX before
    anything starts."""
    if args.model_parallel:
        raise CommandError(
            "--model-parallel splits the CNN with apply_placement, which "
            "runs on TensorFlow only; on JAX use "
            "keras.distribution.ModelParallel with a LayoutMap (or unset "
            "KERAS_BACKEND)"
        )
    if args.global_batch is not None:
        raise CommandError(
            "--global-batch measures memory with TensorFlow's allocator "
            "(configure_batch), TensorFlow only for now; on JAX give "
            "--batch-size and --accumulation-steps"
        )


def _train_demo(args, output: str) -> tuple:
    jax = requested_backend() == "jax"
    if jax:
        _refuse_on_jax(args)
    demo = demo_module()
    try:
        devices = demo.configure_devices(args.devices, not args.cpu)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    config = demo.DemoConfig(
        output_dir=output,
        epochs=args.epochs,
        batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
        global_batch_size=args.global_batch,
        memory_budget_mb=args.memory_budget_mb,
        accumulation=args.accumulation,
        accumulation_steps=args.accumulation_steps or 2,
        warmup=args.warmup,
        warmup_epochs=args.warmup_epochs or 2.0,
        scaling=args.scaling,
        monitors=args.monitors,
        recompute=args.recompute,
        seed=args.seed,
        model_parallel=args.model_parallel,
        micro_batches=args.micro_batches or 1,
    )
    if args.model_parallel and len(devices["devices"]) < 2:
        raise CommandError(
            "--model-parallel needs 2 or more devices; this machine gives "
            f"{len(devices['devices'])}. Use --cpu --devices 2 to split the "
            "CPU into logical devices."
        )
    if devices["kind"] == "CPU" and not args.cpu and not jax:
        note = gpu_mismatch_note(nvml_gpu_count(), 0)
        if note is not None:
            print(f"note: {note}", flush=True)
    cpu_kind = "CPU devices" if jax else "logical CPU devices"
    where = (
        f"{len(devices['devices'])} GPU(s)"
        if devices["kind"] == "GPU"
        else f"{len(devices['devices'])} {cpu_kind} (no GPU used)"
    )
    how = "split across" if args.model_parallel else "MirroredStrategy on"
    if jax:
        how = "keras.distribution.DataParallel (JAX backend) on"
    print(
        "keras-mgpu demo: a small CNN on scikit-learn's 8x8 digits "
        f"(1437 train / 360 test images), {how} {where}.",
        flush=True,
    )
    try:
        summary = demo.run_demo(config, devices)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    return summary, devices


def _shell_path(path: str) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path
