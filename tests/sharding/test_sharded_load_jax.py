"""Load into shards (keras#21634): a keras-hub backbone built and loaded on
the host, its layout planned from it, built from its config under
`ModelParallel`, weights copied slice by slice: no device ever holds a whole
weight it does not own, against Keras's `set_weights`, which puts each whole
weight on the default device first (a `keras_limit` test)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _layout_models import gemma, mesh, token_batch

from keras_mgpu.backend.jax.variables import largest_live_piece, live_array_ids
from keras_mgpu.sharding import copy_into_shards, on_host, plan_layout_map

keras_hub = pytest.importorskip("keras_hub")


def _host_and_sharded():
    keras.utils.set_random_seed(0)
    host = on_host(gemma)
    layout_map = plan_layout_map(host, mesh((1, 4)), policy="model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with distribution.scope():
        target = type(host).from_config(host.get_config())
    return host, target, distribution


def _embedding_bytes(model) -> int:
    return max(int(np.asarray(w.value).nbytes) for w in model.weights)


def _watch_pieces(monkeypatch) -> list:
    """The largest new piece on one device each time Keras lays out a
    value (`distribute_tensor`, where `assign` hands it over)."""
    from keras.src.backend.jax import distribution_lib

    before = live_array_ids()
    pieces = []
    original = distribution_lib.distribute_tensor

    def watched(tensor, layout):
        pieces.append(largest_live_piece(before))
        return original(tensor, layout)

    monkeypatch.setattr(distribution_lib, "distribute_tensor", watched)
    return pieces


def test_copy_into_shards_never_puts_a_whole_weight_on_a_device(monkeypatch):
    host, target, distribution = _host_and_sharded()
    seen = _watch_pieces(monkeypatch)
    report = copy_into_shards(host, target)
    monkeypatch.undo()
    largest = _embedding_bytes(host)
    assert report.variables == len(host.weights)
    assert report.largest_weight_bytes == largest
    # No device ever held a piece larger than its own slice of a weight:
    # never a whole weight it does not own (the embedding, the largest,
    # is split 4 ways by vocabulary).
    assert report.largest_shard_bytes <= largest // 4
    assert 0 < report.largest_piece_bytes <= report.largest_shard_bytes
    assert seen and max(seen) <= report.largest_shard_bytes
    # The copy is the model: same outputs as on the host.
    batch = token_batch()
    with distribution.scope():
        got = target(batch)
    want = host(batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    spec = target.get_layer("token_embedding").embeddings.value.sharding.spec
    assert tuple(spec)[0] == "model"


def test_refuses_another_architecture():
    host, target, _ = _host_and_sharded()
    other = on_host(lambda: gemma(kv_heads=2))
    with pytest.raises(ValueError, match="cannot take|weights"):
        copy_into_shards(other, target)
    del host


@pytest.mark.keras_limit
def test_keras_set_weights_puts_each_whole_weight_on_one_device(monkeypatch):
    """Keras 3.15: `Variable.assign` makes a NumPy value one array on the
    default device (`convert_to_tensor`) before `distribute_tensor` splits
    it: during `set_weights` a device holds the whole embedding beside its
    shards. Fails when Keras assigns into the shards directly."""
    host, target, _ = _host_and_sharded()
    own = [np.asarray(w.value) for w in host.weights]
    report = copy_into_shards(host, target)
    pieces = _watch_pieces(monkeypatch)
    target.set_weights(own)
    # The whole embedding as one piece on one device, 4x what ours held.
    assert pieces and max(pieces) >= _embedding_bytes(host)
    assert max(pieces) >= 4 * report.largest_piece_bytes
