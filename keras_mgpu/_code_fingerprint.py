"""A fingerprint of a function's code that is the same on every Python.

The guards on private Keras code (multi-worker fit's
`structure_differences()` in `distribute/_keras_trainer_patch.py`, the JAX
per-device step's in `backend/jax/reduction.py`) compare the Keras code
they replace or rely on with fingerprints measured once, so the fingerprint
must not depend on the Python that computes it. `ast.dump` does: Python 3.12
adds `type_params=[]` to every `def`, and 3.13 leaves out fields that are
None or empty lists, so a hash of `ast.dump` matched on 3.10 and 3.11 only.
`portable_dump` writes the AST itself, leaving out every None and empty
field on every Python.

Standard library only, and no import of `keras_mgpu`: the measuring script
(`tools/keras_fingerprints.py`) and the cross-Python test load this file by
path under interpreters without TensorFlow.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Callable
from typing import Any


def source_fingerprint(source: str) -> str:
    """16 hex digits of sha256 of the first definition in `source`.

    `source` is a definition as `inspect.getsource` gives it (decorators
    first, possibly indented: it is dedented, which also dedents multi-line
    string literals in it). Blind to its docstring, comments and layout.
    """
    node = ast.parse(textwrap.dedent(source)).body[0]
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node.body = body[1:]
    return hashlib.sha256(portable_dump(node).encode()).hexdigest()[:16]


def portable_dump(node: object) -> str:
    """`Class(field=value, ...)` in `_fields` order, without positions.

    Fields that are None or empty lists are left out: those are the fields
    that come and go between Python versions (3.12's `type_params`, 3.13's
    omissions); leaving them out keeps the dump unambiguous, as every field
    is named. Constants are written by `repr` (the constant None, whose
    value is left out too, reads `Constant()`).
    """
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={portable_dump(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(portable_dump(item) for item in node)}]"
    return repr(node)


def class_named(module: Any, names: tuple[str, ...], what: str) -> type:
    """The class `module` defines under the first of `names` it has (a
    class renamed between Keras releases: the trainers are `Trainer` from
    3.16); raises AttributeError naming `what` and `names` otherwise."""
    for name in names:
        found = vars(module).get(name)
        if isinstance(found, type):
            return found
    raise AttributeError(
        f"{module.__name__} defines no {what} (looked for {' or '.join(names)})"
    )


def function_fingerprint(function: Any) -> str:
    """`source_fingerprint` of a live function's code (unwrapped)."""
    return source_fingerprint(inspect.getsource(inspect.unwrap(function)))


def code_differences(
    lookups: dict[str, Callable[[], Any]],
    known: dict[str, dict[str, str]],
) -> list[str]:
    """One line per function whose code is not among its known
    fingerprints: `lookups` maps each name of `known` ({name: {fingerprint:
    releases}}) to a function without arguments that returns the live
    function (and raises ImportError, AttributeError or KeyError when it
    is gone). Empty when everything matches."""
    differences = []
    for name, lookup in lookups.items():
        try:
            function = lookup()
        except (ImportError, AttributeError, KeyError) as exc:
            differences.append(f"{name} is gone ({exc!r})")
            continue
        try:
            found = function_fingerprint(function)
        except (OSError, TypeError, SyntaxError) as exc:
            differences.append(f"{name}: source unreadable ({exc})")
            continue
        if found not in known[name]:
            releases = ", ".join(sorted(set(known[name].values())))
            differences.append(
                f"{name} differs from Keras {releases} (fingerprint "
                f"{found}, known {', '.join(known[name])})"
            )
    return differences
