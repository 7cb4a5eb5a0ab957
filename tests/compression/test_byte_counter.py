"""CrossDeviceByteCounter counts what runs: one replica's bytes per
reduction, by dtype and shape, nothing for an untaken branch, sparse rows
at run time."""

from __future__ import annotations

import pytest
import tensorflow as tf
from conftest import make_strategy

from keras_mgpu.compression import CrossDeviceByteCounter


@pytest.fixture
def counted():
    strategy = make_strategy("mirrored_2")
    counter = CrossDeviceByteCounter(strategy)
    yield strategy, counter
    counter.remove()


def test_counts_one_replicas_bytes_per_tensor(counted):
    strategy, counter = counted

    @tf.function
    def step():
        def replica():
            context = tf.distribute.get_replica_context()
            return context.all_reduce(
                "sum", [tf.ones([3, 4]), tf.ones([5], tf.float16)]
            )

        return strategy.run(replica)

    step()
    step()
    records = {(r["dtype"], r["shape"]): r for r in counter.records()}
    assert records[("float32", (3, 4))]["bytes"] == 2 * 48
    assert records[("float32", (3, 4))]["calls"] == 2
    assert records[("float16", (5,))]["bytes"] == 2 * 10
    assert counter.total_bytes() == 2 * 58
    assert "total bytes: 116" in counter.summary()
    counter.reset()
    assert counter.total_bytes() == 0 and counter.records() == []


def test_untaken_branch_counts_nothing(counted):
    strategy, counter = counted

    @tf.function
    def step(flag):
        values = strategy.run(lambda: tf.ones([7]))
        return tf.cond(
            flag,
            lambda: strategy.reduce("sum", values, axis=None),
            lambda: tf.zeros([7]),
        )

    step(tf.constant(False))
    assert counter.total_bytes() == 0
    step(tf.constant(True))
    assert counter.total_bytes() == 28


def test_sparse_rows_are_counted_when_they_run(counted):
    strategy, counter = counted

    @tf.function
    def step(rows):
        def replica():
            context = tf.distribute.get_replica_context()
            slices = tf.IndexedSlices(
                tf.ones([rows, 4]), tf.range(rows, dtype=tf.int64), [10, 4]
            )
            return context.all_reduce("sum", slices)

        return strategy.run(replica)

    step(tf.constant(3))
    step(tf.constant(5))
    (record,) = counter.records()
    assert record["kind"] == "sparse"
    assert record["bytes"] == (3 + 5) * (4 * 4 + 8)


def test_must_be_created_outside_the_scope():
    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        with pytest.raises(ValueError, match=r"outside `strategy.scope\(\)`"):
            CrossDeviceByteCounter(strategy)
