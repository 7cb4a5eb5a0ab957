"""`plan_layout_map` on keras-hub Gemma and Llama backbones, a GPT-2
backbone (no keras-hub map) and a functional MLP, on 2x2 and 1x4 meshes of
CPU devices: Megatron roles, per-device bytes against keras-hub's own map
and the unsharded model, and the same outputs and gradients as the
unsharded model."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from _layout_models import gemma, gpt2, llama, mesh, mlp, token_batch

from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.sharding import check_layout_map, plan_layout_map

MESHES = [(2, 2), (1, 4)]


@pytest.fixture(scope="module")
def hub_models():
    """One unsharded build of each backbone (they are only read)."""
    return {"gemma": gemma(), "llama": llama(), "gpt2": gpt2()}


@pytest.mark.slow  # keras_hub's import and builds
@pytest.mark.parametrize("shape", MESHES, ids=["2x2", "1x4"])
@pytest.mark.parametrize("name", ["gemma", "llama"])
def test_planned_bytes_at_most_keras_hubs(hub_models, name, shape):
    model = hub_models[name]
    device_mesh = mesh(shape)
    planned = check_layout_map(model, plan_layout_map(model, device_mesh))
    hub = check_layout_map(model, type(model).get_layout_map(device_mesh))
    assert planned.param_bytes_per_device <= hub.param_bytes_per_device
    assert planned.sharded_fraction < 0.26  # ~1/4: every kernel split 4 ways
    assert planned.fallbacks == {}
    if name == "llama":  # keras-hub's map has no key for the LM head
        assert "token_embedding/reverse_embeddings" in hub.fallbacks


@pytest.mark.slow  # keras_hub's import and builds
@pytest.mark.parametrize("name", ["gemma", "llama", "gpt2"])
def test_megatron_roles_alternate(hub_models, name):
    model = hub_models[name]
    layout_map = plan_layout_map(model, mesh((1, 4)))
    roles = layout_map._keras_mgpu_plan.roles
    assert layout_map._keras_mgpu_plan.dataflow == "traced"
    block = {"gemma": "decoder_block_0/"}.get(name, "transformer_layer_0/")
    by_name = {
        path[len(block) :]: role
        for path, role in roles.items()
        if path.startswith(block) and path.endswith("kernel")
    }
    column = [k for k, r in by_name.items() if r == "column"]
    row = [k for k, r in by_name.items() if r == "row"]
    assert {k.rsplit("/", 2)[-2] for k in column} >= {"query", "key", "value"}
    assert any("attention_output" in k for k in row)
    assert len(row) == 2 and len(column) == len(by_name) - 2
    # The heads are split (column) / contracted (row) along the model axis.
    query = [k for k in by_name if k.endswith("query/kernel")][0]
    axes = layout_map[block + query].axes
    heads = 0 if name == "gemma" else 1
    assert axes[heads] == "model"


@pytest.mark.slow  # keras_hub's import and builds
@pytest.mark.parametrize("shape", MESHES, ids=["2x2", "1x4"])
@pytest.mark.parametrize("name", ["gpt2", "mlp"])
def test_no_hub_map_per_device_bytes(hub_models, name, shape):
    model = hub_models["gpt2"] if name == "gpt2" else mlp()
    report = check_layout_map(model, plan_layout_map(model, mesh(shape)))
    model_size = shape[1]
    assert report.sharded_fraction <= 1.1 / model_size
    assert report.fallbacks == {}
    if name == "mlp":  # Megatron pairs, one after the other
        roles = report.planner.roles
        assert [
            roles[f"{n}_{i}/kernel"] for i in (0, 1) for n in ("up", "down")
        ] == ["column", "row"] * 2
        assert "head/kernel" not in roles  # 512 bytes: replicated


def _grads(model, inputs):
    """Outputs, and gradients of a loss that depends on every output (the
    sum of squares would not: it is constant after an RMS norm)."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    @jax.jit
    def loss_and_grads(trainable):
        def loss(trainable):
            out = model.stateless_call(trainable, non_trainable, inputs)[0]
            out = out.astype("float32")
            weights = jax.random.normal(jax.random.key(0), out.shape)
            return jax.numpy.sum(out * weights), out

        return jax.value_and_grad(loss, has_aux=True)(trainable)

    (_, out), grads = loss_and_grads(trainable)
    return np.asarray(out), [np.asarray(g) for g in grads]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,shape", [("gemma", (2, 2)), ("llama", (1, 4))], ids=str
)
def test_sharded_outputs_and_gradients_match(hub_models, name, shape):
    reference = hub_models[name]
    device_mesh = mesh(shape)
    layout_map = plan_layout_map(reference, device_mesh)
    inputs = token_batch()
    want_out, want_grads = _grads(reference, inputs)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with distribution.scope():
        model = {"gemma": gemma, "llama": llama}[name]()
        model.set_weights(reference.get_weights())
        got_out, got_grads = _grads(model, inputs)
    report = check_layout_map(model, layout_map)
    # What the devices hold is what the report computes.
    assert report.measured_param_bytes_per_device == (
        report.param_bytes_per_device
    )
    query = [v for v in model.weights if v.path.endswith("query/kernel")][0]
    assert len(query.value.sharding.device_set) == 4
    np.testing.assert_allclose(got_out, want_out, rtol=1e-4, atol=1e-4)
    for variable, got, want in zip(
        model.trainable_variables, got_grads, want_grads
    ):
        np.testing.assert_allclose(
            got, want, rtol=1e-4, atol=1e-4, err_msg=variable.path
        )


