"""In-place recompute on keras-hub models: a BERT-style encoder inside a
user classifier and a GPT-2-style causal LM, random-init, tiny, no
download (the `hub` extra).

Reference: the same model built from the same seed without recompute.
Dropout is on (0.1) everywhere; outputs and gradients are compared bit for
bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

keras_hub = pytest.importorskip(
    "keras_hub",
    reason='keras-hub is not installed (pip install "keras-mgpu[hub]")',
)

from test_recompute_in_place import assert_identical, step  # noqa: E402

from keras_mgpu import _flavour  # noqa: E402
from keras_mgpu.layers import (  # noqa: E402
    apply_recompute,
    recomputed_layers,
    strip_recompute,
)
from keras_mgpu.layers.recompute_in_place import segment_plan  # noqa: E402

keras = _flavour.keras
tf = _flavour.tf

SIZES = dict(
    vocabulary_size=50,
    num_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    max_sequence_length=16,
    dropout=0.1,
)
SEQ = 12


def token_batch(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    padding = np.ones((n, SEQ), "int32")
    padding[: n // 2, 9:] = 0  # half the rows padded
    return {
        "token_ids": rng.integers(1, 50, (n, SEQ)).astype("int32") * padding,
        "padding_mask": padding,
    }


BERT_X = {**token_batch(16), "segment_ids": np.zeros((16, SEQ), "int32")}
GPT_X = token_batch(16, seed=1)


def bert_classifier(seed: int = 7) -> keras.Model:
    """A user classifier around a 2-layer `BertBackbone`."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        num_layers=2, name="bert_backbone", **SIZES
    )
    inputs = {
        name: keras.Input((None,), dtype="int32", name=name)
        for name in ("token_ids", "segment_ids", "padding_mask")
    }
    pooled = backbone(inputs)["pooled_output"]
    pooled = keras.layers.Dropout(0.1, name="head_dropout")(pooled)
    outputs = keras.layers.Dense(3, name="head")(pooled)
    return keras.Model(inputs, outputs, name="classifier")


def gpt2_lm(seed: int = 7, num_layers: int = 4):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(num_layers=num_layers, **SIZES)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph"])
def test_bert_classifier_bit_identical_with_dropout(compiled):
    plain, model = bert_classifier(), bert_classifier()
    backbone = model.get_layer("bert_backbone")
    configs = model.get_config(), backbone.get_config()
    apply_recompute(model, keras_hub.layers.TransformerEncoder, in_place=True)
    assert [layer.name for layer in recomputed_layers(model)] == [
        "transformer_layer_0",
        "transformer_layer_1",
    ]
    assert type(model.get_layer("bert_backbone")) is type(backbone)
    assert (model.get_config(), backbone.get_config()) == configs
    for _ in range(2):  # seed states advance alike
        assert_identical(
            step(model, BERT_X, compiled), step(plain, BERT_X, compiled)
        )


