"""`keras-mgpu info` and `keras-mgpu demo` on Keras's JAX backend: the
backend, JAX and its devices, which components run on JAX, and the demo
under `keras.distribution.DataParallel` without TensorFlow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from keras_mgpu import _components, cli
from keras_mgpu import demo as demo_module
from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.cli import info as cli_info

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Components the end-to-end demo test turns off on JAX: none (each one
# works there or refuses at construction, which the demo reports).
NOT_YET_ON_JAX: list[str] = []


def _run(args: list, timeout: float, env=None):
    return subprocess.run(
        [sys.executable, "-m", "keras_mgpu", *args],
        cwd=REPO_ROOT,
        env={
            **os.environ,
            "PYTHONPATH": REPO_ROOT,
            "KERAS_BACKEND": "jax",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_info_names_jax_its_devices_and_the_components():
    result = _run(["info"], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for text in (
        "Backend: jax (KERAS_BACKEND=jax)",
        "JAX 0.",
        "Keras 3.",
        # This process's XLA_FLAGS (4 CPU devices) reach the command.
        "0 accelerator(s), 4 CPU device(s)",
        "DataParallel                 model.fit across the 4 CPU device(s)",
        "keras_mgpu components on jax (each one constructed here):",
        "  PowerSGD                       refuses: use "
        "GradientAccumulationOptimizer without compression",
        "  apply_placement                refuses: use "
        "keras.distribution.ModelParallel",
        "TensorFlow imported: ",
    ):
        assert text in out, out
    assert "MirroredStrategy" not in out


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
def test_demo_trains_under_data_parallel_without_tensorflow(tmp_path):
    args = ["demo", "--cpu", "--devices", "2", "--epochs", "1"]
    args += NOT_YET_ON_JAX
    if "--no-warmup" not in NOT_YET_ON_JAX:
        args += ["--warmup-epochs", "0.25"]  # one epoch: a short ramp
    result = _run([*args, "--output", str(tmp_path)], timeout=300)
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
