"""A one-page PNG report of a training run: loss and accuracy, learning rate,
memory and device load per epoch.

`plot_training_report` reads a Keras `History`, a dict of per-epoch lists,
or the file a `keras.callbacks.CSVLogger` wrote. Columns it knows are
plotted; any other column is ignored, so the report works on a user's own
run as well as on the `keras-mgpu demo` run. matplotlib is imported only
when a report is drawn (`pip install "keras-mgpu[plot]"`).
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Mapping
from typing import Any

PLOT_EXTRA_HINT = 'pip install "keras-mgpu[plot]"'

# Which panel a column goes to. keras_mgpu's monitors log keys
# `<group>/<name>` (see keras_mgpu.monitoring.log_keys): the report keeps
# the figures that read well on one axis (per-device peaks and the process
# RSS in MB; mean utilisation and the busiest-minus-idlest spread in %) and
# leaves out system-wide totals and per-core detail. Columns of other
# origins are matched by name.
_LOSS = re.compile(r"^(val_)?loss$")
_ACCURACY = re.compile(r"^(val_)?([a-z0-9_]*_)?acc(uracy)?$")
_LEARNING_RATE = re.compile(r"^(learning_rate|lr)$")
_MONITOR_MEMORY = re.compile(r"^mem/(w\d+_)?[a-z0-9_]*(_peak_mb|_rss_mb)$")
_MONITOR_LOAD = re.compile(
    r"^(gpu|cpu)/(w\d+_)?(gpu\d+_)?util_(mean|spread)_pct$"
)
_MONITOR_GROUP = re.compile(r"^(mem|gpu|cpu)/")
# What a monitor's memory figure measures, in its legend: TensorFlow's CPU
# allocator does not see oneDNN's buffers (a run holding 812 MB read
# 2.0 MB there), and the RSS is read at epoch ends, not a peak.
_MEMORY_MEANINGS = (
    (
        re.compile(r"^mem/(w\d+_)?host_tf_peak_mb$"),
        "TensorFlow's CPU allocator only, not oneDNN's buffers",
    ),
    (re.compile(r"^mem/(w\d+_)?host_rss_mb$"), "process RSS at epoch end"),
    (
        re.compile(r"^mem/(w\d+_)?(gpu|cpu|tpu)\d+_peak_mb$"),
        "device allocator peak",
    ),
)


def legend_label(name: str) -> str:
    """`name`, with what it measures where it is a monitor's memory
    figure."""
    for pattern, meaning in _MEMORY_MEANINGS:
        if pattern.match(name):
            return f"{name} ({meaning})"
    return name


_OTHER_MEMORY = re.compile(r"mem(ory)?", re.IGNORECASE)
_OTHER_LOAD = re.compile(r"(load|util)", re.IGNORECASE)


class ReportError(ValueError):
    """The run given to `plot_training_report` cannot be read."""


def _require_matplotlib() -> Any:
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "Drawing a training report needs matplotlib. Install it with: "
            f"{PLOT_EXTRA_HINT}"
        ) from exc
    return Figure, FigureCanvasAgg


def _integer_epochs(axes: list) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        if ax.lines:  # an empty panel keeps its blank axes
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# ThroughputMonitor's keys (`perf/`, see keras_mgpu.callbacks.
# ThroughputMonitor): one line under the panels, from the last epoch.
_PERF = re.compile(r"^perf/(w\d+_)?([a-z_]+)$")


def throughput_line(columns: Mapping[str, list]) -> str:
    """The last epoch's throughput as one line ("" without `perf/`
    columns): samples/s, TFLOP/s per device, MFU, compile seconds."""
    last = {}
    for name, values in columns.items():
        match = _PERF.match(name)
        if match and values and math.isfinite(_to_float(values[-1])):
            last.setdefault(match.group(2), _to_float(values[-1]))
    parts = []
    if "samples_per_sec" in last:
        parts.append(f"{last['samples_per_sec']:,.0f} samples/s")
    if "tokens_per_sec" in last:
        parts.append(f"{last['tokens_per_sec']:,.0f} tokens/s")
    if "tflops_per_device" in last:
        parts.append(f"{last['tflops_per_device']:.3g} TFLOP/s per device")
    if "mfu" in last:
        parts.append(f"MFU {last['mfu']:.1%}")
    if "compile_seconds" in last:
        parts.append(f"{last['compile_seconds']:.1f} s compiling (left out)")
    return ("Throughput, last epoch: " + ", ".join(parts)) if parts else ""


def _to_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def read_csv_log(path: str | os.PathLike) -> dict[str, list[float]]:
    """Read a `CSVLogger` file into a dict of per-epoch float lists.

    Cells that are not numbers (empty, "nan", text) become NaN. Raises
    `FileNotFoundError` for a missing file and `ReportError` for a file that
    is not a CSV log with at least one row.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No such file: {path!r}")
    try:
        with open(path, newline="") as f:
            sample = f.read(4096)
            f.seek(0)
            try:
                dialect = csv.Sniffer().sniff(sample, delimiters=",;\t")
            except csv.Error:
                dialect = csv.excel
            rows = list(csv.reader(f, dialect))
    except UnicodeDecodeError as exc:
        raise ReportError(
            f"{path!r} is not a text CSV file (a CSVLogger log was expected)"
        ) from exc
    rows = [row for row in rows if any(cell.strip() for cell in row)]
    if len(rows) < 2:
        raise ReportError(
            f"{path!r} has no data rows: a CSVLogger log has a header line "
            "(epoch,loss,...) and one line per epoch"
        )
    header = [name.strip() for name in rows[0]]
    columns: dict[str, list[float]] = {name: [] for name in header if name}
    for line_number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ReportError(
                f"{path!r} line {line_number} has {len(row)} fields, the "
                f"header has {len(header)}"
            )
        for name, cell in zip(header, row, strict=True):
            if name:
                columns[name].append(_to_float(cell))
    return columns


