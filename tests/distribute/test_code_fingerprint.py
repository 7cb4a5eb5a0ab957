"""The fingerprint behind the Keras-code guard of multi-worker fit
(`keras_mgpu/_code_fingerprint.py`) is the same on every Python,
and the measuring script (`tools/keras_fingerprints.py`) agrees with the
guard on the installed Keras."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from keras_mgpu import _code_fingerprint
from keras_mgpu.distribute import _keras_trainer_patch

_ROOT = Path(__file__).resolve().parents[2]

# A method as `inspect.getsource` returns it: indented, decorated, with a
# docstring, defaults, annotations, keyword-only arguments, a lambda and
# f-strings (parsed anew in Python 3.12).
SNIPPET = '''
    @staticmethod
    def scaled(values: list[float], factor: float = 2.0, *, name=None):
        """Scale `values`.

        Indented docstring.
        """
        # A comment.
        scale = lambda v, k=factor: v * k  # noqa: E731
        label = f"{name!r:>10}: {len(values)} values" if name else ""
        return [scale(v) for v in values if v is not None], label
'''
SNIPPET_FINGERPRINT = "8364a05bf7a76043"

# The interpreter (run in a subprocess, isolated from this environment)
# prints the dump and the fingerprint of the snippet read from stdin.
_PRINT_DUMP = """
import ast, importlib.util, sys, textwrap
spec = importlib.util.spec_from_file_location("fingerprint", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
source = sys.stdin.read()
print(sys.version_info[0], sys.version_info[1])
print(module.portable_dump(ast.parse(textwrap.dedent(source))))
print(module.source_fingerprint(source))
"""


def _dump(source: str) -> str:
    return _code_fingerprint.portable_dump(ast.parse(textwrap.dedent(source)))


def test_the_fingerprint_of_a_fixed_function():
    assert _code_fingerprint.source_fingerprint(SNIPPET) == (
        SNIPPET_FINGERPRINT
    )
    # Blind to the docstring, comments, layout and indentation.
    relaid = (
        SNIPPET.replace("Scale `values`.", "Another docstring.")
        .replace("# A comment.", "")
        .replace("factor: float = 2.0", "factor: float=2.0")
        .replace("\n    ", "\n")
    )
    assert _code_fingerprint.source_fingerprint(relaid) == (SNIPPET_FINGERPRINT)
    changed = SNIPPET.replace("= 2.0", "= 3.0")
    assert _code_fingerprint.source_fingerprint(changed) != (
        SNIPPET_FINGERPRINT
    )


@pytest.mark.parametrize("minor", [10, 11, 12, 13])
def test_the_fingerprint_is_the_same_on_every_python(minor):
    """`ast.dump` differs between Pythons (3.12 adds `type_params=[]`, 3.13
    leaves out None and empty fields): the fingerprints measured on one
    must hold on all. Runs every python3.10-3.13 found on PATH."""
    executable = shutil.which(f"python3.{minor}")
    if executable is None:
        pytest.skip(f"python3.{minor} is not on PATH")
    path = _ROOT / "keras_mgpu" / "_code_fingerprint.py"
    result = subprocess.run(
        [executable, "-I", "-c", _PRINT_DUMP, str(path)],
        input=SNIPPET,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:
        probe = subprocess.run(
            [executable, "-c", "pass"], capture_output=True, timeout=60
        )
        if probe.returncode != 0:
            # e.g. a pyenv shim of a version PYENV_VERSION does not select.
            reason = probe.stderr.decode(errors="replace").strip()
            pytest.skip(f"python3.{minor} on PATH does not run: {reason}")
    assert result.returncode == 0, result.stderr[-3000:]
    version, dump, fingerprint = result.stdout.splitlines()
    assert version == f"3 {minor}"
    assert dump == _dump(SNIPPET)
    assert fingerprint == SNIPPET_FINGERPRINT


def _measuring_script():
    path = _ROOT / "tools" / "keras_fingerprints.py"
    spec = importlib.util.spec_from_file_location("keras_fingerprints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_measuring_script_agrees_with_the_guard():
    """tools/keras_fingerprints.py reads the sources without importing
    Keras; on the installed Keras it finds what the guard finds."""
    import keras

    script = _measuring_script()
    assert list(script.TARGETS) == list(_keras_trainer_patch.KNOWN_FINGERPRINTS)
    installed = Path(keras.__file__).resolve().parent.parent
    version, measured = script.fingerprints(str(installed))
    assert version == keras.version()
    live = {
        name: _keras_trainer_patch._fingerprint(function)
        for name, function in _keras_trainer_patch._relied_on().items()
    }
    assert {name: measured[name] for name in live} == live
    assert all(
        live[name] in known
        for name, known in _keras_trainer_patch.KNOWN_FINGERPRINTS.items()
    )


def test_the_installed_keras_has_the_code_the_jax_per_device_step_reads():
    """The JAX per-device step's guard (`reduction="per_update"`) and the
    script name the same functions, and the installed Keras's code of each
    is known (read from the sources: no JAX needed). Fails when a Keras
    release changes that code: read it, then add its fingerprints."""
    import keras

    from keras_mgpu.backend.jax import reduction

    script = _measuring_script()
    assert list(script.JAX_STEP_TARGETS) == list(reduction.KNOWN_FINGERPRINTS)
    installed = Path(keras.__file__).resolve().parent.parent
    _, measured = script.fingerprints(str(installed))
    unknown = {
        name: measured[name]
        for name, known in reduction.KNOWN_FINGERPRINTS.items()
        if measured[name] not in known
    }
    assert not unknown, unknown


def test_the_measuring_script_prints_each_fingerprint_with_its_releases(
    capsys,
):
    import keras

    installed = Path(keras.__file__).resolve().parent.parent
    assert _measuring_script().main([str(installed)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Keras {keras.version()}"
    known = _keras_trainer_patch.KNOWN_FINGERPRINTS["reduce_per_replica"]
    (fingerprint,) = known
    assert lines[lines.index("reduce_per_replica") + 1] == (
        f"    {fingerprint}: {keras.version()}"
    )


# What tools/keras_fingerprints.py printed for keras-nightly
# 3.16.0.dev2026102704 (tf-nightly 2.23.0.dev20261026) and Keras 3.15.1.
_NIGHTLY_3_16 = {
    "TensorFlowTrainer._maybe_symbolic_build": "51d8321613a24862",
    "reduce_per_replica": "bcd78e0928f53e77",
    "TFEpochIterator.__init__": "e86167fe76e447cf",
    "TFEpochIterator._get_iterator": "4180c4cf031ef71a",
    "EpochIterator._enumerate_iterator": "7926cc678a88b4f1",
    "ArrayDataAdapter.get_tf_dataset": "b387ead5cdfd86f3",
    "GeneratorDataAdapter.get_tf_dataset": "4335dd58d1f758d2",
    "PyDatasetAdapter.get_tf_dataset": "00690f138574376e",
    "PyDatasetAdapter._get_iterator": "23bb3827a76421ad",
    "PyDatasetAdapter._finite_generator": "42ed7159fd3d9b58",
    "PyDatasetAdapter._infinite_generator": "323781156ca657bb",
    "PyDatasetAdapter._finite_enqueuer_generator": "f1ed4a4e96592815",
    "PyDatasetAdapter._infinite_enqueuer_generator": "8a8a6ea3cf7f2bdc",
}
_KERAS_3_15 = {
    **_NIGHTLY_3_16,
    "ArrayDataAdapter.get_tf_dataset": "6e5fa8ba2cacd27c",
    "PyDatasetAdapter._finite_generator": "1b922f883b3c485f",
    "PyDatasetAdapter._infinite_generator": "45a2cf7b7785e6d3",
    "PyDatasetAdapter._finite_enqueuer_generator": "526943d7ab2f62df",
    "PyDatasetAdapter._infinite_enqueuer_generator": "4d00c9c7afa49883",
}


def test_the_stored_table_accepts_the_keras_3_16_nightly():
    """The fingerprints of keras-nightly 3.16.0.dev2026102704 are in the
    table (no nightly needed to check it), each labelled with it, and they
    make up that release; 3.15's still make up 3.12-3.15."""
    known = _keras_trainer_patch.KNOWN_FINGERPRINTS
    assert set(_NIGHTLY_3_16) == set(known)
    nightly = _keras_trainer_patch.NIGHTLY
    assert nightly == "3.16.0.dev2026102704"
    for name, fingerprint in _NIGHTLY_3_16.items():
        assert nightly in known[name].get(fingerprint, ""), name
    assert _keras_trainer_patch.release_of(_NIGHTLY_3_16) == nightly
    assert _keras_trainer_patch.release_of(_KERAS_3_15) == "3.12-3.15"
    # A mix no release has, and an unknown fingerprint: no release.
    mixed = {
        **_KERAS_3_15,
        "ArrayDataAdapter.get_tf_dataset": "b387ead5cdfd86f3",
    }
    assert _keras_trainer_patch.release_of(mixed) is None
    unknown = {**_NIGHTLY_3_16, "reduce_per_replica": "0" * 16}
    assert _keras_trainer_patch.release_of(unknown) is None


def test_the_measuring_script_finds_the_renamed_trainer_class():
    """Keras 3.16's trainer.py defines `Trainer`, not `TensorFlowTrainer`:
    the script fingerprints its `_maybe_symbolic_build` under the table's
    name, the same as under the old class name."""
    script = _measuring_script()
    method = (
        "    def _maybe_symbolic_build(self, iterator=None):\n        pass\n"
    )
    old = f"class TensorFlowTrainer(base):\n{method}"
    new = f"class Trainer(base):\n{method}"
    name = "TensorFlowTrainer._maybe_symbolic_build"
    assert script.definition_source(new, name) == (
        script.definition_source(old, name)
    )
    with pytest.raises(LookupError, match="TensorFlowTrainer or Trainer"):
        script.definition_source("class Other:\n    pass\n", name)
