"""A fingerprint of a function's code that is the same on every Python.

`structure_differences()` compares the Keras code it patches with
fingerprints measured once (`KNOWN_FINGERPRINTS`), so the fingerprint must
not depend on the Python that computes it. `ast.dump` does: Python 3.12
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
import textwrap


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