def resnet_classifier(seed: int = 7) -> keras.Model:
    """A user classifier around a tiny 2-stage keras-hub `ResNetBackbone`."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 32],
        stackwise_num_blocks=[2, 2],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(16, 16, 3),
    )
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.GlobalAveragePooling2D(name="pool")(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def resnet_block(layer) -> str | None:
    """`stack0_block1` for the layers of that residual block, else None."""
    parts = layer.name.split("_")
    return "_".join(parts[:2]) if parts[0].startswith("stack") else None


def test_resnet_blocks_inside_a_classifier_with_default_layers():
    x = np.random.default_rng(2).normal(size=(4, 16, 16, 3)).astype("float32")
    plain, model = resnet_classifier(), resnet_classifier()
    apply_recompute(model, in_place=True, group_by=resnet_block)
    backbone = model.layers[1]
    assert [
        {resnet_block(layer) for layer in s} for s in segment_plan(backbone)
    ] == [
        {"stack0_block0"},
        {"stack0_block1"},
        {"stack1_block0"},
        {"stack1_block1"},
    ]
    for compiled in (False, True):
        assert_identical(step(model, x, compiled), step(plain, x, compiled))


def test_gpt2_sqrt_policy_on_the_decoder_stack():
    plain, lm = gpt2_lm(), gpt2_lm()
    apply_recompute(
        lm, keras_hub.layers.TransformerDecoder, policy="sqrt", in_place=True
    )
    assert type(lm) is keras_hub.models.GPT2CausalLM
    # 4 decoders fed a padding mask besides the stream: segments of 2.
    assert [[layer.name for layer in s] for s in segment_plan(lm.backbone)] == [
        ["transformer_layer_0", "transformer_layer_1"],
        ["transformer_layer_2", "transformer_layer_3"],
    ]
    # Eager here; in graph mode under Mirrored in the fit test below.
    assert_identical(step(lm, GPT_X), step(plain, GPT_X))
    # Generation runs the decoders with a cache (float) and an index (int).
    ids = tf.constant(GPT_X["token_ids"][:2])
    for model in (lm, plain):
        hidden, cache = model._build_cache(ids)
        logits, _, _ = model.call_with_cache(ids[:, :1], cache, 0)
        model.generated = [np.asarray(hidden), np.asarray(logits)]
    assert_identical(lm.generated, plain.generated)
    strip_recompute(lm)
    assert segment_plan(lm.backbone) == [] and recomputed_layers(lm) == []


def test_keras_files_and_presets_keep_the_plain_model(tmp_path):
    lm = gpt2_lm(num_layers=2)
    apply_recompute(lm, keras_hub.layers.TransformerDecoder, in_place=True)
    path = os.path.join(tmp_path, "lm.keras")
    lm.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is keras_hub.models.GPT2CausalLM
    assert recomputed_layers(loaded) == []
    np.testing.assert_array_equal(
        loaded.predict(GPT_X, verbose=0), lm.predict(GPT_X, verbose=0)
    )
    preset = os.path.join(tmp_path, "preset")
    lm.backbone.save_to_preset(preset)
    backbone = keras_hub.models.Backbone.from_preset(preset)
    assert type(backbone) is keras_hub.models.GPT2Backbone
    assert backbone.get_config() == lm.backbone.get_config()
    for a, b in zip(backbone.weights, lm.backbone.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    apply_recompute(
        backbone, keras_hub.layers.TransformerDecoder, in_place=True
    )
    assert len(recomputed_layers(backbone)) == 2
    # A user classifier around BERT: its .keras file too.
    classifier = bert_classifier()
    apply_recompute(
        classifier, keras_hub.layers.TransformerEncoder, in_place=True
    )
    path = os.path.join(tmp_path, "classifier.keras")
    classifier.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.get_layer("bert_backbone")) is (
        keras_hub.models.BertBackbone
    )
    np.testing.assert_array_equal(
        loaded.predict(BERT_X, verbose=0), classifier.predict(BERT_X, verbose=0)
    )


def _every_component_fit(model, x, y, accumulation: int = 2):
    from keras_mgpu.callbacks import (
        GPULoadMonitor,
        LearningRateScaler,
        LearningRateWarmup,
        MemoryMonitor,
    )
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    model.compile(
        GradientAccumulationOptimizer(
            keras.optimizers.Adam(1e-3), accumulation
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model.fit(
        x,
        y,
        batch_size=4,
        shuffle=False,
        verbose=0,
        callbacks=[
            LearningRateScaler(base_batch_size=4, batch_size=4, verbose=0),
            LearningRateWarmup(warmup_steps=2, initial_learning_rate=1e-4),
            MemoryMonitor(warn_fraction=None),
            GPULoadMonitor(interval=0.05),
        ],
    )


def _assert_components_logged(history) -> None:
    keys = set(history.history)
    assert any(k.startswith("mem/") for k in keys), keys
    assert any(k.startswith(("gpu/", "cpu/")) for k in keys), keys
    assert "learning_rate" in keys
    assert all(np.isfinite(history.history["loss"]))


@pytest.mark.slow
def test_bert_fit_mirrored_every_component_bit_identical():
    from conftest import make_strategy

    strategy = make_strategy("mirrored_2")
    labels = np.arange(16) % 3
    weights = []
    for switch in (False, True):
        with strategy.scope():
            model = bert_classifier()
            if switch:
                apply_recompute(
                    model, keras_hub.layers.TransformerEncoder, in_place=True
                )
            history = _every_component_fit(model, BERT_X, labels)
        _assert_components_logged(history)
        assert int(model.optimizer.iterations.numpy()) == 2
        weights.append([np.asarray(w.numpy()) for w in model.weights])
    assert len(recomputed_layers(model)) == 2
    assert_identical(weights[1], weights[0])
    # Not vacuous: training moved every weight of the encoders.
    fresh = bert_classifier()
    moved = [
        not np.array_equal(trained, initial.numpy())
        for trained, initial in zip(weights[1], fresh.weights, strict=True)
        if "transformer_layer" in initial.path
    ]
    assert len(moved) > 10 and all(moved)


@pytest.mark.slow
def test_gpt2_sqrt_fit_mirrored_every_component():
    from conftest import make_strategy

    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        lm = gpt2_lm(num_layers=2)
        apply_recompute(
            lm,
            keras_hub.layers.TransformerDecoder,
            policy="sqrt",
            in_place=True,
        )
        before = [np.asarray(w.numpy()) for w in lm.trainable_weights]
        history = _every_component_fit(lm, GPT_X, GPT_X["token_ids"])
    _assert_components_logged(history)
    assert len(segment_plan(lm.backbone)) == 1  # ceil(sqrt(2)) = 2 layers
    moved = [
        not np.array_equal(a, w.numpy())
        for a, w in zip(before, lm.trainable_weights, strict=True)
        if "transformer_layer" in w.path
    ]
    assert len(moved) > 10 and all(moved)  # the decoders trained


def test_min_memory_plans_decoder_layers_one_per_segment():
    """A GPT-2 decoder layer holds many times what it hands on: the
    min_memory plan is per-layer recompute (every decoder recomputed, no
    segment), not an error (it said "found no run")."""
    lm = gpt2_lm(num_layers=4)
    apply_recompute(
        lm, keras_hub.layers.TransformerDecoder, policy="min_memory"
    )
    assert segment_plan(lm.backbone) == []
    assert len(recomputed_layers(lm)) == 4
