"""`keras-mgpu report RUN.csv`: draw the PNG report from a `CSVLogger`
file."""

from __future__ import annotations

import argparse
import os

from keras_mgpu.cli._common import PROG, CommandError


def add_parser(sub, parents: list) -> argparse.ArgumentParser:
    """Add `report` to the subcommands `sub`."""
    del parents  # no TensorFlow: nothing to be verbose about
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
    return report


def run(args) -> int:
    """Draw the report; return the exit code."""
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
