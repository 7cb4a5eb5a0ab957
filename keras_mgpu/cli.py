"""The `keras-mgpu` command: `demo`, `info` and `report`.

- `keras-mgpu demo` trains a small CNN on scikit-learn's digits under
  `MirroredStrategy` (the GPUs present, or logical CPU devices) with every
  keras_mgpu component on, prints a summary table and writes a PNG report;
  `--model-parallel` splits the CNN across the devices instead.
- `keras-mgpu info` prints versions, devices, GPUs (through NVML) and which
  strategies work here.
- `keras-mgpu report RUN.csv` draws the PNG report from a `CSVLogger` file.

TensorFlow is imported only once the options are parsed and checked, so
`--help` and bad options answer without it, and the demo can set up logical
devices before TensorFlow's runtime starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence

DEFAULT_BATCH_SIZE = 32  # the demo's per-replica micro-batch
PROG = "keras-mgpu"
MAX_CPU_DEVICES = 64


class CommandError(Exception):
    """A failure the command reports as one clear line (exit code 1)."""


# ----------------------------------------------------------------------
# Option types: argparse turns their ArgumentTypeError into
# "keras-mgpu demo: error: argument --epochs: ..." and exit code 2.
# ----------------------------------------------------------------------
def _int_type(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if (
            value is None
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            allowed = f"an integer >= {minimum}"
            if maximum is not None:
                allowed = f"an integer from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(
                f"must be {allowed}. Received: {text!r}"
            )
        return value

    parse.__name__ = "integer"  # shown by argparse in its messages
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a number > 0. Received: {text!r}"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-mgpu` (all three subcommands)."""
    from keras_mgpu import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "keras_mgpu: drop-in Keras components for training on many "
            "devices. Start with `keras-mgpu demo`."
        ),
    )
    parser.add_argument(
        "--version", action="version", version=f"{PROG} {__version__}"
    )
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show TensorFlow's own start-up logs and warnings",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        parents=[verbose],
        help="train a small CNN across devices with every component on",
        description=(
            "Train a small CNN on scikit-learn's 8x8 digits (no download) "
            "under MirroredStrategy, across the GPUs present or across "
            "logical CPU devices, with gradient accumulation, linear "
            "learning-rate scaling and warmup, the memory and load "
            "monitors and a recomputed block. Prints a summary table and "
            "writes a PNG report, the CSV log and summary.json. Turn "
            "components off to compare."
        ),
    )
    demo.add_argument(
        "--devices",
        type=_int_type(1, MAX_CPU_DEVICES),
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
        "--epochs", type=_int_type(1, 1000), default=10, help="default 10"
    )
    demo.add_argument(
        "--batch-size",
        type=_int_type(1),
        default=None,
        metavar="N",
        help=f"batch per replica and micro-step (default {DEFAULT_BATCH_SIZE})",
    )
    demo.add_argument(
        "--global-batch",
        type=_int_type(1),
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
        type=_positive_float,
        default=None,
        metavar="MB",
        help=(
            "with --global-batch: memory budget of one replica's training "
            "step (default: 90%% of the device's memory)"
        ),
    )
    demo.add_argument(
        "--accumulation-steps",
        type=_int_type(1),
        default=None,
        metavar="K",
        help="micro-batches per update (default 2)",
    )
    demo.add_argument(
        "--warmup-epochs",
        type=_positive_float,
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
        type=_int_type(1, 1024),
        default=None,
        metavar="M",
        help="with --model-parallel: pipeline each batch as M micro-batches",
    )
    demo.add_argument("--seed", type=_int_type(0), default=0, help="default 0")
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

    info = sub.add_parser(
        "info",
        parents=[verbose],
        help="versions, devices, GPUs and the strategies that work here",
        description=(
            "Print TensorFlow/Keras versions and flavour, physical and "
            "logical devices, GPU names and memory (NVML) and which "
            "tf.distribute strategies work here."
        ),
    )
    del info

    report = sub.add_parser(
        "report",
        help="draw the PNG report from a CSVLogger file",
        description=(
            "Draw the PNG report (loss/accuracy, learning rate, memory, "
            "load per epoch) from the file a keras.callbacks.CSVLogger "
            "wrote. Known columns are plotted, others ignored."
        ),
    )
    report.add_argument("csv", metavar="RUN.csv", help="a CSVLogger file")
    report.add_argument(
        "-o",
        "--output",
        metavar="PNG",
        default=None,
        help="where to write the PNG (default: next to RUN.csv, .png)",
    )
    report.add_argument(
        "--steps",
        metavar="STEPS.csv",
        default=None,
        help=(
            "per-step learning-rate log (columns epoch, learning_rate); "
            "default: RUN_steps.csv next to RUN.csv when it exists, as the "
            "demo writes"
        ),
    )
    report.add_argument("--title", default=None, help="title of the page")
    return parser


