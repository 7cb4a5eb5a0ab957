"""`placement_report`: where a model's layers, weights and optimizer state
live, and how much memory each device has used."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mgpu._flavour import keras_of, tf
from keras_mgpu.placement import _graph
from keras_mgpu.placement.apply_placement import micro_batches_of
from keras_mgpu.placement.devices import canonical_device
from keras_mgpu.placement.placed_layer import PlacedLayer

# Placement is Keras 3 only, whatever TF_USE_LEGACY_KERAS says.
keras = keras_of("keras3")

MAX_LAYER_NAMES = 4


def _variable_device(variable: Any) -> str:
    """The device a variable really lives on (not our bookkeeping)."""
    value = getattr(variable, "value", variable)
    return canonical_device(value.device, "variable")


def _nbytes(variable: Any) -> int:
    return int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize


def _layer_devices(model: Any) -> list[tuple[str, str]]:
    """(layer name, device) in graph order, through a pipelined model."""
    found = []
    for layer in model.layers:
        if isinstance(layer, PlacedLayer):
            found.append((layer.name, layer.device))
        elif isinstance(layer, keras.Model) and not _graph.is_input_layer(
            layer
        ):
            inner = _layer_devices(layer)
            if inner:
                found.extend(inner)
                continue
            found.append(_unplaced(layer))
        elif not _graph.is_input_layer(layer) and layer.variables:
            found.append(_unplaced(layer))
    return found


def _unplaced(layer: Any) -> tuple[str, str]:
    devices = [_variable_device(v) for v in layer.variables]
    return layer.name, devices[0] if devices else "-"


def _peak_bytes(device: str) -> int | None:
    """TensorFlow's allocator peak for a GPU; None for CPU devices, whose
    one allocator is shared by every logical CPU device."""
    if ":GPU:" not in device:
        return None
    try:
        return int(
            tf.config.experimental.get_memory_info(
                device.lstrip("/").replace("device:", "")
            )["peak"]
        )
    except (ValueError, RuntimeError):
        return None


def _host_peak_bytes() -> int | None:
    try:
        return int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    except (ValueError, RuntimeError):
        return None


def _rows(model: Any) -> list[dict]:
    layers = _layer_devices(model)
    order: list[str] = []
    for _, device in layers:
        if device not in order and device != "-":
            order.append(device)
    rows = {
        d: {
            "device": d,
            "stage": i,
            "layers": [n for n, dev in layers if dev == d],
            "params": 0,
            "param_bytes": 0,
            "optimizer_bytes": 0,
            "peak_bytes": _peak_bytes(d),
        }
        for i, d in enumerate(order)
    }

    def row_for(device: str) -> dict:
        if device not in rows:
            rows[device] = {
                "device": device,
                "stage": None,
                "layers": [],
                "params": 0,
                "param_bytes": 0,
                "optimizer_bytes": 0,
                "peak_bytes": _peak_bytes(device),
            }
        return rows[device]

    for variable in model.weights:
        row = row_for(_variable_device(variable))
        row["params"] += int(np.prod(variable.shape))
        row["param_bytes"] += _nbytes(variable)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        for variable in optimizer.variables:
            row_for(_variable_device(variable))["optimizer_bytes"] += _nbytes(
                variable
            )
    else:
        for row in rows.values():
            row["optimizer_bytes"] = None
    return list(rows.values())


def _size(value: int | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value} B"


def _names(names: list[str]) -> str:
    if len(names) <= MAX_LAYER_NAMES:
        return ", ".join(names) or "-"
    return f"{names[0]} ... {names[-1]} ({len(names)} layers)"


def format_placement(model: Any, rows: list[dict]) -> str:
    """The table `placement_report` prints."""
    stages = sum(1 for r in rows if r["stage"] is not None)
    header = f"Placement of model {model.name!r}: {stages} stage(s)"
    micro = micro_batches_of(model)
    header += (
        f", {micro} micro-batches per step" if micro > 1 else ", no pipelining"
    )
    table = [
        ("stage", "device", "layers", "params", "weights", "optimizer", "peak")
    ]
    for row in rows:
        table.append(
            (
                "-" if row["stage"] is None else str(row["stage"]),
                row["device"].replace("/device:", ""),
                _names(row["layers"]),
                f"{row['params']:,}",
                _size(row["param_bytes"]),
                _size(row["optimizer_bytes"]),
                _size(row["peak_bytes"]),
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [header]
    for r in table:
        lines.append(
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
        )
    if any(":CPU:" in r["device"] for r in rows):
        host = _host_peak_bytes()
        lines.append(
            "  peak: TensorFlow keeps one allocator for all logical CPU "
            "devices; process-wide peak "
            + (
                _size(host)
                if host is not None
                else "not available (needs oneDNN)"
            )
        )
    return "\n".join(lines)


def placement_report(
    model: Any, print_fn: Callable[[str], Any] | None = print
) -> list[dict]:
    """Per device: the layers placed there, their parameters, the optimizer
    state held there and the peak memory; printed as a table, returned as
    data.

    Parameter and optimizer figures are read from each variable's own
    `device` (where TensorFlow put it, not where it was asked to go). Peak
    memory is TensorFlow's allocator peak per GPU (`None` before anything
    ran, and for logical CPU devices, which share one allocator: the table
    gives the process-wide figure once). Works on any model; an unplaced
    one shows everything on its one device.

    Args:
        model: a Keras 3 model, usually from `apply_placement`.
        print_fn: called with the table (default `print`); None to only
            return the data.

    Returns:
        A list with one dict per device, in stage order: `device`, `stage`
        (its first stage, None for a device that only holds optimizer
        counters), `layers` (names), `params`, `param_bytes`,
        `optimizer_bytes` (None until the optimizer is built) and
        `peak_bytes` (None where not known).

    Example:

    ```python
    placed = keras_mgpu.apply_placement(model, ["/gpu:0", "/gpu:1"])
    placed.compile("adam", "mse")
    rows = keras_mgpu.placement_report(placed)
    ```
    """
    _graph.check_model(model, "placement_report")
    rows = _rows(model)
    if print_fn is not None:
        print_fn(format_placement(model, rows))
    return rows
