"""The `keras-mgpu` command on each backend: bad options, `info`, `report`,
and the demo end to end.

The demo sets up its devices (2) before TensorFlow or JAX starts, which
this test process (4 devices) has already done, so it runs in a process
apart. On TensorFlow the demo runs of this module run once per session,
one after the other, from one module fixture (`tests/_shared_process.py`:
each `python -m keras_mgpu demo ...` as `__main__` in one fresh process);
each test reads its run.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest
from _shared_process import run_shared

from keras_mgpu import _components, cli
from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.cli import _common as cli_common
from keras_mgpu.cli import info as cli_info

pytestmark = pytest.mark.backends("tensorflow", "jax")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BACKEND = os.environ["KERAS_BACKEND"]

# The demo test trains 5 epochs (55 updates). Measured on held-out digits
# with seeds 0-3: 0.95-0.96 at 5 epochs, 0.97-0.98 at the default 10.
DEMO_TEST_EPOCHS = 5
ACCURACY_THRESHOLD = 0.9

# Components the end-to-end demo test turns off on JAX: none (each one
# works there or refuses at construction, which the demo reports).
NOT_YET_ON_JAX: list[str] = []


def _run(args: list, timeout: float, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "keras_mgpu", *args],
        cwd=cwd or REPO_ROOT,
        env={
            **os.environ,
            "PYTHONPATH": REPO_ROOT,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_USE_LEGACY_KERAS": "0",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC


# ----------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: COMMAND"),
        (["train"], "invalid choice: 'train'"),
        (
            ["demo", "--epochs", "0"],
            "argument --epochs: must be an integer from 1 to 1000. "
            "Received: '0'",
        ),
        (
            ["demo", "--epochs", "two"],
            "argument --epochs: must be an integer from 1 to 1000. "
            "Received: 'two'",
        ),
        (
            ["demo", "--batch-size", "-4"],
            "argument --batch-size: must be an integer >= 1. Received: '-4'",
        ),
        (
            ["demo", "--accumulation-steps", "0"],
            "argument --accumulation-steps: must be an integer >= 1",
        ),
        (
            ["demo", "--devices", "0"],
            "argument --devices: must be an integer from 1 to 64",
        ),
        (["demo", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
        (
            ["demo", "--warmup-epochs", "0"],
            "argument --warmup-epochs: must be a number > 0. Received: '0'",
        ),
        (
            ["demo", "--no-accumulation", "--accumulation-steps", "4"],
            "--accumulation-steps cannot be combined with --no-accumulation",
        ),
        (
            ["demo", "--no-warmup", "--warmup-epochs", "1"],
            "--warmup-epochs cannot be combined with --no-warmup",
        ),
        (
            ["demo", "--global-batch", "0"],
            "argument --global-batch: must be an integer >= 1",
        ),
        (
            ["demo", "--global-batch", "64", "--memory-budget-mb", "-1"],
            "argument --memory-budget-mb: must be a number > 0",
        ),
        (
            ["demo", "--global-batch", "64", "--batch-size", "8"],
            "--global-batch cannot be combined with --batch-size (the batch "
            "and accumulation come from the memory search)",
        ),
        (
            ["demo", "--global-batch", "64", "--accumulation-steps", "2"],
            "--global-batch cannot be combined with --accumulation-steps",
        ),
        (
            ["demo", "--global-batch", "64", "--no-accumulation"],
            "--global-batch cannot be combined with --no-accumulation",
        ),
        (
            ["demo", "--memory-budget-mb", "10"],
            "--memory-budget-mb needs --global-batch",
        ),
        (
            ["demo", "--micro-batches", "2"],
            "--micro-batches needs --model-parallel",
        ),
        (
            ["demo", "--model-parallel", "--devices", "1"],
            "--model-parallel needs 2 or more devices",
        ),
        (
            ["demo", "--model-parallel", "--micro-batches", "0"],
            "argument --micro-batches: must be an integer from 1 to 1024",
        ),
        (
            [
                "demo",
                "--model-parallel",
                "--micro-batches",
                "8",
                "--batch-size",
                "4",
            ],
            "--micro-batches 8 is larger than --batch-size 4",
        ),
        (
            ["demo", "--global-batch", "64", "--model-parallel"],
            "--global-batch cannot be combined with --model-parallel",
        ),
        (
            ["demo", "--model-parallel", "--micro-batches", "40"],
            "--micro-batches 40 is larger than --batch-size 32",
        ),
        (["demo", "--no-such-option"], "unrecognized arguments"),
        (["report"], "the following arguments are required: RUN.csv"),
    ],
)
def test_bad_options_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage: keras-mgpu" in err


def test_output_that_is_a_file_is_rejected(tmp_path, capsys):
    path = tmp_path / "taken"
    path.write_text("")
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--output", str(path)])
    assert exc.value.code == 2
    assert "is a file; give a folder" in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "info", "report"):
        assert command in out


@pytest.mark.backends("tensorflow")
def test_python_m_keras_mgpu_exit_code():
    # `python -m keras_mgpu` is `sys.exit(cli.main())`: the exit code and
    # message reach the shell. The options are parsed before a backend
    # starts, so one job runs this process.
    result = _run(["demo", "--epochs", "-3"], timeout=120)
    assert result.returncode == 2
    assert "argument --epochs: must be an integer" in result.stderr


# ----------------------------------------------------------------------
# info
# ----------------------------------------------------------------------
# What `info` prints on each backend (in this process: 4 CPU devices).
INFO_TEXTS = {
    "tensorflow": (
        "TensorFlow 2.",
        "Keras 3.",
        "flavour keras3",
        "Physical devices: CPU:0",
        # conftest.py split the CPU into 4 logical devices.
        "Logical devices:  CPU:0, CPU:1, CPU:2, CPU:3",
        "NVML:",
        "MirroredStrategy",
        "MultiWorkerMirroredStrategy  model.fit fails in Keras 3",
    ),
    "jax": (
        "Backend: jax (KERAS_BACKEND=jax)",
        "JAX 0.",
        "Keras 3.",
        "0 accelerator(s), 4 CPU device(s)",
        "DataParallel                 model.fit across the 4 CPU device(s)",
        "keras_mgpu components on jax (each one constructed here):",
        "  PowerSGD                       refuses: use "
        "GradientAccumulationOptimizer without compression",
        "  apply_placement                refuses: use "
        "keras.distribution.ModelParallel",
        "TensorFlow imported: ",
    ),
}


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for text in INFO_TEXTS[BACKEND]:
        assert text in out, out
    if BACKEND == "jax":
        assert "MirroredStrategy" not in out


@pytest.mark.backends("tensorflow")
def test_a_gpu_tensorflow_cannot_see_is_named_with_the_fix():
    note = cli_common.gpu_mismatch_note(nvml_gpus=2, tensorflow_gpus=0)
    assert "NVML sees 2 GPU(s) but TensorFlow sees none" in note
    assert 'pip install "tensorflow[and-cuda]"' in note
    assert cli_common.gpu_mismatch_note(2, 2) is None
    assert cli_common.gpu_mismatch_note(0, 0) is None


def test_the_command_is_a_package_of_one_module_per_command():
    import keras_mgpu.cli as package

    assert package.__file__.endswith("__init__.py")
    for command in ("demo", "info", "report"):
        module = __import__(f"keras_mgpu.cli.{command}", fromlist=["run"])
        assert callable(module.run) and callable(module.add_parser)


@pytest.mark.backends("tensorflow")
def test_strategy_lines_follow_flavour_and_gpus():
    keras3 = "\n".join(cli_info.strategy_lines(False, 0, 2))
    assert "across logical CPU devices" in keras3
    assert "keras#20585" in keras3
    assert "keras_mgpu.distribute.enable_multi_worker_fit()" in keras3
    assert "tested with this Keras" in keras3
    legacy = "\n".join(cli_info.strategy_lines(True, 4, 1))
    assert "model.fit across the 4 GPUs" in legacy
    assert "MultiWorkerMirroredStrategy  model.fit works (tf_keras)" in legacy


# ----------------------------------------------------------------------
# report
# ----------------------------------------------------------------------
def _write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def test_report_writes_png_next_to_csv(tmp_path, capsys):
    run = tmp_path / "run.csv"
    _write_csv(
        run,
        ["epoch", "loss", "accuracy", "learning_rate", "mystery"],
        [[0, 1.5, 0.4, 0.01, "a"], [1, 0.9, 0.7, 0.02, "b"]],
    )
    assert cli.main(["report", str(run)]) == 0
    png = tmp_path / "run.png"
    assert _is_png(png)
    assert f"Report: {png}" in capsys.readouterr().out

    other = tmp_path / "out" / "other.png"
    assert cli.main(["report", str(run), "-o", str(other)]) == 0
    assert _is_png(other)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("", "has no data rows"),
        ("epoch,foo\n0,1\n", "Found no column to plot"),
        ("epoch,loss\n0,1,7\n", "line 2 has 3 fields"),
    ],
)
def test_report_errors_exit_1(tmp_path, capsys, content, message):
    path = tmp_path / "run.csv"
    if content is not None:
        path.write_text(content)
    assert cli.main(["report", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("keras-mgpu report: error: ")
    assert message in err
    assert not (tmp_path / "run.png").exists()


def test_report_on_a_folder_and_missing_steps(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 1
    assert "is a folder, not a CSVLogger file" in capsys.readouterr().err
    run = tmp_path / "run.csv"
    _write_csv(run, ["epoch", "loss"], [[0, 1.0]])
    assert cli.main(["report", str(run), "--steps", "nope.csv"]) == 1
    assert "--steps nope.csv: no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------
# demo, end to end
# ----------------------------------------------------------------------
# The demo runs of the shared TensorFlow process: name, the test that reads
# it, its options, and the seconds it may take on the loaded 2-core machine.
DEMOS = {
    # First: its allocator figures drift with what ran before it.
    # A budget of 4 MB fits micro-batches of about 128 of the digits CNN
    # (TensorFlow's CPU allocator, oneDNN on in the demo's process): the
    # global batch of 512 on 2 replicas needs accumulation.
    "global_batch_by_memory": (
        "test_demo_global_batch_by_memory",
        ["--epochs", "1", "--global-batch", "512", "--memory-budget-mb", "4"],
        240,
    ),
    "main": (
        "test_demo_trains_across_two_logical_cpus",
        ["--epochs", str(DEMO_TEST_EPOCHS)],
        240,
    ),
    "every_component_off": (
        "test_demo_with_every_component_off",
        [
            "--epochs",
            "1",
            "--no-accumulation",
            "--no-warmup",
            "--no-scaling",
            "--no-monitors",
            "--no-recompute",
        ],
        180,
    ),
    "model_parallel": (
        "test_demo_model_parallel_splits_the_cnn_across_two_devices",
        ["--model-parallel", "--micro-batches", "4", "--epochs", "3"],
        240,
    ),
}
# The first test to ask for the shared runs waits for all of them.
DEMOS_TIMEOUT = pytest.mark.timeout(sum(d[2] for d in DEMOS.values()) + 60)
# The tests that read the main demo's run.
MAIN_DEMO_TESTS = {
    "test_demo_trains_across_two_logical_cpus",
    "test_demo_prints_progress_table_and_paths",
    "test_demo_files_and_report_from_its_csv",
}


@pytest.fixture(scope="module")
def demo_runs(request, tmp_path_factory) -> dict:
    """Runs the demos this session selected (a `-m "not slow"` run leaves
    the slow ones out), one after the other, each `--cpu` (2 logical
    CPU devices, with or without GPUs) with an output folder of its own;
    returns name: (output folder, result, summary)."""
    selected = {
        item.originalname
        for item in request.session.items
        if item.module is request.module
    }
    if selected & MAIN_DEMO_TESTS:
        selected.add(DEMOS["main"][0])
    runs, outputs = {}, {}
    for name, (test, options, _) in DEMOS.items():
        if test in selected:
            outputs[name] = tmp_path_factory.mktemp(name)
            argv = ["-m", "keras_mgpu", "demo", "--cpu", *options]
            runs[name] = ([*argv, "--output", str(outputs[name])], REPO_ROOT)
    results = run_shared(
        runs,
        tmp_path_factory.mktemp("shared"),
        # The demo turns oneDNN on (its CPU allocator statistics) where
        # the environment does not say; CI may say 0.
        env={
            "PYTHONPATH": REPO_ROOT,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_USE_LEGACY_KERAS": "0",
            "TF_ENABLE_ONEDNN_OPTS": "1",
        },
        timeout=sum(DEMOS[name][2] for name in runs),
    )
    return {name: (outputs[name], results[name]) for name in runs}


def _demo(demo_runs, name: str) -> tuple:
    """(output folder, result, summary) of demo run `name`, asserted to have
    exited with 0."""
    output, result = demo_runs[name]
    result.check(f"keras-mgpu demo ({name})")
    with open(output / "summary.json") as f:
        summary = json.load(f)
    return output, result, summary


@pytest.fixture
def demo_run(demo_runs):
    return _demo(demo_runs, "main")


@pytest.mark.backends("tensorflow")
@DEMOS_TIMEOUT
def test_demo_trains_across_two_logical_cpus(demo_run):
    output, result, summary = demo_run
    assert summary["device_kind"] == "CPU"
    assert summary["replicas"] == 2
    assert summary["global_batch_size"] == 32 * 2 * 2
    assert summary["accumulation_steps"] == 2
    # 1437 training images // 64 per micro-step = 22 micro-steps an epoch.
    assert summary["updates"] == DEMO_TEST_EPOCHS * 22 // 2
    # Linear scaling: 1e-3 at batch 32 -> x4 at 128, reached after warmup.
    assert summary["learning_rate"] == pytest.approx(4e-3)
    assert summary["final_learning_rate"] == pytest.approx(4e-3, rel=1e-5)
    assert summary["final_accuracy"] >= ACCURACY_THRESHOLD
    # ThroughputMonitor ran (monitors on) and its figures reach the table.
    from keras_mgpu import demo

    assert summary["throughput"]["samples_per_sec"] > 0
    assert "samples/s" in demo.format_summary(summary)


@pytest.mark.backends("tensorflow")
@DEMOS_TIMEOUT
def test_demo_prints_progress_table_and_paths(demo_run):
    output, result, summary = demo_run
    out = result.stdout
    epoch_lines = re.findall(r"^epoch +\d+/\d+  loss ", out, re.M)
    assert len(epoch_lines) == DEMO_TEST_EPOCHS, out
    for row in (
        "devices               2 x logical CPU device under MirroredStrategy",
        "global batch          128 = 32 per replica x 2 replicas x 2",
        "accumulation          2 micro-steps per update",
        "scaled learning rate  0.004 (= 0.001 x 128/32, linear rule)",
        "warmup                2 epochs, linear",
        "recompute             on",
        "final accuracy        ",
        "peak memory           ",
        "host process",
        "time                  ",
    ):
        assert row in out, out
    # Issue 31: on CPU only the process's peak RSS, labelled as such.
    assert "peak resident set size of this process" in out, out
    assert "TensorFlow allocator" not in out, out
    assert f"Report: {output / 'report.png'}" in out
    # TensorFlow's C++ notices went to the log file, not the terminal.
    assert (output / "tensorflow.log").exists()


def test_cpu_peak_memory_is_the_process_peak_rss_not_the_allocator():
    # Issue 31: TensorFlow's CPU allocator does not see oneDNN's buffers
    # (a run holding 812 MB read 2.0 MB there): the summary's CPU figure
    # is the process's peak resident set size, and says so.
    import resource

    from keras_mgpu import demo

    logs = {
        "mem/host_tf_peak_mb": [1.5, 2.0],
        "mem/host_tf_current_mb": [1.0, 1.0],
        "mem/host_rss_mb": [700.0, 812.0],
    }
    low = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = demo._peak_memory(logs, "CPU", ["CPU:0", "CPU:1"])
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert [r[0] for r in rows] == ["host process"]
    ((_, peak, what),) = rows
    assert low <= peak <= high  # this process's high-water mark
    assert what.startswith("peak resident set size of this process")
    summary = {
        "devices": ["CPU:0", "CPU:1"],
        "replicas": 2,
        "device_kind": "CPU",
        "per_replica_batch_size": 32,
        "accumulation_steps": 1,
        "global_batch_size": 64,
        "accumulation": False,
        "scaling": False,
        "learning_rate": 1e-3,
        "base_learning_rate": 1e-3,
        "base_batch_size": 32,
        "warmup_epochs": 0,
        "recompute": False,
        "updates": 4,
        "epochs": 1,
        "final_accuracy": 0.5,
        "test_images": 360,
        "final_train_accuracy": 0.6,
        "train_seconds": 1.0,
        "peak_memory": [
            {"device": d, "peak_mb": p, "what": w} for d, p, w in rows
        ],
    }
    try:
        text = demo.format_summary(summary)
    except KeyError as missing:  # the table's other rows need more keys
        pytest.fail(f"summary needs {missing}")
    assert f"host process: {peak:,.1f} MB (peak resident set size" in text
    assert "2.0 MB" not in text and "allocator" not in text


@pytest.mark.parametrize(
    "modules, environ, holders",
    [
        (
            {"tensorflow": 1},
            {},
            "TensorFlow, oneDNN, XLA and Python",
        ),
        (
            {"tensorflow": 1},
            {"TF_ENABLE_ONEDNN_OPTS": "0"},
            "TensorFlow, XLA and Python",
        ),
        ({"jax": 1}, {}, "JAX, XLA and Python"),
    ],
    ids=["tensorflow", "tensorflow-onednn-off", "jax"],
)
def test_host_memory_label_names_what_the_process_holds(
    modules, environ, holders
):
    """Issue 37: the label named TensorFlow and oneDNN on a JAX run that
    imports neither."""
    from keras_mgpu import demo

    assert demo._process_holders(modules, environ) == holders


@pytest.mark.backends("tensorflow")
@DEMOS_TIMEOUT
def test_demo_files_and_report_from_its_csv(demo_run, tmp_path):
    output, _, summary = demo_run
    assert _is_png(output / "report.png")
    with open(output / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == DEMO_TEST_EPOCHS
    keys = set(rows[0])
    assert {"loss", "accuracy", "val_accuracy", "learning_rate"} <= keys
    assert "mem/host_rss_mb" in keys
    assert any(k.startswith("cpu/") for k in keys)  # no GPU: CPU load
    # The warmup ramp, one row per micro-step after a first row at step 0.
    with open(output / "history_steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert len(steps) == 1 + DEMO_TEST_EPOCHS * 22
    assert float(steps[0]["learning_rate"]) == 0.0
    assert float(steps[-1]["learning_rate"]) == pytest.approx(4e-3, rel=1e-5)
    # `keras-mgpu report` redraws the demo's report from its own CSV.
    again = tmp_path / "again.png"
    assert (
        cli.main(["report", str(output / "history.csv"), "-o", str(again)]) == 0
    )
    assert _is_png(again)


@pytest.mark.backends("tensorflow")
@DEMOS_TIMEOUT
def test_demo_with_every_component_off(demo_runs):
    tmp_path, result, summary = _demo(demo_runs, "every_component_off")
    assert summary["accumulation_steps"] == 1
    assert summary["global_batch_size"] == 64
    assert summary["updates"] == 22
    assert summary["learning_rate"] == pytest.approx(1e-3)
    assert summary["final_learning_rate"] == pytest.approx(1e-3, rel=1e-5)
    assert summary["recompute"] is False
    assert summary["peak_memory"] == []
    assert "scaled learning rate  0.001 (scaling off)" in result.stdout
    assert "accumulation          off" in result.stdout
    with open(tmp_path / "history.csv") as f:
        header = next(csv.reader(f))
    assert not any(k.startswith(("mem/", "cpu/", "gpu/")) for k in header)
    assert _is_png(tmp_path / "report.png")


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
@DEMOS_TIMEOUT
def test_demo_global_batch_by_memory(demo_runs):
    _, result, summary = _demo(demo_runs, "global_batch_by_memory")
    found = summary["batch_by_memory"]
    batch, steps = (
        summary["per_replica_batch_size"],
        summary["accumulation_steps"],
    )
    assert batch * 2 * steps == summary["global_batch_size"] == 512
    assert steps > 1 and batch <= found["largest_batch_size"]
    assert found["measured_peak_mb"] <= found["budget_mb"] == 4.0
    assert summary["learning_rate"] == pytest.approx(1e-3 * 512 / 32)
    out = result.stdout
    assert found["explanation"] in out
    assert "One training step of 'digits_cnn'" in out
    assert f"largest micro-batch {found['largest_batch_size']}" in out
    assert "batch by memory" in out


@pytest.mark.backends("tensorflow")
def test_demo_global_batch_larger_than_the_data():
    from keras_mgpu import demo

    config = demo.DemoConfig(output_dir="", global_batch_size=5000)
    with pytest.raises(
        ValueError,
        match="--global-batch 5000 is larger than the 1437 training images: "
        "use at most 1437",
    ):
        demo._batch_by_memory(
            config, demo.tf.distribute.get_strategy(), demo.load_digits_split()
        )


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
@DEMOS_TIMEOUT
def test_demo_model_parallel_splits_the_cnn_across_two_devices(demo_runs):
    _, result, summary = _demo(demo_runs, "model_parallel")
    assert summary["model_parallel"] is True and summary["replicas"] == 1
    assert summary["micro_batches"] == 4
    stages = [row for row in summary["placement"] if row["stage"] is not None]
    assert [row["device"] for row in stages] == [
        "/device:CPU:0",
        "/device:CPU:1",
    ]
    assert sum(row["params"] for row in stages) == 47530  # the whole CNN
    # Measured: 0.886 after 3 epochs (seed 0); the mirrored demo reaches
    # 0.95 after 5.
    assert summary["final_accuracy"] >= 0.8
    out = result.stdout
    assert "split across 2 logical CPU devices" in out
    assert (
        "model split into 2 stages on 2 x logical CPU device, 4 "
        "micro-batches per step" in out
    )
    assert "placement             CPU:0: conv2d, recompute_conv_block" in out


# ----------------------------------------------------------------------
# The JAX backend
# ----------------------------------------------------------------------
@pytest.mark.backends("jax")
def test_info_lines_from_a_given_component_table():
    rows = [
        ("LearningRateWarmup", True, ""),
        ("PowerSGD", False, "PowerSGD does not ... On jax, use X instead."),
        ("MemoryMonitor", False, f"{_components.FAILED} (ImportError: tf)"),
    ]
    text = "\n".join(cli_info.jax_lines(rows))
    assert "  LearningRateWarmup  works" in text
    assert "  PowerSGD            refuses: use X instead" in text
    assert "  MemoryMonitor       ERROR: failed at construction (Import" in text


def test_components_that_refuse_are_skipped_with_the_reason(monkeypatch):
    from keras_mgpu import demo as demo_module

    probes = _components._probes()

    def refuse():
        raise BackendNotSupportedError("MemoryMonitor does not support jax")

    probes["MemoryMonitor"] = refuse
    monkeypatch.setattr(_components, "_probes", lambda: probes)
    config = demo_module.drop_refused_components(
        demo_module.DemoConfig(output_dir="unused")
    )
    assert config.skipped == {
        "MemoryMonitor": "MemoryMonitor does not support jax"
    }
    assert config.monitors  # GPULoadMonitor constructs: monitors stay on
    probes["GPULoadMonitor"] = refuse
    probes["ThroughputMonitor"] = refuse
    config = demo_module.drop_refused_components(
        demo_module.DemoConfig(output_dir="unused")
    )
    assert not config.monitors and len(config.skipped) == 3


@pytest.mark.backends("jax")
def test_tensorflow_only_demo_options_refuse_on_jax(tmp_path, capsys):
    for option, instead in (
        (["--model-parallel"], "keras.distribution.ModelParallel"),
        (["--global-batch", "256"], "--batch-size and --accumulation-steps"),
    ):
        assert cli.main(["demo", *option, "--output", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("keras-mgpu demo: error: ")
        assert instead in err


@pytest.mark.slow
@pytest.mark.backends("jax")
def test_demo_trains_under_data_parallel_without_tensorflow(tmp_path):
    args = ["demo", "--cpu", "--devices", "2", "--epochs", "1"]
    args += NOT_YET_ON_JAX
    if "--no-warmup" not in NOT_YET_ON_JAX:
        args += ["--warmup-epochs", "0.25"]  # one epoch: a short ramp
    result = _run(
        [*args, "--output", str(tmp_path)],
        timeout=300,
        env={"KERAS_BACKEND": "jax"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert (
        "keras.distribution.DataParallel (JAX backend) on 2 CPU devices" in out
    )
    assert "backend               jax (JAX 0." in out
    assert (
        "devices               2 x CPU device under keras.distribution" in out
    )
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["backend"] == "jax"
    assert summary["distribution"] == "keras.distribution.DataParallel"
    assert summary["replicas"] == 2
    # 1437 images // 64 per step = 22 steps of whole batches.
    assert summary["train_images"] == 22 * 64
    assert summary["updates"] == 22 // summary["accumulation_steps"]
    assert summary["skipped"] == {}
    assert summary["tensorflow_imported"] is False
    # Issue 37: the process's memory is labelled by what it holds.
    (host,) = [
        r for r in summary["peak_memory"] if r["device"] == "host process"
    ]
    assert host["what"].endswith("high-water mark: JAX, XLA and Python)")
    assert "TensorFlow" not in out and "oneDNN" not in out
    assert summary["final_accuracy"] > 0.5  # 10 classes; 0.73 measured
    with open(tmp_path / "report.png", "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert (tmp_path / "jax.log").exists()
