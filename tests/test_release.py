"""The release artefacts: the sdist and wheel build, pass `twine check`, and
the wheel installed into a fresh virtual environment gives a working
`keras-mgpu info` and registers the pytest plugin."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
import venv

import pytest
from _processes import REPO_ROOT

pytestmark = pytest.mark.slow


def _run(cmd, cwd=None, timeout=600):
    # No PYTHONPATH: the fresh venv must see only what the wheel installed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, (
        f"{cmd} exited with {result.returncode}\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    pytest.importorskip("build", reason="needs the test extra (build)")
    out = tmp_path_factory.mktemp("dist")
    _run(
        [
            sys.executable,
            "-m",
            "build",
            "--sdist",
            "--wheel",
            "--outdir",
            str(out),
            REPO_ROOT,
        ],
        timeout=600,
    )
    return out


def test_the_sdist_and_wheel_pass_twine_check(dist):
    pytest.importorskip("twine", reason="needs the test extra (twine)")
    files = sorted(glob.glob(str(dist / "*")))
    assert any(f.endswith(".whl") for f in files), files
    assert any(f.endswith(".tar.gz") for f in files), files
    out = _run([sys.executable, "-m", "twine", "check", "--strict", *files])
    assert out.count("PASSED") == 2, out


def test_the_wheel_installs_in_a_fresh_venv_and_runs_info(dist, tmp_path):
    from keras_mgpu import __version__

    wheel = glob.glob(str(dist / "*.whl"))[0]
    assert f"-{__version__}-" in os.path.basename(wheel)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    # The wheel's dependencies come from this test environment, listed on
    # the new environment's path after its own site-packages (a `.pth`
    # file; the `.pth` files of this environment, among them keras_mgpu's
    # editable install, are not read from there): pip checks that every
    # requirement of the wheel is met and installs the wheel alone
    # (`--no-index`), instead of copying TensorFlow into a new venv (~1 min
    # of CI). keras_mgpu itself is imported from the wheel's files.
    paths = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = _run([python, "-c", paths]).strip()
    here = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    with open(os.path.join(purelib, "_test_environment.pth"), "w") as f:
        f.write("\n".join(sorted(here)) + "\n")
    _run(
        [python, "-m", "pip", "install", "-q", "--no-index", wheel],
        timeout=900,
    )
    location = _run(
        [python, "-c", "import keras_mgpu; print(keras_mgpu.__file__)"],
        cwd=tmp_path,
    )
    assert location.startswith(purelib), location
    out = _run([str(env_dir / "bin" / "keras-mgpu"), "info"], cwd=tmp_path)
    assert f"keras-mgpu {__version__}" in out
    assert "MultiWorkerMirroredStrategy" in out
    # The pytest plugin is registered, and inactive until asked.
    out = _run([python, "-m", "pytest", "--version"], cwd=tmp_path)
    # Read from the wheel's own metadata (the first `keras-mgpu` on the
    # path; this environment's editable install comes after it).
    plugins = _run(
        [
            python,
            "-c",
            (
                "import importlib.metadata as m, keras_mgpu_pytest;"
                "d = m.distribution('keras-mgpu');"
                "print(d.locate_file(''), keras_mgpu_pytest.__file__);"
                "print([e.value for e in d.entry_points "
                "if e.group == 'pytest11'])"
            ),
        ],
        cwd=tmp_path,
    )
    where, registered = plugins.strip().splitlines()
    assert all(path.startswith(purelib) for path in where.split()), where
    assert registered == "['keras_mgpu_pytest']", registered