# ----------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------
@contextlib.contextmanager
def _native_stderr_to(
    enabled: bool = True, log_path: str | None = None
) -> Iterator[None]:
    """Send what is written to the process's stderr (file descriptor 2) to
    `log_path` (or nowhere) for the duration of the block.

    TensorFlow's C++ side writes start-up notices (CUDA probing on a
    machine without a GPU, CPU features) and dataset warnings straight to
    file descriptor 2, before or regardless of `TF_CPP_MIN_LOG_LEVEL`. A
    failure other than a `CommandError` replays the end of what was held
    back, so nothing that explains a crash is lost.
    """
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    if log_path is not None:
        sink = open(log_path, "a+b")
    else:
        sink = tempfile.TemporaryFile(mode="w+b")
    try:
        os.dup2(sink.fileno(), 2)
        yield
    except (CommandError, KeyboardInterrupt):
        raise
    except BaseException:
        sys.stderr.flush()
        os.dup2(saved, 2)
        sink.seek(0)
        tail = sink.read()[-4000:].decode(errors="replace")
        if tail.strip():
            sys.stderr.write(f"--- TensorFlow's stderr (end) ---\n{tail}\n")
        raise
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sink.close()


def _missing_modules(modules: dict[str, str]) -> list[str]:
    return [
        package
        for module, package in modules.items()
        if importlib.util.find_spec(module) is None
    ]


def _default_output_dir() -> str:
    base = os.path.join("keras_mgpu_runs", time.strftime("%Y%m%d-%H%M%S"))
    path, suffix = base, 1
    while os.path.exists(path):
        suffix += 1
        path = f"{base}-{suffix}"
    return path


# ----------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------
def _subparser(
    parser: argparse.ArgumentParser, name: str
) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps no public accessor
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)  # pragma: no cover - the parser always has them


def _check_demo_args(parser: argparse.ArgumentParser, args) -> None:
    demo_parser = _subparser(parser, "demo")
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


