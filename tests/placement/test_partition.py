"""The balanced policy: optimal contiguous stages by parameter bytes, ties
broken by the activation bytes crossing the cuts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _placement_helpers import CPUS, device_of

from keras_mgpu import _flavour
from keras_mgpu.placement import PlacedLayer, apply_placement
from keras_mgpu.placement.partition import balanced_cuts

keras = _flavour.keras


def _stage_sums(weights, starts):
    bounds = [*starts, len(weights)]
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


def _brute_force(weights, parts, costs):
    """(best largest stage, least cut cost among those) over every cut."""
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        starts = [0, *cuts]
        key = (max(_stage_sums(weights, starts)), sum(costs[c] for c in cuts))
        best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_cuts_are_optimal(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 10))
    parts = int(rng.integers(2, min(n, 5) + 1))
    weights = [int(w) for w in rng.choice([0, 0, 1, 5, 20, 100], size=n)]
    costs = [0] + [int(c) for c in rng.integers(1, 50, size=n - 1)]
    starts = balanced_cuts(weights, parts, costs)
    assert len(starts) == parts and starts[0] == 0
    assert all(a < b for a, b in zip(starts, starts[1:]))  # no empty stage
    got = (max(_stage_sums(weights, starts)), sum(costs[c] for c in starts[1:]))
    assert got == _brute_force(weights, parts, costs)


def _uneven_mlp():
    """16 Dense layers from 0.3k to 40k parameters, the big ones bunched:
    four layers a stage would give 2.0x the mean on 4 devices, eight a
    stage 1.4x on 2."""
    widths = [160, 200, 200, 64, 128, 200, 8, 32]
    widths += [24, 160, 200, 24, 16, 160, 48, 8]
    layers = [keras.Input((32,))]
    layers += [
        keras.layers.Dense(w, name=f"dense_{i}") for i, w in enumerate(widths)
    ]
    return keras.Sequential(layers, name="uneven")


@pytest.mark.parametrize("devices", [2, 4])
def test_balanced_policy_evens_out_parameter_bytes(devices):
    model = _uneven_mlp()
    sizes = [layer.count_params() for layer in model.layers]
    assert max(sizes) / min(sizes) > 100  # genuinely uneven
    placed = apply_placement(model, CPUS[:devices])
    per_device = {}
    for variable in placed.weights:  # as TensorFlow placed them
        per_device.setdefault(device_of(variable), 0)
        per_device[device_of(variable)] += variable.numpy().nbytes
    assert len(per_device) == devices
    ratio = max(per_device.values()) / np.mean(list(per_device.values()))
    assert ratio <= 1.25, (per_device, ratio)


def test_ties_cut_where_the_fewest_activation_bytes_cross():
    """Parameter-free layers (pooling, flatten) can sit on either side of
    the cut; the cut goes after the pooling, where 4x fewer bytes cross."""
    inputs = keras.Input((8, 8, 4))
    x = keras.layers.Conv2D(16, 3, padding="same", name="conv")(inputs)
    x = keras.layers.MaxPooling2D(name="pool")(x)
    x = keras.layers.Flatten(name="flat")(x)
    outputs = keras.layers.Dense(3, name="head")(x)  # 771 params vs 592
    placed = apply_placement(keras.Model(inputs, outputs), CPUS[:2])
    devices = {
        layer.name: layer.device
        for layer in placed.layers
        if isinstance(layer, PlacedLayer)
    }
    assert devices["conv"] == devices["pool"] != devices["head"]
