"""`check_layout_map` and `LayoutReport` on any layout map: each error
names the pattern and the variable; the report's bytes per device for
weights and optimizer state."""

from __future__ import annotations

import json

import keras
import pytest
from _layout_models import mesh, mlp

import keras_mgpu
from keras_mgpu.sharding import LayoutReport, check_layout_map


@pytest.fixture(scope="module")
def model():
    return mlp()  # up_i (32, 128), down_i (128, 32), head (32, 4)


def _map(shape=(1, 4), **patterns):
    layout_map = keras.distribution.LayoutMap(mesh(shape))
    for pattern, axes in patterns.items():
        layout_map[pattern.replace("__", "/")] = axes
    return layout_map


def test_report_counts_matches_and_bytes(model):
    layout_map = _map(up_0__kernel=(None, "model"))
    layout_map["down_.*/kernel"] = ("model", None)
    report = check_layout_map(model, layout_map)
    assert isinstance(report, LayoutReport)
    assert report.matches == {
        "up_0/kernel": ["up_0/kernel"],
        "down_.*/kernel": ["down_0/kernel", "down_1/kernel"],
    }
    kernel = 32 * 128 * 4
    assert report.param_bytes == sum(
        int(v.numpy().nbytes) for v in model.weights
    )
    assert report.param_bytes - report.param_bytes_per_device == (
        3 * kernel * 3 // 4
    )
    assert report.fallbacks == {
        "up_1/kernel": "no pattern leaves this kernel of 16384 bytes whole"
    }
    assert "up_0/bias" in report.replicated
    assert report.activations["up_0/output"] == ("...", "model")
    assert report.measured_param_bytes_per_device is None  # not laid out
    text = str(report)
    assert "down_.*/kernel" in text and "per device" in text
    json.dumps(report.to_dict())  # plain data


def test_unmatched_pattern_raises_or_is_listed(model):
    layout_map = _map(
        up_0__kernel=(None, "model"), dense_7__kernel=(None, "model")
    )
    with pytest.raises(
        ValueError, match=r"Pattern 'dense_7/kernel'.*matches no"
    ):
        check_layout_map(model, layout_map)
    report = check_layout_map(model, layout_map, allow_unmatched=True)
    assert report.unmatched_patterns == ["dense_7/kernel"]
    # A layer output path is an activation layout, not unmatched.
    layout_map = _map(up_0__output=("batch", "model"))
    report = check_layout_map(model, layout_map)
    assert report.activation_patterns == {"up_0/output": ["up_0/output"]}


@pytest.mark.parametrize("same", [True, False], ids=["same", "different"])
def test_variable_matching_several_patterns(model, same):
    layout_map = _map()
    layout_map["up_.*/kernel"] = (None, "model")
    layout_map["up_0/ker.*"] = (None, "model") if same else ("model", None)
    match = "refuses a path matching" if same else "with different layouts"
    with pytest.raises(ValueError, match=rf"'up_0/kernel' matches.*{match}"):
        check_layout_map(model, layout_map)


@pytest.mark.parametrize(
    "axes,match",
    [
        ((None, None, "model"), r"'up_0/kernel'.*rank 2.*rank 3"),
        (("model", "model"), "uses axis 'model' twice"),
        (("batch", "model"), None),  # 2 divides 32, 2 divides 128: fine
    ],
)
def test_layout_must_fit_the_variable(model, axes, match):
    layout_map = _map((2, 2), up_0__kernel=axes)
    if match is None:
        check_layout_map(model, layout_map)
        return
    with pytest.raises(ValueError, match=match):
        check_layout_map(model, layout_map)


def test_indivisible_split_names_pattern_and_variable():
    inputs = keras.Input((6,))
    odd = keras.Model(inputs, keras.layers.Dense(6, name="o")(inputs))
    layout_map = _map((1, 4), o__kernel=(None, "model"))
    with pytest.raises(
        ValueError,
        match=r"'o/kernel' splits dimension 1 of variable "
        r"'o/kernel' \(shape \(6, 6\)\) over 'model' \(4 devices\)",
    ):
        check_layout_map(odd, layout_map)


def test_mesh_and_type_arguments(model):
    layout_map = _map((1, 4), up_0__kernel=(None, "model"))
    with pytest.raises(ValueError, match="differs from the layout map's"):
        check_layout_map(model, layout_map, mesh((2, 2)))
    with pytest.raises(TypeError, match="`layout_map`.*dict"):
        check_layout_map(model, {"up_0/kernel": (None, "model")})
    with pytest.raises(TypeError, match="`mesh`"):
        check_layout_map(model, layout_map, "mesh")
    with pytest.raises(ValueError, match="min_shard_bytes=-2"):
        check_layout_map(model, layout_map, min_shard_bytes=-2)
    layout_map["up_(1"] = (None, "model")
    with pytest.raises(ValueError, match=r"'up_\(1'.*not a regular"):
        check_layout_map(model, layout_map)


