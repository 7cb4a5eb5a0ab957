"""The collectives of XLA's compiled train step, read from its HLO text:
what one device sends per step (`keras_mgpu.monitoring.communication`).

`compiled_train_step` lowers and compiles the model's own `train_step` (the
stateless step Keras's JAX trainer jits, state donated as `fit` does, the
same way `compiled_memory` does for `find_batch_size`) for one batch's
shapes under the distribution in force; nothing runs. `collectives_from_hlo`
lists the cross-device operations of the compiled module (its `as_text()`),
and `collective_bytes_from_hlo` sums them by kind.

Sizes come from each instruction's result shape (operand names carry no
shape in XLA's text): an all-reduce's result is its operand; an all-gather's
the gathered whole; a reduce-scatter's is one shard, so its input is the
result times the group size. XLA combines small all-reduces into one with a
tuple result (on CPU, Keras's whole gradient reduction is one such
instruction, with the loss's and metrics' scalar sums in it): every element
of the tuple counts. Asynchronous GPU forms (`all-reduce-start`, ...) count
once, their `-done` halves not at all. An instruction inside a loop body
(`steps_per_execution` as `lax.scan`, Keras 3.16) appears once in the text
however often it runs; one inside a `cond` branch counts whether or not it
runs.

Nothing here imports a feature package; jax is imported where it is used.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

# Bytes of one element, by HLO primitive type.
_ELEMENT_BYTES = {
    "pred": 1,
    "s2": 1,
    "u2": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e3m4": 1,
    "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

#: The collective kinds counted, as XLA names them.
KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "collective-permute",
    "all-to-all",
)

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-reduce-start|all-reduce|reduce-scatter|all-gather-start|"
    r"all-gather|collective-permute-start|collective-permute|all-to-all)\("
)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_REPLICAS = re.compile(r"replica_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One cross-device instruction of a compiled module.

    Attributes:
        kind: one of `KINDS`.
        shapes: the (HLO type, shape) of each array it reduces, gathers or
            sends (the full input of a reduce-scatter, the gathered output
            of an all-gather).
        bytes: their bytes together (the payload).
        group_size: devices in one of its groups (None when the text does
            not say; a collective-permute has pairs, not groups).
        mesh_axes: for groups printed in XLA's mesh form
            (`mesh['axis_0'=2,'axis_1'=2] {'axis_0'}`), the indices of the
            mesh axes a group spans; otherwise None.
    """

    kind: str
    shapes: tuple
    bytes: int
    group_size: int | None
    mesh_axes: tuple | None

    @property
    def scalar_bytes(self) -> int:
        """Bytes of the rank-0 arrays among `shapes` (under Keras, the
        loss's and metrics' sums over the batch)."""
        return sum(_ELEMENT_BYTES[t] for t, shape in self.shapes if not shape)

    def wire_bytes(self, group_size: int | None = None) -> float:
        """Bytes one device sends for it with ring algorithms: all-reduce
        `2(n-1)/n` of the payload, reduce-scatter, all-gather and
        all-to-all `(n-1)/n`, collective-permute all of it."""
        n = group_size or self.group_size or 1
        if self.kind == "collective-permute":
            return float(self.bytes)
        factor = 2.0 if self.kind == "all-reduce" else 1.0
        return factor * (n - 1) / n * self.bytes


def _arrays(shape_text: str) -> list:
    """The (type, dims) of each array in an HLO shape (a tuple or not);
    tokens and layouts are skipped."""
    arrays = []
    for element_type, dims in _ARRAY.findall(_COMMENT.sub("", shape_text)):
        if element_type not in _ELEMENT_BYTES:
            continue
        arrays.append(
            (element_type, tuple(int(d) for d in dims.split(",") if d))
        )
    return arrays


def _nbytes(arrays: list) -> int:
    return sum(_ELEMENT_BYTES[t] * math.prod(shape) for t, shape in arrays)


def _groups(line: str, default: int | None) -> tuple:
    """(group size, mesh axes) from an instruction's `replica_groups`."""
    match = re.search(r"replica_groups=(\S+(?: \{[^}]*\})?)", line)
    if match is None:
        return default, None
    text = match.group(1)
    mesh = re.match(r"mesh\[([^\]]*)\] \{([^}]*)\}", text)
    if mesh:  # mesh['axis_0'=2,'axis_1'=2] {'axis_0'}
        sizes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names = [name for name, _ in sizes]
        chosen = re.findall(r"'([^']+)'", mesh.group(2))
        size = math.prod(int(dict(sizes)[name]) for name in chosen)
        return size, tuple(names.index(name) for name in chosen)
    iota = re.match(r"\[([0-9,]+)\]<=", text)
    if iota:  # [groups,size]<=[devices]: the last dimension is a group
        return int(iota.group(1).split(",")[-1]), None
    explicit = re.match(r"\{\{([0-9,]*)\}", text)
    if explicit:  # {{0,1,2,3},...}
        return len([d for d in explicit.group(1).split(",") if d]), None
    return default, None  # {}: every device