def _as_columns(history_or_csv: Any) -> dict[str, list[float]]:
    if isinstance(history_or_csv, (str, os.PathLike)):
        return read_csv_log(history_or_csv)
    logs = getattr(history_or_csv, "history", history_or_csv)
    if not isinstance(logs, Mapping):
        raise TypeError(
            "Argument `history_or_csv` must be a keras History, a dict of "
            "per-epoch lists or the path of a CSVLogger file. Received: "
            f"history_or_csv={history_or_csv!r} (of type "
            f"{type(history_or_csv).__name__})"
        )
    columns = {}
    for name, values in logs.items():
        if isinstance(values, (list, tuple)):
            columns[str(name)] = [_to_float(v) for v in values]
    return columns


def classify_columns(names: list[str]) -> dict[str, list[str]]:
    """Which panel of the report each known column goes to.

    Returns a dict with keys "loss", "accuracy", "learning_rate", "memory"
    and "load" (lists of column names, in the order given); unknown columns
    (and "epoch") are left out.
    """
    panels: dict[str, list[str]] = {
        "loss": [],
        "accuracy": [],
        "learning_rate": [],
        "memory": [],
        "load": [],
    }
    for name in names:
        if _LOSS.match(name):
            panels["loss"].append(name)
        elif _LEARNING_RATE.match(name):
            panels["learning_rate"].append(name)
        elif _MONITOR_GROUP.match(name):
            if _MONITOR_MEMORY.match(name):
                panels["memory"].append(name)
            elif _MONITOR_LOAD.match(name):
                panels["load"].append(name)
        elif _ACCURACY.match(name):
            panels["accuracy"].append(name)
        elif _OTHER_MEMORY.search(name):
            panels["memory"].append(name)
        elif _OTHER_LOAD.search(name):
            panels["load"].append(name)
    return panels


def _unit_label(names: list[str], what: str) -> str:
    if names and all(n.endswith("_mb") for n in names):
        return f"{what} (MB)"
    if names and all(n.endswith("_pct") for n in names):
        return f"{what} (%)"
    return f"{what} (as logged)"


def _finite(values: list[float]) -> bool:
    return any(math.isfinite(v) for v in values)


# matplotlib's default "tab10" colours, listed so that a validation curve
# gets its training curve's colour and two panels sharing axes do not clash.
_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _plot_lines(
    ax: Any,
    x: list[float],
    columns: dict,
    names: list,
    first_colour: int = 0,
) -> int:
    """Plot `names` on `ax`: validation dashed, in its training colour."""
    colours: dict[str, str] = {}
    drawn = 0
    for name in names:
        values = columns[name]
        if not _finite(values):
            continue
        base = name[4:] if name.startswith("val_") else name
        if base not in colours:
            colours[base] = _PALETTE[
                (first_colour + len(colours)) % len(_PALETTE)
            ]
        style = "--" if name.startswith("val_") else "-"
        ax.plot(
            x,
            values,
            style,
            color=colours[base],
            marker="o",
            markersize=3,
            label=legend_label(name),
        )
        drawn += 1
    return drawn


def _empty(ax: Any, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        ha="center",
        va="center",
        transform=ax.transAxes,
        color="0.45",
        wrap=True,
    )
    ax.set_xticks([])
    ax.set_yticks([])


