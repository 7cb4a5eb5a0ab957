"""Segments that store the fewest activations for one extra forward.

`apply_recompute(..., policy="min_memory")` recomputes each unit of a
functional graph (a chosen layer, or a `group_by` group) once, as
`policy="sqrt"` does, but sizes the segments from what the units hold
instead of making them equal. While the backward pass runs through segment
`i`, the step holds the boundaries the forward stored below it (the tensors
each earlier segment hands on) and the activations of segment `i`,
recomputed. Segments of equal size (Chen et al., 2016) let that sum grow
towards the output; segments that shrink by one boundary's worth on the way
up keep it level. For `n` equal units that hand on one activation each:
segments of `k, k-1, ..., ` units from the input up, with `k` the smallest
integer such that `k (k + 1) / 2 >= n`: about sqrt(2 n) activations
stored at once where equal segments store about 2 sqrt(n); with the input,
9 instead of 11 for a chain of 32 layers (8, 7, 6, 5, 4, 2 against six of
6, 6, 6, 6, 6, 2: counted in `tests/layers/test_min_memory_segments.py`;
`tests/layers/test_recompute_memory.py` bounds the measured peaks).

What a unit holds is estimated from the symbolic shapes of the graph,
per sample, in elements: the outputs of every layer it runs (a nested
functional or `Sequential` model is counted layer by layer; any other layer
as its outputs times its leaf sublayers). The plan is the one with the
smallest largest sum (bisection on that sum; for a given sum, dynamic
programming over where segments start finds a plan if there is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras_mgpu.layers.recompute_in_place import execution_order, graph_of


def min_memory_sizes(
    held: Sequence[int], hands_on: Sequence[int], breaks: Sequence[bool]
) -> list[int]:
    """Segment lengths, in units from the input up, whose largest stored
    sum (boundaries below a segment plus the segment's own activations) is
    smallest.

    Args:
        held: per unit, what it holds for backprop (any unit of size).
        hands_on: per unit, what a segment ending with it stores as its
            boundary.
        breaks: per unit, True where it cannot join the previous unit's
            segment (not adjacent in the graph).

    Returns:
        The lengths, summing to `len(held)`.
    """
    if not held:
        return []
    low = max(held)
    high = sum(held) + sum(hands_on)
    while low < high:
        middle = (low + high) // 2
        if _fill(held, hands_on, breaks, middle) is None:
            low = middle + 1
        else:
            high = middle
    sizes = _fill(held, hands_on, breaks, low)
    assert sizes is not None  # `high` always fits: one unit per segment
    return sizes


def _fill(
    held: Sequence[int],
    hands_on: Sequence[int],
    breaks: Sequence[bool],
    limit: int,
) -> list[int] | None:
    """A plan that stores at most `limit` at any segment's backward, or
    None. Dynamic programming over where segments start: for each start,
    the least the boundaries below it can store (less is never worse for
    what follows); a greedy fill is not enough when units hand on
    different amounts."""
    n = len(held)
    least: list[int | None] = [0] + [None] * n  # stored below a start
    came_from = [0] * (n + 1)
    for start in range(n):
        below = least[start]
        if below is None:
            continue
        total = below
        for end in range(start, n):
            if end > start and breaks[end]:
                break
            total += held[end]
            if total > limit:
                break
            after = below + (hands_on[end] if end + 1 < n else 0)
            # On a tie the later start wins: long segments near the input,
            # as the closed form for equal units has them.
            if least[end + 1] is None or after <= least[end + 1]:
                least[end + 1] = after
                came_from[end + 1] = start
    if least[n] is None:
        return None
    sizes = []
    position = n
    while position:
        sizes.append(position - came_from[position])
        position = came_from[position]
    return sizes[::-1]


def min_memory_segments(graph: Any, units: list[list]) -> list[list]:
    """Group consecutive `units` (lists of nodes of `graph`, in execution
    order) into the segments `min_memory_sizes` plans."""
    if not units:
        return []
    order = execution_order(graph)
    position = {id(node): i for i, node in enumerate(order)}
    consumers = _consumers(graph, order)
    held = [sum(_held(node) for node in unit) for unit in units]
    hands_on = [_hands_on(unit, consumers) for unit in units]
    breaks = [
        j == 0 or position[id(unit[0])] != position[id(units[j - 1][-1])] + 1
        for j, unit in enumerate(units)
    ]
    segments: list = []
    start = 0
    for size in min_memory_sizes(held, hands_on, breaks):
        segments.append(
            [node for unit in units[start : start + size] for node in unit]
        )
        start += size
    return segments


def _per_sample(tensor: Any) -> int:
    """Elements per sample of a symbolic tensor (unknown dimensions count
    as 1: they are the same for every layer of a sequence model)."""
    size = 1
    for dim in tuple(getattr(tensor, "shape", ()) or ())[1:]:
        size *= dim if isinstance(dim, int) and dim > 0 else 1
    return size


def _held(node: Any) -> int:
    """What `node` holds for backprop when it is not recomputed."""
    layer = node.operation
    inner = graph_of(layer)
    if inner is not None:
        return sum(_held(n) for n in execution_order(inner))
    outputs = sum(_per_sample(x) for x in node.outputs)
    leaves = [
        sub
        for sub in layer._flatten_layers(include_self=False)
        if not list(sub._flatten_layers(include_self=False))
    ]
    return outputs * max(1, len(leaves))


def _consumers(graph: Any, order: list) -> dict:
    """id(tensor) -> ids of the nodes of `graph` that take it (a graph
    output counts as taken by no node: -1)."""
    consumers: dict = {id(x): {-1} for x in graph.outputs}
    for node in order:
        for x in node.input_tensors:
            consumers.setdefault(id(x), set()).add(id(node))
    return consumers


def _hands_on(unit: list, consumers: dict) -> int:
    """What a segment ending with `unit` stores: the unit's outputs that a
    node after it takes (a residual branch's skip tensor included)."""
    inside = {id(node) for node in unit}
    return sum(
        _per_sample(x)
        for node in unit
        for x in node.outputs
        if consumers.get(id(x), set()) - inside
    )


__all__ = ["min_memory_segments", "min_memory_sizes"]
