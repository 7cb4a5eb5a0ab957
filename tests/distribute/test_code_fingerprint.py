"""The fingerprint behind the Keras-code guard of multi-worker fit
(`keras_mgpu/distribute/_code_fingerprint.py`) is the same on every Python,
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

from keras_mgpu.distribute import _code_fingerprint, _keras_trainer_patch

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
    path = _ROOT / "keras_mgpu" / "distribute" / "_code_fingerprint.py"
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
    assert measured == live
    assert all(
        live[name] in known
        for name, known in _keras_trainer_patch.KNOWN_FINGERPRINTS.items()
    )


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
