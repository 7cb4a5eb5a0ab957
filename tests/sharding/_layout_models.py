"""Tiny models for the sharding tests (built from configs, no download)."""

from __future__ import annotations

import keras
import numpy as np

VOCAB = 256
SEQ = 8


def mesh(shape):
    devices = keras.distribution.list_devices("cpu")[:4]
    return keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)


def gemma(kv_heads=4):
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=kv_heads,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=16,
    )


def llama():
    import keras_hub

    return keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
    )


def gpt2():
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=SEQ,
    )


def mlp(width=32, hidden=128, depth=2):
    """A functional MLP with named layers (the paths must be the same
    when it is rebuilt under the distribution)."""
    inputs = keras.Input((width,))
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(hidden, activation="relu", name=f"up_{i}")(x)
        x = keras.layers.Dense(width, name=f"down_{i}")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def token_batch(batch=4):
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(0, VOCAB, (batch, SEQ)).astype("int32"),
        "padding_mask": np.ones((batch, SEQ), "int32"),
    }
