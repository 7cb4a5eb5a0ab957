"""Tiny keras-hub backbones (random init, no download, dropout on) for the
selective-recompute tests of both backends."""

from __future__ import annotations

import keras_hub

from keras_mgpu.layers.recompute_in_place import is_switched_per_layer
from keras_mgpu.testing import set_random_seed

HIDDEN, HEADS = 16, 2


def gpt2(seed: int = 7):
    set_random_seed(seed)
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=50,
        num_layers=2,
        num_heads=HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=32,
        max_sequence_length=16,
        dropout=0.1,
    )


def llama(seed: int = 7):
    set_random_seed(seed)
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=50,
        num_layers=2,
        num_query_heads=HEADS,
        num_key_value_heads=1,
        hidden_dim=HIDDEN,
        intermediate_dim=32,
        dropout=0.1,
        tie_word_embeddings=True,  # else one weight gets no gradient
    )


def switched_parts(block) -> list:
    """The parts of `block` that `policy="selective"` switched to recompute
    (one recomputed region each), in layer-tree order: `name.call` (the
    whole layer), `name._compute_attention` (an attention core),
    `name.activation` (a Dense's or the block's activation); the block
    itself is named `(block)`."""
    found = []
    for layer in block._flatten_layers(include_self=True):
        name = "(block)" if layer is block else layer.name
        if is_switched_per_layer(layer):
            found.append(f"{name}.call")
        if layer.__dict__.get("_keras_mgpu_recompute_core"):
            found.append(f"{name}._compute_attention")
        if "_keras_mgpu_recompute_activation" in layer.__dict__:
            found.append(f"{name}.activation")
    return found
