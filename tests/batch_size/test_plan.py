"""plan_batch: exact splits of a global batch, the nearest ones when there is
no good split, argument checks."""

from __future__ import annotations

import pytest
from conftest import make_strategy

from keras_mgpu import plan_batch
from keras_mgpu.batch_size import BatchPlan, NoExactSplitError


@pytest.mark.parametrize(
    "target, max_batch, replicas, expected",
    [
        (4096, 300, 2, (256, 8)),
        (4096, 2048, 2, (2048, 1)),
        (4096, 5000, 2, (2048, 1)),  # more fits than the share needs
        (4096, 1000, 1, (512, 8)),
        (48, 8, 2, (8, 3)),
        (96, 10, 4, (8, 3)),
        (1000, 300, 1, (250, 4)),
        (7, 7, 1, (7, 1)),
        (12, 5, 3, (4, 1)),
    ],
)
def test_fewest_accumulation_steps(target, max_batch, replicas, expected):
    plan = plan_batch(target, max_batch, num_replicas=replicas)
    assert (plan.per_replica_batch_size, plan.accumulation_steps) == expected
    assert plan.global_batch_size == target
    assert plan.step_batch_size == expected[0] * replicas


def test_product_is_always_the_target():
    for target in range(1, 200):
        for replicas in (1, 2, 3, 4):
            for max_batch in (1, 3, 8, 50):
                try:
                    plan = plan_batch(target, max_batch, num_replicas=replicas)
                except NoExactSplitError as exc:
                    assert target % replicas or max_batch > 1
                    for near in exc.nearest:
                        _check(near, max_batch, replicas)
                    continue
                _check(plan, max_batch, replicas)
                assert plan.global_batch_size == target


def _check(plan: BatchPlan, max_batch: int, replicas: int) -> None:
    assert (
        plan.per_replica_batch_size * replicas * plan.accumulation_steps
        == plan.global_batch_size
    )
    assert 1 <= plan.per_replica_batch_size <= max_batch
    assert plan.num_replicas == replicas
    if plan.accumulation_steps > 1:
        assert plan.fill >= 0.5


def test_not_a_multiple_of_the_replicas_names_the_nearest():
    with pytest.raises(
        NoExactSplitError,
        match=r"Argument `global_batch_size`=4097 is not a multiple of the 2 "
        r"replicas in sync.*Nearest that split: 4096 = 256 per replica x 2 "
        r"replica\(s\) x 8 accumulation step\(s\); 4100 = 205 per replica",
    ) as info:
        plan_batch(4097, 300, num_replicas=2)
    # 4,098 = 2 x 3 x 683 splits only into micro-batches of 3: not near.
    below, above = info.value.nearest
    assert (below.global_batch_size, above.global_batch_size) == (4096, 4100)
    assert isinstance(info.value, ValueError)


def test_exact_but_wasteful_split_is_refused_unless_asked():
    # 4,099 is prime: on one replica with room for 512 the only exact
    # split is 4,099 micro-steps of 1 sample.
    with pytest.raises(
        NoExactSplitError,
        match=r"splits exactly only into micro-batches of 1 \(x 4099 "
        r"accumulation steps on 1 replica\(s\)\), under min_fill=0.5 of the "
        r"512 that fit per replica \(pass min_fill=0 to accept it\)\. "
        r"Nearest that split: 4096 = 512 per replica x 1 replica\(s\) x 8 "
        r"accumulation step\(s\); 4100 = 410 per replica",
    ) as info:
        plan_batch(4099, 512, num_replicas=1)
    assert [p.global_batch_size for p in info.value.nearest] == [4096, 4100]
    assert all(p.fill >= 0.5 for p in info.value.nearest)
    plan = plan_batch(4099, 512, num_replicas=1, min_fill=0)
    assert (plan.per_replica_batch_size, plan.accumulation_steps) == (1, 4099)


def test_replicas_from_the_strategy():
    plan = plan_batch(48, 8, make_strategy("mirrored_2"))
    assert (plan.num_replicas, plan.accumulation_steps) == (2, 3)
    assert plan_batch(48, 8).num_replicas == 1  # default strategy
    assert str(plan) == (
        "48 = 8 per replica x 2 replica(s) x 3 accumulation step(s)"
    )


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"global_batch_size": 0}, ValueError, "`global_batch_size` must be"),
        ({"global_batch_size": -8}, ValueError, "Received: global_batch_size"),
        ({"global_batch_size": 8.0}, TypeError, "must be an integer >= 1"),
        (
            {"max_batch_size": 0},
            ValueError,
            r"`max_batch_size` must be an integer >= 1\. Received: "
            r"max_batch_size=0",
        ),
        ({"num_replicas": 0}, ValueError, "`num_replicas` must be"),
        ({"min_fill": 1.5}, ValueError, "`min_fill` must be a number"),
        (
            {"num_replicas": 2, "strategy": "mirrored_2"},
            ValueError,
            "Pass at most one of `strategy` and `num_replicas`",
        ),
    ],
)
def test_bad_arguments(kwargs, error, message):
    arguments = {"global_batch_size": 64, "max_batch_size": 8, **kwargs}
    if arguments.get("strategy") == "mirrored_2":
        arguments["strategy"] = make_strategy("mirrored_2")
    with pytest.raises(error, match=message):
        plan_batch(**arguments)


def test_the_old_argument_name_still_works_with_a_future_warning():
    with pytest.warns(FutureWarning, match="use `max_batch_size` instead"):
        plan = plan_batch(64, max_per_replica_batch=8, num_replicas=2)
    assert plan.max_batch_size == plan.max_per_replica_batch == 8
