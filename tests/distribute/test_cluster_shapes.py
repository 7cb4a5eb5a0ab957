"""Every keras_mgpu callback in one multi-worker `fit`, in each cluster
shape `TF_CONFIG` takes in the wild: worker-only (2 and 3 workers), and
`chief` + `worker` with an `evaluator` task (Kubeflow's TFJob, TensorFlow's
guides). `chief:0` and `worker:0` are two tasks: every row, log key and
backup is keyed by rank (the chief first), so all of them are filled.

One cluster per shape (module fixture); the bodies are in
tests/distribute/cluster_shape_bodies.py.
"""

from __future__ import annotations

import pytest
from _processes import cluster_tasks, run_workers
from _training import max_abs_diff

pytestmark = pytest.mark.slow

BODY = "distribute.cluster_shape_bodies:train_all_callbacks"
TOLERANCE = 1e-6  # float32 summation order
SHAPES = {
    "worker x2": {"num_workers": 2},
    "worker x3": {"num_workers": 3},
    "chief + worker + evaluator": {
        "num_workers": 2,
        "chief": True,
        "evaluator": True,
    },
}


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def shape(request, tmp_path_factory):
    spec = SHAPES[request.param]
    results = run_workers(
        BODY,
        timeout=240,
        args=(str(tmp_path_factory.mktemp("backup")),),
        **spec,
    )
    tasks = cluster_tasks(
        spec["num_workers"], spec.get("chief", False), spec.get("evaluator")
    )
    members = [r for (t, _), r in zip(tasks, results) if t != "evaluator"]
    evaluators = [r for (t, _), r in zip(tasks, results) if t == "evaluator"]
    return {
        "num_workers": spec["num_workers"],
        "members": members,
        "evaluators": evaluators,
        "reference": results[0]["reference"],
    }


def test_ranks_follow_the_chief_then_the_workers(shape):
    ranks = [r["rank"] for r in shape["members"]]
    assert ranks == list(range(shape["num_workers"]))
    assert [r["replicas"] for r in shape["members"]] == [
        shape["num_workers"]
    ] * shape["num_workers"]
    for result in shape["members"]:
        assert result["watchdog_report"] is None


def test_every_worker_logs_every_rank_filled(shape):
    n = shape["num_workers"]
    for result in shape["members"]:
        finite = set(result["finite_keys"])
        logs = result["logs"]
        for rank in range(n):
            for key in (
                f"mem/w{rank}_host_rss_mb",
                f"cpu/w{rank}_util_mean_pct",
                f"workers/w{rank}_step_ms",
                f"workers/w{rank}_wait_ms",
                f"workers/w{rank}_busy_ms",
            ):
                assert key in finite, (result["task"], key)
            # A row left unfilled would read 0.0 (the all-reduced zeros).
            assert logs[f"mem/w{rank}_host_rss_mb"] > 0
            assert logs[f"workers/w{rank}_step_ms"] > 0
        # No row beyond the members.
        assert f"mem/w{n}_host_rss_mb" not in result["log_keys"]
        assert result["straggler_keys"]
    # Gathered: every worker logs the same figures.
    first = shape["members"][0]["logs"]
    for result in shape["members"][1:]:
        for key in first:
            if key.startswith(("mem/w", "workers/w")):
                assert result["logs"][key] == first[key], key


def test_weights_equal_across_workers_and_one_process(shape):
    members = shape["members"]
    for result in members:
        assert (
            max_abs_diff(result["weights"], shape["reference"]) < TOLERANCE
        ), result["task"]
        assert result["weights"] == members[0]["weights"]
        assert result["backup_left"] == []  # deleted at the end of fit
        assert result["loss"] == members[0]["loss"]
        assert result["predicted"] == members[0]["predicted"]


def test_an_evaluator_runs_alone_and_logs_its_own(shape):
    if not shape["evaluators"]:
        pytest.skip("no evaluator task in this shape")
    (evaluator,) = shape["evaluators"]
    assert evaluator["rank"] is None
    assert evaluator["replicas"] == 1  # TensorFlow: a cluster of its own
    # It trains alone on the global batch: the one-process weights.
    assert max_abs_diff(evaluator["weights"], shape["reference"]) < TOLERANCE
    # Nothing gathered, no peer rows, nothing watched.
    keys = evaluator["log_keys"]
    assert not [k for k in keys if "/w0_" in k or "/w1_" in k], keys
    assert "mem/evaluator_host_rss_mb" in evaluator["finite_keys"]
    assert "cpu/evaluator_util_mean_pct" in evaluator["finite_keys"]
    assert evaluator["straggler_keys"] == []
    assert evaluator["watchdog_report"] is None
    assert evaluator["backup_left"] == []
