"""Fingerprints of the private Keras functions keras_mgpu replaces or relies on.

Prints, for every name in the two guards' `KNOWN_FINGERPRINTS`
(keras_mgpu/distribute/_keras_trainer_patch.py: multi-worker fit, `TARGETS`;
keras_mgpu/backend/jax/reduction.py: the JAX per-device step,
`JAX_STEP_TARGETS`), each fingerprint found and the Keras releases that
have it. It imports neither Keras nor keras_mgpu
(it reads the sources and loads keras_mgpu/_code_fingerprint.py
by path), so any Python 3.10+ runs it, with or without TensorFlow, and
every Python must print the same table.

For a new Keras release:

    pip download keras==3.17.0 --no-deps -d /tmp/kw
    for py in python3.10 python3.11 python3.12 python3.13; do
        $py tools/keras_fingerprints.py /tmp/kw/keras-*.whl > /tmp/fp-$py.txt
    done
    md5sum /tmp/fp-*.txt   # one table on every Python

then read the release's changed functions (keras_mgpu relies on what the
comments of `KNOWN_FINGERPRINTS` say), adapt the patch if needed, and add
the new fingerprints with their releases. An argument is a Keras wheel, or a
folder holding `keras/src` (an unzipped wheel, a site-packages).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import zipfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_TRAINER = "backend/tensorflow/trainer.py"
_PY_DATASET = "trainers/data_adapters/py_dataset_adapter.py"
# The names of `KNOWN_FINGERPRINTS` and the files (under keras/src) that
# define them.
TARGETS = {
    "TensorFlowTrainer._maybe_symbolic_build": _TRAINER,
    "reduce_per_replica": _TRAINER,
    "TFEpochIterator.__init__": _TRAINER,
    "TFEpochIterator._get_iterator": _TRAINER,
    "EpochIterator._enumerate_iterator": "trainers/epoch_iterator.py",
    "ArrayDataAdapter.get_tf_dataset": (
        "trainers/data_adapters/array_data_adapter.py"
    ),
    "GeneratorDataAdapter.get_tf_dataset": (
        "trainers/data_adapters/generator_data_adapter.py"
    ),
    **{
        f"PyDatasetAdapter.{name}": _PY_DATASET
        for name in (
            "get_tf_dataset",
            "_get_iterator",
            "_finite_generator",
            "_infinite_generator",
            "_finite_enqueuer_generator",
            "_infinite_enqueuer_generator",
        )
    },
}


# The names of the JAX per-device step's `KNOWN_FINGERPRINTS`
# (keras_mgpu/backend/jax/reduction.py) and their files.
JAX_STEP_TARGETS = {
    **{
        f"JAXTrainer.{name}": "backend/jax/trainer.py"
        for name in (
            "train_step",
            "compute_loss_and_updates",
            "_update_metrics_variables",
            "make_train_function",
        )
    },
    "unpack_x_y_sample_weight": "trainers/data_adapters/data_adapter_utils.py",
}
ALL_TARGETS = {**TARGETS, **JAX_STEP_TARGETS}


# Classes renamed between releases: the name `KNOWN_FINGERPRINTS` uses, and
# the names tried in order (each backend's trainer is `Trainer` from Keras
# 3.16: keras_mgpu.distribute._keras_trainer_patch.TRAINER_CLASS_NAMES,
# keras_mgpu.backend.jax.reduction.TRAINER_CLASS_NAMES).
CLASS_NAMES = {
    "TensorFlowTrainer": ("TensorFlowTrainer", "Trainer"),
    "JAXTrainer": ("JAXTrainer", "Trainer"),
}


def _load_fingerprint_module():
    path = _ROOT / "keras_mgpu" / "_code_fingerprint.py"
    spec = importlib.util.spec_from_file_location("_code_fingerprint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def definition_source(source: str, dotted: str) -> str:
    """The lines of `dotted` ("Class.method" or "function") in `source`,
    decorators first, as `inspect.getsource` returns them."""
    node = ast.parse(source)
    for depth, part in enumerate(dotted.split(".")):
        names = CLASS_NAMES.get(part, (part,)) if depth == 0 else (part,)
        for name in names:
            found = [
                child
                for child in node.body
                if isinstance(
                    child,
                    (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef),
                )
                and child.name == name
            ]
            if found:
                break
        if len(found) != 1:
            raise LookupError(
                f"{len(found)} definitions named {' or '.join(names)}"
            )
        node = found[0]
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = source.splitlines(keepends=True)
    return "".join(lines[first - 1 : node.end_lineno])


def _read_release(location: str) -> tuple[str, dict[str, str]]:
    """(Keras version, {path under keras/src: source}) of a wheel or of a
    folder holding keras/src."""
    files = sorted(set(ALL_TARGETS.values())) + ["version.py"]
    path = Path(location)
    if path.is_dir():
        sources = {
            name: (path / "keras" / "src" / name).read_text(encoding="utf-8")
            for name in files
        }
    else:
        with zipfile.ZipFile(path) as wheel:
            sources = {
                name: wheel.read(f"keras/src/{name}").decode("utf-8")
                for name in files
            }
    version = re.search(
        r"""^__version__\s*=\s*["']([^"']+)["']""",
        sources["version.py"],
        re.MULTILINE,
    )
    return (version.group(1) if version else location), sources


def fingerprints(location: str) -> tuple[str, dict[str, str]]:
    """(Keras version, {name: fingerprint}) of one wheel or folder, for
    every name of `ALL_TARGETS`; a function that is gone reads
    "missing (...)"."""
    fingerprint = _load_fingerprint_module().source_fingerprint
    version, sources = _read_release(location)
    found = {}
    for name, file in ALL_TARGETS.items():
        try:
            found[name] = fingerprint(definition_source(sources[file], name))
        except LookupError as exc:
            found[name] = f"missing ({exc})"
    return version, found


def _release_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in version.split("."))


def main(locations: list[str]) -> int:
    if not locations:
        print(__doc__, file=sys.stderr)
        return 2
    measured = dict(fingerprints(location) for location in locations)
    versions = sorted(measured, key=_release_key)
    print(f"Keras {', '.join(versions)}")
    for name in ALL_TARGETS:
        print(name)
        releases: dict[str, list[str]] = {}
        for version in versions:
            releases.setdefault(measured[version][name], []).append(version)
        for fingerprint, have in releases.items():
            print(f"    {fingerprint}: {', '.join(have)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