def plot_training_report(
    history_or_csv: Any,
    path: str | os.PathLike,
    *,
    steps: Any = None,
    title: str | None = None,
) -> str:
    """Draw a one-page PNG report of a training run and return its path.

    Four panels, per epoch: loss and accuracy (train solid, validation
    dashed; accuracy on a second axis), learning rate, memory (per-device
    peaks and the process RSS the `MemoryMonitor` logged, or any column
    named like memory) and device load (mean GPU or CPU utilisation and the
    spread between devices from the `GPULoadMonitor`, or any column named
    like load/util). A panel whose columns are absent says so. Columns it
    does not know are ignored.

    Args:
        history_or_csv: a `keras.callbacks.History` (what `fit` returns), a
            dict mapping log names to per-epoch lists, or the path of a
            `keras.callbacks.CSVLogger` file.
        path: str or path-like, where to write the PNG. Parent folders are
            created.
        steps: optional finer log of the learning rate, a dict or CSV path
            with columns `epoch` (fractional: 1.0 is the end of the first
            epoch) and `learning_rate`, e.g. one row per batch. Drawn as a
            line in the learning-rate panel, so a warmup shows as a ramp.
        title: str, optional title of the page.

    Returns:
        The path of the PNG, as a str.

    Example:

    ```python
    history = model.fit(x, y, epochs=5,
                        callbacks=[keras.callbacks.CSVLogger("run.csv")])
    keras_mgpu.report.plot_training_report(history, "run.png")
    keras_mgpu.report.plot_training_report("run.csv", "run_again.png")
    ```
    """
    columns = _as_columns(history_or_csv)
    panels = classify_columns(list(columns))
    known = [name for names in panels.values() for name in names]
    if not known:
        raise ReportError(
            "Found no column to plot. Known columns: loss, val_loss, "
            "accuracy (and *_accuracy / *acc metrics), learning_rate or lr, "
            "memory and load columns. Received columns: "
            f"{sorted(columns) or 'none'}"
        )
    lengths = {len(columns[name]) for name in known}
    epochs = max(lengths)
    if "epoch" in columns and len(columns["epoch"]) == epochs:
        # CSVLogger counts from 0; people count epochs from 1.
        x = [
            v + 1 if math.isfinite(v) else i + 1
            for i, v in enumerate(columns["epoch"])
        ]
    else:
        x = list(range(1, epochs + 1))

    Figure, FigureCanvasAgg = _require_matplotlib()
    fig = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_loss, ax_lr), (ax_mem, ax_load) = fig.subplots(2, 2)

    # Loss and accuracy share a panel: one run's learning progress.
    drawn = _plot_lines(ax_loss, x, columns, panels["loss"])
    ax_loss.set_title("Loss and accuracy")
    ax_loss.set_xlabel("epoch")
    handles, labels = ax_loss.get_legend_handles_labels()
    if panels["accuracy"]:
        ax_acc = ax_loss.twinx() if drawn else ax_loss
        if _plot_lines(ax_acc, x, columns, panels["accuracy"], 2):
            drawn += 1
            ax_acc.set_ylabel("accuracy")
            if ax_acc is not ax_loss:
                more = ax_acc.get_legend_handles_labels()
                handles, labels = handles + more[0], labels + more[1]
            else:
                handles, labels = ax_acc.get_legend_handles_labels()
    if drawn:
        if panels["loss"]:
            ax_loss.set_ylabel("loss")
        ax_loss.legend(handles, labels, loc="center right", fontsize=8)
    else:
        _empty(ax_loss, "no loss or accuracy column in this run")

    lr_drawn = _plot_lines(ax_lr, x, columns, panels["learning_rate"])
    if steps is not None:
        fine = _as_columns(steps)
        if "epoch" in fine and _finite(fine.get("learning_rate", [])):
            ax_lr.plot(
                fine["epoch"],
                fine["learning_rate"],
                "-",
                color="0.55",
                linewidth=1,
                label="learning_rate (per step)",
                zorder=1,
            )
            lr_drawn += 1
    if lr_drawn:
        ax_lr.set_ylabel("learning rate")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax_lr.legend(fontsize=8)
    else:
        _empty(
            ax_lr,
            "no learning_rate column\n(keras_mgpu's LR callbacks log it)",
        )
    ax_lr.set_title("Learning rate")
    ax_lr.set_xlabel("epoch")

    for ax, what, title, monitor in (
        (ax_mem, "memory", "Memory", "MemoryMonitor"),
        (ax_load, "load", "Device load", "GPULoadMonitor"),
    ):
        if _plot_lines(ax, x, columns, panels[what]):
            ax.set_ylabel(_unit_label(panels[what], what))
            ax.legend(fontsize=7)
        else:
            _empty(ax, f"no {what} column\n(add keras_mgpu's {monitor})")
        ax.set_title(title)
        ax.set_xlabel("epoch")

    _integer_epochs([ax_loss, ax_lr, ax_mem, ax_load])
    if title:
        fig.suptitle(title)
    speed = throughput_line(columns)
    if speed:
        fig.supxlabel(speed, fontsize=9, color="0.3")
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, format="png")
    return path
