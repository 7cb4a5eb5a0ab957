"""The public API, names and signatures, is listed in `public_api.txt`: a
change to it is deliberate (update the file, add a CHANGELOG line).

`python tests/test_public_api.py --update` rewrites the list.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

LISTING = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "public_api.txt"
)
PACKAGES = (
    "keras_mgpu",
    "keras_mgpu.backend",
    "keras_mgpu.batch_size",
    "keras_mgpu.callbacks",
    "keras_mgpu.compression",
    "keras_mgpu.distribute",
    "keras_mgpu.layers",
    "keras_mgpu.monitoring",
    "keras_mgpu.normalization",
    "keras_mgpu.optimizers",
    "keras_mgpu.placement",
    "keras_mgpu.schedules",
    "keras_mgpu.sharding",
    "keras_mgpu.testing",
)


def _describe(qualified: str, value: object) -> str:
    if inspect.ismodule(value):
        return f"{qualified}: module"
    if inspect.isclass(value):
        try:
            signature = str(inspect.signature(value.__init__))
            signature = signature.replace("(self, ", "(").replace(
                "(self)", "()"
            )
        except (TypeError, ValueError):
            signature = "(...)"
        kind = "exception" if issubclass(value, BaseException) else "class"
        return f"{qualified}: {kind}{signature}"
    if callable(value):
        return f"{qualified}: function{inspect.signature(value)}"
    return f"{qualified}: {type(value).__name__}"


def public_api() -> list[str]:
    lines = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in sorted(module.__all__):
            value = getattr(module, name)
            lines.append(_describe(f"{package}.{name}", value))
    return lines


def test_the_public_api_is_the_listed_one():
    with open(LISTING) as f:
        listed = f.read().splitlines()
    current = public_api()
    added = sorted(set(current) - set(listed))
    removed = sorted(set(listed) - set(current))
    assert not added and not removed, (
        "The public API changed. If that is deliberate, run "
        "`python tests/test_public_api.py --update`, add a CHANGELOG line "
        "(and a deprecation alias for a renamed argument).\n"
        + "".join(f"\n+ {line}" for line in added)
        + "".join(f"\n- {line}" for line in removed)
    )


def test_nothing_private_is_public():
    for line in public_api():
        parts = line.split(":")[0].split(".")[1:]
        assert not any(
            p.startswith("_") and not p.startswith("__") for p in parts
        ), line


def test_every_public_name_has_a_docstring():
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if name.startswith("__") or not callable(value):
                continue
            assert (value.__doc__ or "").strip(), f"{package}.{name}"


if __name__ == "__main__" and "--update" in sys.argv:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with open(LISTING, "w") as f:
        f.write("\n".join(public_api()) + "\n")
    print(f"wrote {LISTING}")
