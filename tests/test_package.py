"""The package itself: imports, optional dependencies, public API."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_BLOCK_OPTIONAL = (
    "import sys\n"
    "for name in ('pynvml', 'tensorflow_model_optimization', 'tf_keras',\n"
    "             'matplotlib', 'sklearn'):\n"
    "    sys.modules[name] = None  # import raises ImportError\n"
)


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
    )


def test_import_needs_no_optional_dependency_and_extras_are_named():
    code = _BLOCK_OPTIONAL + (
        "import keras_mgpu\n"
        "from keras_mgpu import callbacks, layers, schedules\n"
        "from keras_mgpu._flavour import FLAVOUR; print('imported', FLAVOUR)\n"
        "try:\n"
        "    from keras_mgpu.report import plot_training_report\n"
        "    plot_training_report({'loss': [1.0, 0.5]}, '/tmp/x.png')\n"
        "except ImportError as exc:\n"
        "    print('plot:', exc)\n"
        "try:\n"
        "    from keras_mgpu.callbacks.pruning_step_sync import "
        "_prune_low_magnitude_class\n"
        "    _prune_low_magnitude_class()\n"
        "except ImportError as exc:\n"
        "    print('tfmot:', exc)\n"
        "from keras_mgpu.monitoring import NvmlBackend, BackendUnavailable\n"
        "try:\n"
        "    NvmlBackend().open()\n"
        "except BackendUnavailable as exc:\n"
        "    print('gpu:', exc)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imported keras3" in result.stdout
    assert "keras-mgpu[plot]" in result.stdout
    assert "keras-mgpu[tfmot]" in result.stdout
    assert "keras-mgpu[gpu]" in result.stdout


def test_legacy_flavour_without_tf_keras_names_the_extra():
    # `import keras_mgpu` is lazy; the first component used loads the flavour.
    code = _BLOCK_OPTIONAL + (
        "import keras_mgpu\nkeras_mgpu.GradientAccumulationOptimizer\n"
    )
    result = _python(code, env={"TF_USE_LEGACY_KERAS": "1"})
    assert result.returncode != 0
    assert "keras-mgpu[tfmot]" in result.stderr


def test_core_dependencies_pull_no_extra():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = {
        d.split(">")[0].split("=")[0].split("<")[0].strip()
        for d in project["dependencies"]
    }
    assert names == {"keras", "tensorflow", "numpy", "psutil"}
    extras = project["optional-dependencies"]
    assert "nvidia-ml-py" in " ".join(extras["gpu"])
    assert "tensorflow-model-optimization" in " ".join(extras["tfmot"])
    assert "matplotlib" in " ".join(extras["plot"])


def test_public_api():
    import keras_mgpu

    for name in keras_mgpu.__all__:
        assert hasattr(keras_mgpu, name), name
    from keras_mgpu import callbacks

    for name in (
        "LearningRateWarmup",
        "LearningRateScaler",
        "MemoryMonitor",
        "GPULoadMonitor",
    ):
        assert name in callbacks.__all__


def test_registered_names():
    from keras_mgpu._flavour import keras

    registered = keras.saving.get_custom_objects()
    for name in ("GradientAccumulationOptimizer", "Warmup", "RecomputeGrad"):
        assert f"keras_mgpu>{name}" in registered


def test_flavour_switch_reads_tensorflows_variable():
    from keras_mgpu._flavour import legacy_keras_requested

    assert legacy_keras_requested({"TF_USE_LEGACY_KERAS": "1"})
    assert legacy_keras_requested({"TF_USE_LEGACY_KERAS": "True"})
    assert not legacy_keras_requested({"TF_USE_LEGACY_KERAS": "0"})
    assert not legacy_keras_requested({})


def test_mixing_flavours_is_a_clear_error():
    import tf_keras

    from keras_mgpu._flavour import check_flavour

    with pytest.raises(TypeError, match=r"`model` is a tf_keras object"):
        check_flavour(tf_keras.Sequential(), "model")


def test_monitoring_backends_need_no_framework():
    # NVML, psutil and the sampling thread work without TensorFlow (see
    # benchmarks/check_nvml.py, run on GPU machines without TensorFlow).
    code = (
        "import sys\n"
        "from keras_mgpu.monitoring import NvmlBackend, Sampler, HostBackend\n"
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "False"]