@pytest.mark.slow  # keras_hub's import and builds
def test_single_kv_head_splits_the_head_dimension():
    """Gemma 2B's shape (1 key/value head): keras-hub's map cannot split the
    head axis 4 ways (the checker says so before the build fails); the plan
    splits the head dimension instead and says why."""
    model = gemma(kv_heads=1)
    device_mesh = mesh((1, 4))
    with pytest.raises(ValueError, match=r"attention.*key.*does not divide 1"):
        check_layout_map(model, type(model).get_layout_map(device_mesh))
    layout_map = plan_layout_map(model, device_mesh)
    key = "decoder_block_0/attention/key/kernel"
    assert layout_map[key].axes == (None, None, "model")
    assert "not divisible" in layout_map._keras_mgpu_plan.reasons[key]
    report = check_layout_map(model, layout_map)
    assert report.sharded_fraction < 0.26


def test_nothing_divisible_falls_back_to_replication():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(9, name="odd")(inputs)  # (6, 9): 4 divides none
    x = keras.layers.Dense(64, name="even")(x)
    model = keras.Model(inputs, x)
    layout_map = plan_layout_map(model, mesh((1, 4)), min_shard_bytes=0)
    report = check_layout_map(model, layout_map)
    assert "odd/kernel" in report.fallbacks
    assert "divisible" in report.fallbacks["odd/kernel"]
    assert "odd/kernel" in report.replicated
    assert "odd/kernel" not in str(list(layout_map))
    assert layout_map["even/kernel"] is not None


def test_min_shard_bytes_and_policy():
    model = mlp()
    device_mesh = mesh((2, 2))
    balanced = check_layout_map(model, plan_layout_map(model, device_mesh))
    model_only = check_layout_map(
        model, plan_layout_map(model, device_mesh, policy="model")
    )
    assert balanced.sharded_fraction < 0.3
    assert 0.45 < model_only.sharded_fraction < 0.55
    whole = plan_layout_map(model, device_mesh, min_shard_bytes=10**9)
    assert len(whole) == 0
    assert "min_shard_bytes" in whole._keras_mgpu_plan.reasons["up_0/kernel"]


def test_overrides_win():
    model = mlp()
    layout_map = plan_layout_map(
        model, mesh((1, 4)), overrides={"up_.*/kernel": (None, None)}
    )
    assert layout_map["up_0/kernel"].axes == (None, None)
    assert layout_map["up_1/kernel"].axes == (None, None)
    assert layout_map["down_0/kernel"].axes[0] == "model"
    notes = layout_map._keras_mgpu_plan
    assert notes.overridden["up_0/kernel"] == "up_.*/kernel"
    check_layout_map(model, layout_map)  # one pattern per variable


def test_subclassed_model_traced_from_inputs_or_alternating():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(64, name="a")
            self.b = keras.layers.Dense(64, name="b")
            self.c = keras.layers.Dense(64, name="c")

        def call(self, x):
            return self.c(keras.ops.relu(self.b(self.a(x))))

    model = Net()
    model(np.zeros((2, 16), "float32"))
    untraced = plan_layout_map(model, mesh((1, 4)), min_shard_bytes=0)
    assert untraced._keras_mgpu_plan.dataflow == "variable order"
    traced = plan_layout_map(
        model,
        mesh((1, 4)),
        min_shard_bytes=0,
        inputs=np.zeros((2, 16), "float32"),
    )
    assert traced._keras_mgpu_plan.dataflow == "traced"
    for layout_map in (untraced, traced):
        roles = layout_map._keras_mgpu_plan.roles
        assert [roles[f"net/{n}/kernel"] for n in "abc"] == [
            "column",
            "row",
            "column",
        ]