def collectives_from_hlo(hlo_text: str) -> list:
    """Every collective instruction of an HLO module's text, as
    `Collective` records, in the order they appear.

    Args:
        hlo_text: `jax.jit(f).lower(...).compile().as_text()` (or the text
            of any HLO module).
    """
    if not isinstance(hlo_text, str):
        raise TypeError(
            "Argument `hlo_text` must be a str (an HLO module's text). "
            f"Received: hlo_text of type {type(hlo_text).__name__}"
        )
    partitions = _PARTITIONS.search(hlo_text)
    replicas = _REPLICAS.search(hlo_text)
    devices = max(
        int(partitions.group(1)) if partitions else 1,
        int(replicas.group(1)) if replicas else 1,
    )
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        op = match.group("op")
        kind = op.removesuffix("-start")
        arrays = _arrays(match.group("shape"))
        if op in ("all-gather-start", "collective-permute-start"):
            # Their result tuples are (inputs..., outputs..., [contexts]):
            # what is gathered or sent is the outputs' half.
            half = len([a for a in arrays if a[0] != "u32" or a[1]]) // 2
            arrays = arrays[half : 2 * half] if half else arrays
        group_size, mesh_axes = _groups(line, devices)
        if kind == "collective-permute":
            group_size, mesh_axes = None, None
        size = _nbytes(arrays)
        if kind == "reduce-scatter":
            size *= group_size or 1
        found.append(
            Collective(kind, tuple(arrays), size, group_size, mesh_axes)
        )
    return found


def collective_bytes_from_hlo(hlo_text: str) -> dict:
    """Payload bytes of an HLO module's collectives, by kind.

    Returns a dict with one entry per kind in `KINDS` (payload bytes, 0
    when absent), `"total"` (their sum), `"scalar"` (bytes of rank-0
    arrays among them: Keras's loss and metric sums), `"wire"` (bytes one
    device sends with ring algorithms: `Collective.wire_bytes`) and
    `"count"` (instructions).

    Args:
        hlo_text: the compiled module's text (`compiled.as_text()`).

    Example:

    ```python
    import jax
    import jax.numpy as jnp

    text = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text()
    assert collective_bytes_from_hlo(text)["total"] == 0
    ```
    """
    records = collectives_from_hlo(hlo_text)
    totals: dict = {kind: 0 for kind in KINDS}
    for record in records:
        totals[record.kind] += record.bytes
    totals["total"] = sum(totals[kind] for kind in KINDS)
    totals["scalar"] = sum(r.scalar_bytes for r in records)
    totals["wire"] = sum(r.wire_bytes() for r in records)
    totals["count"] = len(records)
    return totals


def compiled_train_step(
    model: Any, x: Any, y: Any = None, sample_weight: Any = None
) -> Any:
    """The model's `train_step` compiled by XLA for this batch's shapes
    under the `keras.distribution` in force (none: one device), as `fit`
    jits it (state donated); nothing runs.

    The model and its optimizer must be built (after `fit`,
    `train_on_batch`, or `model.optimizer.build(...)`). `x`, `y` and
    `sample_weight` are the global batch (arrays or anything with `shape`
    and `dtype`, nests allowed). Returns `jax.stages.Compiled`
    (`.as_text()`, `.cost_analysis()`, `.memory_analysis()`).
    """
    import jax

    from keras_mgpu.backend.jax.compiled_memory import abstract_step_arguments

    if getattr(model, "optimizer", None) is None or not model.optimizer.built:
        raise ValueError(
            "Argument `model` must be compiled and its optimizer built "
            "(run `fit` or `train_on_batch` once, or "
            "`model.optimizer.build(model.trainable_variables)`). "
            f"Received: model={getattr(model, 'name', model)!r}"
        )
    state, data = abstract_step_arguments(model, x, y, sample_weight)
    step = jax.jit(model.train_step, donate_argnums=0)
    return step.lower(state, data).compile()
