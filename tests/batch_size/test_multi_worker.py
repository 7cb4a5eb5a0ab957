"""Batch size by memory in 2 real MultiWorkerMirroredStrategy processes:
every worker probes its own device and all get the same answer, the
smallest. (Keras 3 `fit` fails under this strategy, keras#20585, so the
training itself is tested under MirroredStrategy in test_configure.py.)"""

from __future__ import annotations

import pytest
from _processes import run_workers
from batch_size.probe_bodies import (
    WORKER_BUDGETS_MB,
    WORKER_GLOBAL_BATCH,
    WORKER_SAFETY_MARGIN,
)

from keras_mgpu.batch_size.search import resolution


@pytest.mark.slow
def test_workers_agree_on_the_smallest_answer():
    results = run_workers(
        "batch_size.probe_bodies:multi_worker_configure",
        num_workers=2,
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1", "TF_NUM_INTEROP_THREADS": "1"},
    )
    first, second = results
    # Each worker measured its own device, with its own budget...
    own = first["worker_batch_sizes"]
    assert own == second["worker_batch_sizes"]
    assert own[1] < own[0]  # worker 1 has the smaller budget
    for index, result in enumerate(results):
        assert result["device"] == "CPU:0"
        assert result["safety_margin"] == WORKER_SAFETY_MARGIN
        budget = WORKER_BUDGETS_MB[index] * (1 - WORKER_SAFETY_MARGIN)
        measured = result["own_measurements"]
        # Below every batch that did not fit (the answer's confirmation
        # over a longer run may have failed where its first steps fit).
        failed = min(
            (b for b, peak in measured if peak is None or peak > budget),
            default=float("inf"),
        )
        fitting = [
            b
            for b, peak in measured
            if peak is not None and peak <= budget and b < failed
        ]
        # The largest that fits, or one a step or two below it where the
        # fitted line's peak had to be kept within the budget too.
        assert own[index] in fitting
        step = resolution(own[index], 1)
        assert max(fitting) - own[index] <= 2 * step, (index, result)
    # ...and all got the same setup, from the smallest answer.
    for key in (
        "batch_size",
        "fixed_mb",
        "per_sample_mb",
        "per_replica_batch_size",
        "accumulation_steps",
        "learning_rate",
        "optimizer",
    ):
        assert first[key] == second[key], key
    assert first["batch_size"] == min(own)
    assert first["replicas"] == 2
    assert (
        first["per_replica_batch_size"] * 2 * first["accumulation_steps"]
        == WORKER_GLOBAL_BATCH
    )
    assert first["accumulation_steps"] > 1
    assert first["optimizer"] == "GradientAccumulationOptimizer"
    assert "the smallest of the workers' answers" in first["explanation"]
