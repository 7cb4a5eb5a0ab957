"""`keras_mgpu.report`: the PNG training report from a History, a dict or a
CSVLogger file."""

from __future__ import annotations

import builtins
import math

import numpy as np
import pytest

from keras_mgpu._flavour import keras
from keras_mgpu.report import (
    ReportError,
    classify_columns,
    plot_training_report,
    read_csv_log,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# What the demo's CSVLogger writes on CPU (keys of keras_mgpu's monitors),
# plus a column the report does not know.
HEADER = (
    "epoch,accuracy,cpu/core0_util_mean_pct,cpu/util_mean_pct,"
    "cpu/util_spread_pct,cpu/samples,learning_rate,loss,mem/host_rss_mb,"
    "mem/host_system_available_mb,val_accuracy,val_loss,my_custom_thing"
)
ROWS = [
    "0,0.3,90,91,2,10,0.002,2.1,700,20000,0.5,1.8,x",
    "1,0.7,95,96,1,10,0.004,1.0,710,20000,0.8,0.7,y",
    "2,0.9,99,99,0,10,0.004,0.4,712,20000,0.9,0.35,",
]


def _png_size(path) -> tuple:
    """(width, height) from the PNG header, checking it is a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC
    return int.from_bytes(head[16:20], "big"), int.from_bytes(
        head[20:24], "big"
    )


def _drawn_labels(monkeypatch) -> list:
    """Record the label of every line the report draws."""
    from matplotlib.axes import Axes

    labels: list = []
    original = Axes.plot

    def plot(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    return labels


@pytest.fixture
def run_csv(tmp_path):
    path = tmp_path / "run.csv"
    path.write_text("\n".join([HEADER, *ROWS]) + "\n")
    return path


def test_classify_columns_monitor_keys_and_others():
    panels = classify_columns(HEADER.split(",") + ["gpu/gpu0_util_mean_pct"])
    assert panels["loss"] == ["loss", "val_loss"]
    assert panels["accuracy"] == ["accuracy", "val_accuracy"]
    assert panels["learning_rate"] == ["learning_rate"]
    # Per-device figures and the process RSS; not system totals.
    assert panels["memory"] == ["mem/host_rss_mb"]
    # Mean utilisation and spread; not per-core detail or sample counts.
    assert panels["load"] == [
        "cpu/util_mean_pct",
        "cpu/util_spread_pct",
        "gpu/gpu0_util_mean_pct",
    ]
    assert "my_custom_thing" not in sum(panels.values(), [])


def test_throughput_line_reads_the_last_epoch_of_perf_columns():
    from keras_mgpu.report import throughput_line

    columns = {
        "loss": [1.0, 0.5],
        "perf/w0_samples_per_sec": [900.0, 1234.0],
        "perf/w0_tflops_per_device": [0.5, 0.25],
        "perf/w0_mfu": [float("nan"), float("nan")],
        "perf/w0_compile_seconds": [3.0, 3.0],
    }
    assert throughput_line(columns) == (
        "Throughput, last epoch: 1,234 samples/s, 0.25 TFLOP/s per device, "
        "3.0 s compiling (left out)"
    )
    assert throughput_line({"loss": [1.0]}) == ""
    # Not a panel of its own: the 2 x 2 panels stay as they are.
    assert "perf/w0_mfu" not in sum(
        classify_columns(list(columns)).values(), []
    )


def test_classify_columns_other_spellings():
    panels = classify_columns(
        ["lr", "sparse_categorical_accuracy", "val_acc", "gpu_memory", "load"]
    )
    assert panels["learning_rate"] == ["lr"]
    assert panels["accuracy"] == ["sparse_categorical_accuracy", "val_acc"]
    assert panels["memory"] == ["gpu_memory"]
    assert panels["load"] == ["load"]


def test_read_csv_log_turns_non_numbers_into_nan(run_csv):
    columns = read_csv_log(run_csv)
    assert columns["loss"] == [2.1, 1.0, 0.4]
    assert math.isnan(columns["my_custom_thing"][0])
    assert math.isnan(columns["my_custom_thing"][2])


def test_report_from_csv_plots_known_columns(run_csv, tmp_path, monkeypatch):
    labels = _drawn_labels(monkeypatch)
    out = tmp_path / "sub" / "report.png"
    assert plot_training_report(run_csv, out, title="t") == str(out)
    assert _png_size(out) == (1200, 800)
    assert sorted(labels) == sorted(
        [
            "loss",
            "val_loss",
            "accuracy",
            "val_accuracy",
            "learning_rate",
            # Issue 31: what the figure measures, in its legend.
            "mem/host_rss_mb (process RSS at epoch end)",
            "cpu/util_mean_pct",
            "cpu/util_spread_pct",
        ]
    )


def test_report_from_history_and_dict_match(tmp_path, monkeypatch):
    labels = _drawn_labels(monkeypatch)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.ones((8, 2), "float32")
    history = model.fit(x, x[:, :1], epochs=2, verbose=0)
    plot_training_report(history, tmp_path / "h.png")
    assert labels == ["loss"]
    labels.clear()
    plot_training_report(dict(history.history), tmp_path / "d.png")
    assert labels == ["loss"]
    assert _png_size(tmp_path / "h.png") == _png_size(tmp_path / "d.png")


def test_report_steps_draw_the_learning_rate_line(
    run_csv, tmp_path, monkeypatch
):
    labels = _drawn_labels(monkeypatch)
    steps = {"epoch": [0.0, 0.5, 1.0], "learning_rate": [0.0, 1e-3, 2e-3]}
    plot_training_report(run_csv, tmp_path / "r.png", steps=steps)
    assert "learning_rate (per step)" in labels


def test_report_with_only_unknown_columns_raises(tmp_path):
    path = tmp_path / "odd.csv"
    path.write_text("epoch,foo,bar\n0,1,2\n")
    with pytest.raises(
        ReportError,
        match=r"no column to plot.*Received columns: \['bar', 'epoch', 'foo'\]",
    ):
        plot_training_report(path, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "has no data rows"),
        ("epoch,loss\n", "has no data rows"),
        ("epoch,loss\n0,1,2\n", "line 2 has 3 fields, the header has 2"),
    ],
)
def test_bad_csv_raises(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ReportError, match=match):
        plot_training_report(path, tmp_path / "x.png")


def test_binary_file_raises(tmp_path):
    path = tmp_path / "model.keras"
    path.write_bytes(b"PK\x03\x04\xff\xfe\x00\x81" * 50)
    with pytest.raises(ReportError, match="not a text CSV file"):
        read_csv_log(path)


def test_missing_csv_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such file"):
        plot_training_report(tmp_path / "nope.csv", tmp_path / "x.png")


def test_wrong_type_raises(tmp_path):
    with pytest.raises(TypeError, match="Argument `history_or_csv` must be"):
        plot_training_report(42, tmp_path / "x.png")


def test_missing_matplotlib_names_the_extra(run_csv, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r'pip install "keras-mgpu\[plot\]"'):
        plot_training_report(run_csv, tmp_path / "x.png")


def test_memory_legends_say_what_they_measure():
    # Issue 31: the demo's report showed TensorFlow's CPU allocator figure
    # (2.0 MB for a process holding 812 MB) as if it were the memory.
    from keras_mgpu.report import legend_label

    assert legend_label("mem/host_tf_peak_mb") == (
        "mem/host_tf_peak_mb (TensorFlow's CPU allocator only, not "
        "oneDNN's buffers)"
    )
    assert legend_label("mem/w1_host_rss_mb").endswith(
        "(process RSS at epoch end)"
    )
    assert legend_label("mem/gpu0_peak_mb").endswith("(device allocator peak)")
    assert legend_label("loss") == "loss"
