"""Which device each layer goes to: the `policy` of `apply_placement`.

- `"balanced"`: contiguous stages, one per device, that minimise the
  largest stage's parameter bytes (the optimum, by dynamic programming);
  among the optimal cuts, the one that moves the fewest activation bytes
  between stages.
- A mapping `{layer name or class: device}`: the layers named (or of
  that class) go to that device, every other layer follows the layer
  before it.
- A list of cut points (layer indices or names): stage k starts at cut
  point k-1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from keras_mgpu._flavour import keras
from keras_mgpu.placement.devices import resolve_devices

POLICIES = ("balanced",)


def balanced_cuts(
    weights: Sequence[int], parts: int, costs: Sequence[int]
) -> list[int]:
    """Start index of each of `parts` contiguous, non-empty stages.

    Minimises the largest stage sum of `weights`; among those partitions,
    the sum of `costs[j]` over the cuts j made. Exact (two dynamic
    programmes over prefix sums, O(parts · n²) in numpy).
    """
    n = len(weights)
    prefix = np.concatenate(
        [[0], np.cumsum(np.asarray(weights, dtype=np.float64))]
    )
    inf = float("inf")
    # best[k][i]: smallest largest-stage sum for the first i layers in k
    # stages.
    best = np.full((parts + 1, n + 1), inf)
    best[1, 1:] = prefix[1:]
    for k in range(2, parts + 1):
        for i in range(k, n + 1):
            j = np.arange(k - 1, i)
            best[k, i] = np.min(
                np.maximum(best[k - 1, j], prefix[i] - prefix[j])
            )
    limit = best[parts, n]
    # cost[k][i]: least cut cost for the first i layers in k stages, none
    # heavier than `limit`.
    cost = np.full((parts + 1, n + 1), inf)
    choice = np.zeros((parts + 1, n + 1), dtype=int)
    cost[1, 1:] = np.where(prefix[1:] <= limit, 0.0, inf)
    cut_cost = np.asarray(list(costs) + [0], dtype=np.float64)
    for k in range(2, parts + 1):
        for i in range(k, n + 1):
            j = np.arange(k - 1, i)
            candidates = np.where(
                prefix[i] - prefix[j] <= limit,
                cost[k - 1, j] + cut_cost[j],
                inf,
            )
            pick = int(np.argmin(candidates))
            cost[k, i] = candidates[pick]
            choice[k, i] = j[pick]
    starts, i = [], n
    for k in range(parts, 1, -1):
        i = int(choice[k, i])
        starts.append(i)
    return [0, *reversed(starts)]


def _devices_from_cuts(
    starts: list[int], devices: list[str], n: int
) -> list[str]:
    result = []
    for stage, start in enumerate(starts):
        end = starts[stage + 1] if stage + 1 < len(starts) else n
        result.extend([devices[stage]] * (end - start))
    return result


def _check_enough_layers(
    placeable: list, devices: list[str], model: Any
) -> None:
    if len(devices) > len(placeable):
        raise ValueError(
            f"Argument `devices` asks for {len(devices)} stages, but model "
            f"{model.name!r} has only {len(placeable)} layers to place (a "
            "stage holds at least one layer; nested models count as one). "
            f"Use at most {len(placeable)} devices. Received: "
            f"devices={devices}"
        )


def _cut_points(
    policy: Sequence, placeable: list, devices: list[str]
) -> list[int]:
    names = [layer.name for layer in placeable]
    if len(policy) != len(devices) - 1:
        raise ValueError(
            f"Argument `policy` as cut points needs one cut per boundary "
            f"between stages: {len(devices) - 1} for {len(devices)} devices. "
            f"Received: policy={list(policy)!r}"
        )
    starts = [0]
    for point in policy:
        if isinstance(point, str):
            if point not in names:
                raise ValueError(
                    f"Argument `policy` names a cut at layer {point!r}, which "
                    f"the model does not have. Its layers: {names}. "
                    f"Received: policy={list(policy)!r}"
                )
            index = names.index(point)
        elif isinstance(point, (int, np.integer)) and not isinstance(
            point, bool
        ):
            index = int(point)
        else:
            raise TypeError(
                "Argument `policy` as cut points must hold layer indices or "
                f"names. Received: policy={list(policy)!r} with item "
                f"{point!r}"
            )
        if not starts[-1] < index < len(names):
            raise ValueError(
                "Argument `policy` cut points must be strictly increasing "
                f"layer positions from 1 to {len(names) - 1} (a stage starts "
                "at its cut point and is not empty). Received: "
                f"policy={list(policy)!r}"
            )
        starts.append(index)
    return starts


def _mapped_device(layer: Any, mapping: dict) -> str | None:
    if layer.name in mapping:
        return mapping[layer.name]
    for key, device in mapping.items():
        if isinstance(key, type) and isinstance(layer, key):
            return device
    return None


def _check_mapping(
    policy: Mapping, placeable: list, devices: list[str] | None
) -> dict:
    mapping = {}
    names = [layer.name for layer in placeable]
    for key, device in policy.items():
        is_class = isinstance(key, type) and issubclass(key, keras.layers.Layer)
        if not isinstance(key, str) and not is_class:
            raise TypeError(
                "Argument `policy` as a mapping must have layer names or "
                f"Keras layer classes as keys. Received: policy key {key!r}"
            )
        matched = (
            key in names
            if isinstance(key, str)
            else any(isinstance(layer, key) for layer in placeable)
        )
        if not matched:
            what = "layer" if isinstance(key, str) else "layer of class"
            label = key if isinstance(key, str) else key.__name__
            raise ValueError(
                f"Argument `policy` maps {what} {label!r} to a device, but no "
                f"layer of the model matches it. Its layers: {names}. "
                f"Received: policy={dict(policy)!r}"
            )
        name = resolve_devices([device], "policy")[0]
        if devices is not None and name not in devices:
            raise ValueError(
                f"Argument `policy` maps {key!r} to {name}, which is not one "
                f"of argument `devices` ({devices}). Received: "
                f"policy={dict(policy)!r}"
            )
        mapping[key] = name
    return mapping


def _devices_from_mapping(mapping: dict, placeable: list) -> list[str]:
    found = [_mapped_device(layer, mapping) for layer in placeable]
    current = next(d for d in found if d is not None)
    result = []
    for device in found:
        current = device or current
        result.append(current)
    return result


def assign_devices(
    model: Any,
    placeable: list,
    devices: Sequence[Any] | None,
    policy: Any,
    weights: Sequence[int],
    costs: Sequence[int],
) -> list[str]:
    """The canonical device of each layer of `placeable`, per `policy`."""
    if isinstance(policy, Mapping):
        given = None if devices is None else resolve_devices(devices)
        if not policy:
            raise ValueError(
                "Argument `policy` as a mapping must map at least one layer "
                f"to a device. Received: policy={policy!r}"
            )
        return _devices_from_mapping(
            _check_mapping(policy, placeable, given), placeable
        )
    names = resolve_devices(devices)
    _check_enough_layers(placeable, names, model)
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(
                "Argument `policy` must be 'balanced', a mapping {layer name "
                "or class: device} or a list of cut points. Received: "
                f"policy={policy!r}"
            )
        starts = balanced_cuts(weights, len(names), costs)
    elif isinstance(policy, Sequence):
        starts = _cut_points(policy, placeable, names)
    else:
        raise TypeError(
            "Argument `policy` must be 'balanced', a mapping {layer name or "
            "class: device} or a list of cut points. Received: "
            f"policy={policy!r} (of type {type(policy).__name__})"
        )
    return _devices_from_cuts(starts, names, len(placeable))


__all__ = ["assign_devices", "balanced_cuts"]