def _run_demo(args) -> int:
    missing = _missing_modules(
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
    tf_log = os.path.join(output, "tensorflow.log")
    with _native_stderr_to(not args.verbose, tf_log):
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
        print(f"TensorFlow's own messages: {os.path.abspath(tf_log)}")
    return 0


def demo_module():
    """`keras_mgpu.demo`, imported on first use (it imports TensorFlow)."""
    from keras_mgpu import demo

    return demo


def _train_demo(args, output: str) -> tuple:
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
    where = (
        f"{len(devices['devices'])} GPU(s)"
        if devices["kind"] == "GPU"
        else f"{len(devices['devices'])} logical CPU devices (no GPU used)"
    )
    how = "split across" if args.model_parallel else "MirroredStrategy on"
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


# ----------------------------------------------------------------------
# info
# ----------------------------------------------------------------------
def _nvml_lines() -> list[str]:
    try:
        import pynvml
    except ImportError:
        return [
            "NVML: nvidia-ml-py not installed (GPU names and memory need "
            'it: pip install "keras-mgpu[gpu]")'
        ]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [f"NVML: not available ({type(exc).__name__}: no driver?)"]
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(driver, bytes):
            driver = driver.decode()
        lines = [f"NVML: driver {driver}"]
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            lines.append(
                f"  GPU {index}: {name}, {memory.total / 2**20:,.0f} MiB "
                f"total, {memory.used / 2**20:,.0f} MiB used"
            )
        if len(lines) == 1:
            lines.append("  no GPU")
        return lines
    except pynvml.NVMLError as exc:
        return [f"NVML: error {type(exc).__name__}: {exc}"]
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _multi_worker_fit_state() -> str:
    import keras as keras3

    from keras_mgpu.distribute import multi_worker_fit

    if multi_worker_fit.keras_version_is_tested(keras3.version()):
        return f"tested with this Keras, {keras3.version()}"
    return (
        f"not tested with Keras {keras3.version()}: it patches nothing and "
        "warns"
    )


def _strategy_lines(
    is_tf_keras: bool, num_gpus: int, num_cpu_devices: int
) -> list[str]:
    """Which strategies work with `model.fit` here: measured with Keras 3.15
    / tf_keras 2.21 / TF 2.21 (see the README compatibility table)."""
    if num_gpus >= 2:
        mirrored = f"model.fit across the {num_gpus} GPUs"
    elif num_gpus == 1:
        mirrored = "works, 1 replica (one GPU); `--cpu` demos several"
    else:
        mirrored = (
            "no GPU: model.fit across logical CPU devices (keras-mgpu demo "
            f"--devices N; {num_cpu_devices} configured now)"
        )
    lines = [
        f"  MirroredStrategy             {mirrored}",
        "  OneDeviceStrategy            works",
    ]
    if is_tf_keras:
        lines += [
            "  MultiWorkerMirroredStrategy  model.fit works (tf_keras)",
            "  ParameterServerStrategy      model.fit with DatasetCreator "
            "and steps_per_epoch (tf_keras)",
        ]
    else:
        lines += [
            "  MultiWorkerMirroredStrategy  model.fit fails in Keras 3 "
            "(keras#20585) unless you call "
            "keras_mgpu.distribute.enable_multi_worker_fit() first "
            f"({_multi_worker_fit_state()}; examples/multi_worker.py); add "
            "callbacks.BackupAndRestore, WorkerWatchdog, StragglerMonitor",
            "  ParameterServerStrategy      not with Keras 3 model.fit (no "
            "DatasetCreator); use tf_keras (TF_USE_LEGACY_KERAS=1)",
        ]
    lines += [
        "  CentralStorageStrategy       trains, but Keras 3 reports a "
        "wrong loss and Dropout fails; prefer MirroredStrategy",
        "  TPUStrategy                  no TPU here",
    ]
    return lines


def _run_info(args) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with _native_stderr_to(not args.verbose):
        from keras_mgpu import __version__
        from keras_mgpu._flavour import FLAVOUR, IS_TF_KERAS, keras, tf

        physical = tf.config.list_physical_devices()
        logical = tf.config.list_logical_devices()
        gpu_details = []
        for gpu in tf.config.list_physical_devices("GPU"):
            details = tf.config.experimental.get_device_details(gpu)
            gpu_details.append(
                f"{gpu.name}: {details.get('device_name', '?')}, compute "
                f"capability {details.get('compute_capability', '?')}"
            )
    other = "tf_keras" if not IS_TF_KERAS else "Keras 3"
    other_hint = (
        "set TF_USE_LEGACY_KERAS=1 to use tf_keras (TFMOT)"
        if not IS_TF_KERAS
        else "unset TF_USE_LEGACY_KERAS for Keras 3"
    )
    lines = [
        f"keras-mgpu {__version__}",
        f"Python {platform.python_version()} on {platform.platform()}",
        f"TensorFlow {tf.__version__} (built with CUDA: "
        f"{tf.test.is_built_with_cuda()})",
        f"Keras {keras.__version__}, flavour {FLAVOUR} ({other_hint})",
    ]
    if not IS_TF_KERAS and importlib.util.find_spec("tf_keras") is not None:
        lines[-1] += f"; {other} is installed too"
    lines.append(
        "Physical devices: "
        + ", ".join(d.name.replace("/physical_device:", "") for d in physical)
    )
    lines.append(
        "Logical devices:  "
        + ", ".join(d.name.replace("/device:", "") for d in logical)
    )
    lines += [f"  {line}" for line in gpu_details]
    lines += _nvml_lines()
    try:
        import psutil

        lines.append(
            f"Host: {psutil.cpu_count(logical=True)} CPU threads "
            f"({psutil.cpu_count(logical=False)} cores), "
            f"{psutil.virtual_memory().total / 2**30:.1f} GiB memory"
        )
    except ImportError:  # a dependency, but keep info working without it
        lines.append(f"Host: {os.cpu_count()} CPU threads")
    extras = {
        "matplotlib": ("matplotlib", "plot"),
        "sklearn": ("scikit-learn", "demo"),
        "pynvml": ("nvidia-ml-py", "gpu"),
        "tensorflow_model_optimization": ("TFMOT", "tfmot"),
    }
    found = [
        f"{name} [{extra}] "
        + ("yes" if importlib.util.find_spec(module) else "no")
        for module, (name, extra) in extras.items()
    ]
    lines.append("Optional: " + ", ".join(found))
    num_gpus = sum(1 for d in logical if d.device_type == "GPU")
    num_cpus = sum(1 for d in logical if d.device_type == "CPU")
    lines.append(
        f"Strategies with {FLAVOUR} model.fit here (measured with Keras "
        "3.15, tf_keras 2.21, TensorFlow 2.21):"
    )
    lines += _strategy_lines(IS_TF_KERAS, num_gpus, num_cpus)
    print("\n".join(lines))
    return 0


# ----------------------------------------------------------------------
# report
# ----------------------------------------------------------------------
def _run_report(args) -> int:
    from keras_mgpu.report import ReportError, plot_training_report

    csv_path = args.csv
    if not os.path.exists(csv_path):
        raise CommandError(f"{csv_path}: no such file")
    if os.path.isdir(csv_path):
        raise CommandError(f"{csv_path}: is a folder, not a CSVLogger file")
    stem = os.path.splitext(csv_path)[0]
    output = args.output or stem + ".png"
    steps = args.steps
    if steps is not None and not os.path.isfile(steps):
        raise CommandError(f"--steps {steps}: no such file")
    if steps is None and os.path.isfile(stem + "_steps.csv"):
        steps = stem + "_steps.csv"
    title = args.title or f"{PROG} report: {os.path.basename(csv_path)}"
    try:
        path = plot_training_report(csv_path, output, steps=steps, title=title)
    except (ReportError, ImportError, OSError) as exc:
        raise CommandError(str(exc)) from None
    print(f"Report: {os.path.abspath(path)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run `keras-mgpu` with `argv` (default: the command line).

    Returns the exit code: 0 on success, 1 when the command failed (with a
    one-line message on stderr), 2 for bad options (argparse's usage error).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            _check_demo_args(parser, args)
            return _run_demo(args)
        if args.command == "info":
            return _run_info(args)
        return _run_report(args)
    except CommandError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
