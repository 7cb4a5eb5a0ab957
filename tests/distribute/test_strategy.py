"""Strategy helpers: replicas, global batch size, worker identity."""

from __future__ import annotations

import json

import pytest

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras
from keras_mgpu.distribute import (
    accumulation_steps_of,
    global_batch_size,
    num_replicas_in_sync,
    worker_info,
)

REPLICAS = {
    "default": 1,
    "one_device": 1,
    "mirrored_2": 2,
    "mirrored_4": 4,
    "central_storage": 2,
}


def test_global_batch_size_under_each_strategy(strategy, strategy_name):
    replicas = REPLICAS[strategy_name]
    assert num_replicas_in_sync(strategy) == replicas
    assert global_batch_size(16, strategy) == 16 * replicas
    with strategy.scope():
        assert global_batch_size(16) == 16 * replicas
        optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(), 4)
    assert global_batch_size(16, strategy, optimizer) == 64 * replicas


def test_accumulation_steps_read_through_wrappers():
    inner = GradientAccumulationOptimizer(keras.optimizers.SGD(), 3)
    assert (
        accumulation_steps_of(keras.optimizers.LossScaleOptimizer(inner)) == 3
    )
    assert accumulation_steps_of(keras.optimizers.SGD()) == 1
    builtin = keras.optimizers.SGD(gradient_accumulation_steps=5)
    assert accumulation_steps_of(builtin) == 5


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, r"`per_replica_batch_size` must be an integer >= 1"),
        (8.0, TypeError, r"Received: per_replica_batch_size=8\.0"),
    ],
)
def test_global_batch_size_bad_input(value, error, message):
    with pytest.raises(error, match=message):
        global_batch_size(value)


def test_worker_info_from_tf_config(monkeypatch):
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": 1}}
        ),
    )
    info = worker_info()
    assert info == {
        "task_type": "worker",
        "task_id": 1,
        "rank": 1,
        "num_workers": 2,
        "is_chief": False,
        "task_name": "worker:1",
    }


@pytest.mark.parametrize(
    "task, rank, is_chief",
    [
        (("chief", 0), 0, True),
        (("worker", 0), 1, False),  # not the chief, and not rank 0
        (("worker", 1), 2, False),
        (("evaluator", 0), None, False),  # not a collective member
    ],
)
def test_a_task_is_its_type_and_index_not_its_index(task, rank, is_chief):
    from keras_mgpu.distribute.strategy import task_identity

    cluster = {
        "chief": ["127.0.0.1:1"],
        "worker": ["127.0.0.1:2", "127.0.0.1:3"],
        "evaluator": ["127.0.0.1:4"],
    }
    info = task_identity(cluster, *task)
    assert info["rank"] == rank
    assert info["is_chief"] is is_chief
    assert info["num_workers"] == 3  # chief + workers; no evaluator
    assert info["task_name"] == f"{task[0]}:{task[1]}"


def test_cluster_members_in_rank_order():
    from keras_mgpu.distribute.strategy import cluster_members

    cluster = {"worker": ["w0", "w1"], "chief": ["c"], "evaluator": ["e"]}
    assert cluster_members(cluster) == [
        ("chief", 0, "c"),
        ("worker", 0, "w0"),
        ("worker", 1, "w1"),
    ]


def test_worker_info_single_machine(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert worker_info()["is_chief"] is True
    assert worker_info()["num_workers"] == 1