def test_optimizer_state_per_device(model):
    layout_map = keras_mgpu.sharding.plan_layout_map(model, mesh((1, 4)))
    weights = check_layout_map(model, layout_map).param_bytes_per_device
    trainable = weights  # every variable of the MLP is trainable
    adam = check_layout_map(
        model, layout_map, optimizer=keras.optimizers.Adam()
    )
    assert adam.optimizer_multiplier == 2.0
    assert adam.optimizer_bytes_per_device == 2 * trainable
    accumulating = keras_mgpu.GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), 2
    )
    report = check_layout_map(model, layout_map, optimizer=accumulating)
    assert report.optimizer_multiplier == 2.0  # momentum + accumulators
    built = keras.optimizers.Adam()
    built.build(model.trainable_variables)
    report = check_layout_map(model, layout_map, optimizer=built)
    assert report.optimizer_multiplier == pytest.approx(2.0)
    report = check_layout_map(model, layout_map, optimizer_multiplier=0.5)
    assert report.optimizer_bytes_per_device == round(0.5 * trainable)
    with pytest.raises(ValueError, match="not both"):
        check_layout_map(
            model, layout_map, optimizer=built, optimizer_multiplier=1.0
        )
    with pytest.raises(ValueError, match="optimizer_multiplier=-1"):
        check_layout_map(model, layout_map, optimizer_multiplier=-1)

    class Mine(keras.optimizers.Optimizer):
        def __init__(self, rate):  # no from_config: cannot be copied
            super().__init__(learning_rate=rate)
            self.rate = rate

    with pytest.raises(ValueError, match="unbuilt Mine.*optimizer_multiplier"):
        check_layout_map(model, layout_map, optimizer=Mine(0.1))


_OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.1),
    "SGD momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "Adam": lambda: keras.optimizers.Adam(),
    "AdamW": lambda: keras.optimizers.AdamW(),
    "Adam amsgrad": lambda: keras.optimizers.Adam(amsgrad=True),
    "Adam use_ema": lambda: keras.optimizers.Adam(use_ema=True),
    "LossScaleOptimizer(Adam)": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam()
    ),
    "GradientAccumulationOptimizer(Adam)": lambda: (
        keras_mgpu.GradientAccumulationOptimizer(keras.optimizers.Adam(), 4)
    ),
    "LossScaleOptimizer(GradientAccumulationOptimizer(Adam use_ema))": (
        lambda: keras.optimizers.LossScaleOptimizer(
            keras_mgpu.GradientAccumulationOptimizer(
                keras.optimizers.Adam(use_ema=True), 2
            )
        )
    ),
    "Adafactor": lambda: keras.optimizers.Adafactor(),
    "Lion": lambda: keras.optimizers.Lion(),
    "RMSprop centered momentum": lambda: keras.optimizers.RMSprop(
        centered=True, momentum=0.9
    ),
    "Muon": lambda: keras.optimizers.Muon(),
    "Nadam": lambda: keras.optimizers.Nadam(),
    "Ftrl": lambda: keras.optimizers.Ftrl(),
    "SGD with a schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9), 0.9
    ),
}


def test_unbuilt_optimizer_state_is_what_the_built_one_holds():
    """An unbuilt optimizer's estimate equals the state the same optimizer
    holds once built on the model (it was a table: LossScaleOptimizer(Adam)
    3 copies for 2 held, Adam(use_ema=True) 2 for 3, Adafactor and Muon
    refused)."""
    inputs = keras.Input((32,))
    hidden = keras.layers.LayerNormalization()(keras.layers.Dense(64)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(256)(hidden))
    layout_map = _map(dense__kernel=(None, "model"))
    for name, make in _OPTIMIZERS.items():
        unbuilt = make()
        estimate = check_layout_map(model, layout_map, optimizer=unbuilt)
        assert not unbuilt.built, name  # the optimizer given is untouched
        built = make()
        built.build(model.trainable_variables)
        measured = check_layout_map(model, layout_map, optimizer=built)
        assert estimate.optimizer_multiplier == pytest.approx(
            measured.optimizer_multiplier, rel=1e-9
        ), name
        assert estimate.optimizer_bytes_per_device == (
            measured.optimizer_bytes_per_device
        ), name


@pytest.mark.parametrize("name", ["plan_layout_map", "check_layout_map"])
def test_docstring_examples_run(name):
    text = getattr(keras_mgpu.sharding, name).__doc__
    code = text.split("```python\n")[1].split("```")[0]
    code = "\n".join(line[4:] for line in code.splitlines())
    exec(compile(code, f"<{name} docstring>", "exec"), {})


def test_activation_layouts_split_features_along_model_axes_only(model):
    """A balanced plan splits a row kernel's output dimension along the
    batch axis (gathered before use): its output's features are not split
    along it, the batch is (was reported as `('...', 'batch')`)."""
    layout_map = keras_mgpu.sharding.plan_layout_map(model, mesh((2, 2)))
    assert layout_map["down_0/kernel"].axes == ("model", "batch")
    activations = check_layout_map(model, layout_map).activations
    assert activations == {
        "up_0/output": ("...", "model"),
        "up_1/output": ("...", "model"),
    }
    # By hand; a mesh without an axis named "batch" splits the batch along
    # its first axis (Keras's default `batch_dim_name`).
    layout_map = _map((2, 2), up_0__kernel=(None, "model"))
    layout_map["down_0/kernel"] = (None, "batch")
    assert check_layout_map(model, layout_map).activations == {
        "up_0/output": ("...", "model")
    }
    data_model = keras.distribution.DeviceMesh(
        (2, 2), ("data", "model"), keras.distribution.list_devices()[:4]
    )
    layout_map = keras.distribution.LayoutMap(data_model)
    layout_map["up_0/kernel"] = ("model", "data")
    layout_map["up_1/kernel"] = ("data", "model")
    assert check_layout_map(model, layout_map).activations == {
        "up_1/output": ("...", "model")
    }