def test_parallel_branches_are_both_columns():
    """Two Dense layers reading the same input (a gated FFN) are both
    column-split; the one reading their product is row-split."""
    inputs = keras.Input((32,))
    gate = keras.layers.Dense(128, name="gate")(inputs)
    up = keras.layers.Dense(128, name="up")(inputs)
    x = keras.layers.Multiply()([keras.layers.Activation("gelu")(gate), up])
    out = keras.layers.Dense(32, name="down")(x)
    model = keras.Model(inputs, out)
    roles = plan_layout_map(model, mesh((1, 4)))._keras_mgpu_plan.roles
    assert roles["gate/kernel"] == roles["up/kernel"] == "column"
    assert roles["down/kernel"] == "row"
    assert roles["gate/bias"] == "bias of a column split"


@pytest.mark.parametrize("kind", ["functional", "sequential"])
def test_transposed_convolution_and_sequential_are_traced(kind):
    """A transposed convolution's kernel is reversed (`rev`) before it is
    contracted: still its use, so the Dense after it is row-split (it was
    column-split too, an extra all-gather). A `Sequential` from an `Input`
    (whose `model.input` raises) is traced, not planned by variable order.
    """
    layers = [
        keras.layers.Conv2DTranspose(16, 3, name="up"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, name="d1"),
        keras.layers.Dense(32, name="d2"),
    ]
    if kind == "sequential":
        model = keras.Sequential([keras.Input((8, 8, 4))] + layers)
    else:
        x = inputs = keras.Input((8, 8, 4))
        for layer in layers:
            x = layer(x)
        model = keras.Model(inputs, x)
    notes = plan_layout_map(
        model, mesh((1, 4)), policy="model", min_shard_bytes=0
    )._keras_mgpu_plan
    assert notes.dataflow == "traced"
    prefix = "sequential/" if kind == "sequential" else ""
    roles = [notes.roles[f"{prefix}{n}/kernel"] for n in ("up", "d1", "d2")]
    assert roles == ["column", "row", "column"]


def test_bad_arguments():
    model = mlp()
    device_mesh = mesh((2, 2))
    with pytest.raises(TypeError, match="`mesh`.*DeviceMesh"):
        plan_layout_map(model, (2, 2))
    with pytest.raises(ValueError, match="`model_axis`.*'tensor'"):
        plan_layout_map(model, device_mesh, model_axis="tensor")
    with pytest.raises(ValueError, match="`batch_axis`.*'data'"):
        plan_layout_map(model, device_mesh, batch_axis="data")
    with pytest.raises(ValueError, match="must differ"):
        plan_layout_map(model, device_mesh, batch_axis="model")
    with pytest.raises(ValueError, match="`policy`.*'fsdp'"):
        plan_layout_map(model, device_mesh, policy="fsdp")
    with pytest.raises(ValueError, match="min_shard_bytes=-1"):
        plan_layout_map(model, device_mesh, min_shard_bytes=-1)
    with pytest.raises(ValueError, match=r"'nope', which matches no variable"):
        plan_layout_map(model, device_mesh, overrides={"nope": (None,)})
    with pytest.raises(ValueError, match="not a regular expression"):
        plan_layout_map(model, device_mesh, overrides={"up_(": (None,)})
    with pytest.raises(TypeError, match="`overrides`"):
        plan_layout_map(model, device_mesh, overrides=[("up_0", None)])
    with pytest.raises(ValueError, match="must be built"):
        plan_layout_map(keras.layers.Dense(3), device_mesh)
    plan_layout_map(model, device_mesh, batch_axis=None)  # allowed


def test_refuses_tensorflow_naming_apply_placement(monkeypatch):
    import keras_mgpu._flavour as flavour

    monkeypatch.setattr(flavour.keras.backend, "backend", lambda: "tensorflow")
    for call in (
        lambda: plan_layout_map(mlp(), mesh((1, 4))),
        lambda: check_layout_map(mlp(), keras.distribution.LayoutMap(None)),
    ):
        with pytest.raises(BackendNotSupportedError, match="apply_placement"):
            call()
