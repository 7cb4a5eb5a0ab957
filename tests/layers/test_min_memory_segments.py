"""The segment plan of apply_recompute(..., policy="min_memory").

Oracle: every way of cutting a short chain into segments (brute force);
and, on a real graph, the closed form k, k-1, ... for equal units.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from keras_mgpu import _flavour
from keras_mgpu.layers import apply_recompute
from keras_mgpu.layers.min_memory_segments import min_memory_sizes
from keras_mgpu.layers.recompute_in_place import segment_plan

keras = _flavour.keras


def stored_at_peak(sizes, held, hands_on) -> int:
    """The most a plan stores at once: at each segment's backward, the
    boundaries of the segments below it and the segment's own units."""
    peak, stored, start = 0, 0, 0
    for size in sizes:
        peak = max(peak, stored + sum(held[start : start + size]))
        start += size
        stored += hands_on[start - 1]
    return peak


def all_plans(n: int, breaks):
    """Every cut of n units into consecutive segments that respects
    `breaks` (a unit marked True starts a segment)."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        cut = [True, *cuts]
        if any(b and not c for b, c in zip(breaks, cut, strict=True)):
            continue
        sizes, count = [], 0
        for j in range(n):
            if cut[j] and count:
                sizes.append(count)
                count = 0
            count += 1
        yield sizes + [count]


def test_equal_units_shrink_by_one_from_the_input():
    for n in range(1, 61):
        sizes = min_memory_sizes([1] * n, [1] * n, [False] * n)
        k = math.ceil((math.sqrt(8 * n + 1) - 1) / 2)  # least k(k+1)/2 >= n
        assert sum(sizes) == n, n
        assert stored_at_peak(sizes, [1] * n, [1] * n) == k, (n, sizes)
        # Equal segments (Chen et al.) never store less.
        size = math.ceil(math.sqrt(n))
        equal = [size] * (n // size) + ([n % size] if n % size else [])
        assert stored_at_peak(equal, [1] * n, [1] * n) >= k, n
    assert min_memory_sizes([1] * 32, [1] * 32, [False] * 32) == [
        8,
        7,
        6,
        5,
        4,
        2,
    ]
    assert stored_at_peak([6, 6, 6, 6, 6, 2], [1] * 32, [1] * 32) == 10


def test_the_plan_stores_least_of_every_cut():
    """Random chains of up to 9 units (units that hold and hand on
    different amounts, some that must start a segment): the plan stores no
    more than the best of every cut. A greedy fill failed this (seed 19:
    19 where 17 was possible)."""
    for seed in range(60):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 10))
        held = [int(v) for v in rng.integers(1, 12, size=n)]
        hands_on = [int(v) for v in rng.integers(1, 6, size=n)]
        breaks = [j == 0 or bool(rng.random() < 0.15) for j in range(n)]
        sizes = min_memory_sizes(held, hands_on, breaks)
        assert sum(sizes) == n and all(size > 0 for size in sizes)
        starts = set(itertools.accumulate([0, *sizes[:-1]]))
        assert all(j in starts for j in range(n) if breaks[j]), seed
        best = min(
            stored_at_peak(plan, held, hands_on)
            for plan in all_plans(n, breaks)
        )
        assert stored_at_peak(sizes, held, hands_on) == best, seed


def test_units_that_hold_much_more_than_they_hand_on_go_one_by_one():
    # Transformer-like blocks: each holds 10 times what it hands on.
    assert min_memory_sizes([10] * 6, [1] * 6, [False] * 6) == [1] * 6
    assert min_memory_sizes([], [], []) == []


def dense_chain(layers: int = 32, width: int = 16) -> keras.Sequential:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((width,))]
        + [
            keras.layers.Dense(width, activation="relu", name=f"dense_{i}")
            for i in range(layers)
        ]
        + [keras.layers.Dense(1, name="head")]
    )


def test_a_chain_of_32_layers_in_segments_of_8_7_6_5_4_2():
    model = dense_chain()
    apply_recompute(model, hidden_of(model), policy="min_memory")
    assert [len(s) for s in segment_plan(model)] == [8, 7, 6, 5, 4, 2]
    sqrt = dense_chain()
    apply_recompute(sqrt, hidden_of(sqrt), policy="sqrt")
    assert [len(s) for s in segment_plan(sqrt)] == [6, 6, 6, 6, 6, 2]


def hidden_of(model) -> list:
    return [layer for layer in model.layers if layer.name != "head"]


def test_blocks_are_counted_by_what_they_run():
    """8 Sequential blocks of 4 Dense layers: each holds 4 activations and
    hands on 1, so the plan pairs the first blocks (4 + 4 stored with the
    boundary below them) and stores 10 where per-block recompute stores 12
    (`bench_recompute.py --deep`, case min_memory)."""
    keras.utils.set_random_seed(0)
    blocks = [
        keras.Sequential(
            [keras.layers.Dense(16, activation="relu") for _ in range(4)],
            name=f"block_{i}",
        )
        for i in range(8)
    ]
    model = keras.Sequential(
        [keras.Input((16,)), *blocks, keras.layers.Dense(1)]
    )
    apply_recompute(model, keras.Sequential, policy="min_memory")
    assert [[layer.name for layer in s] for s in segment_plan(model)] == [
        ["block_0", "block_1"],
        ["block_2", "block_3"],
    ]
    sizes = min_memory_sizes([4] * 8, [1] * 8, [False] * 8)
    assert sizes == [2, 2, 1, 1, 1, 1]
    assert 1 + stored_at_peak(sizes, [4] * 8, [1] * 8) == 10
    assert 1 + stored_at_peak([1] * 8, [4] * 8, [1] * 8) == 12
