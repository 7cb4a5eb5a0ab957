"""`WorkerWatchdog` with real 2-process clusters on 127.0.0.1: a slow but
healthy start is not aborted (nor a second `fit`, whose keys are apart from
the first one's); a task stalled in validation or `predict`, or killed in
`evaluate`, is named, by task and address, on its peer within the bound.

Three clusters (module fixtures), bodies in
tests/distribute/watchdog_bodies.py. Timing bounds have margins for a
loaded 2-core machine.
"""

from __future__ import annotations

import pytest
from _processes import run_workers
from distribute import watchdog_bodies as bodies
from distribute._backup_scenario import names_task

pytestmark = pytest.mark.slow

MARGIN = 5.0  # seconds past the bound: a heartbeat, a read, a loaded host


@pytest.fixture(scope="module")
def late_then_predict():
    return run_workers(
        "distribute.watchdog_bodies:late_start_then_predict_stall",
        2,
        timeout=240,
    )


@pytest.fixture(scope="module")
def validation_stall():
    return run_workers(
        "distribute.watchdog_bodies:validation_stall",
        2,
        chief=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def evaluate_kill():
    return run_workers(
        "distribute.watchdog_bodies:evaluate_kill",
        2,
        chief=True,
        timeout=240,
        may_die=(1,),
    )


def test_a_slow_but_healthy_start_is_not_aborted(late_then_predict):
    early, late = late_then_predict
    for result in (early, late):
        for run in ("fit1", "fit2", "evaluate"):
            assert result[run]["error"] is None, (run, result[run]["error"])
        assert result["fit2"]["report"] is None
        assert result["fit1"]["own_key_left"] is False  # cleaned at the end
    # worker:0 really waited for the late worker in its first step: longer
    # than a peer without status used to be given (5 s).
    assert early["fit2"]["first"] > bodies.LATE_BY - 1.0


def test_a_stall_in_predict_is_named(late_then_predict):
    early, late = late_then_predict
    error = early["predict"]["error"]
    report = early["predict"]["report"]
    assert "UnavailableError" in error and report in error
    assert "WorkerWatchdog: worker:0 (127.0.0.1:" in report, report
    assert "in predict step 2 for missing worker(s)" in report, report
    assert "worker:1 (127.0.0.1:" in report
    assert "stalled in Python" in report
    assert "in on_predict_batch_begin (after predict step 1)" in report
    after = early["predict"]["failed_after"]
    assert bodies.TIMEOUT - 1.0 <= after < bodies.TIMEOUT + MARGIN
    # The stalled task fails too once it resumes: nothing hangs.
    assert late["predict"]["error"] is not None


def test_a_stall_in_validation_is_named(validation_stall):
    chief, worker = validation_stall
    assert chief["task"] == "chief:0" and worker["task"] == "worker:0"
    error, report = chief["error"], chief["report"]
    assert "UnavailableError" in error and report in error
    assert "WorkerWatchdog: chief:0 (127.0.0.1:" in report, report
    assert "in validation step 2 (epoch 0) for missing" in report, report
    assert "worker:0 (127.0.0.1:" in report
    assert "stalled in Python" in report
    assert (
        "in on_test_batch_begin (after validation step 1 (epoch 0))" in report
    ), report
    after = chief["failed_after"]
    assert bodies.TIMEOUT - 1.0 <= after < bodies.TIMEOUT + MARGIN
    assert worker["error"] is not None
    # StragglerMonitor's hook went with the failed fit, on both.
    assert not chief["hook_left"] and not worker["hook_left"]


def test_a_task_killed_in_evaluate_is_named(evaluate_kill):
    chief, killed = evaluate_kill
    assert killed is None  # SIGKILLed
    assert chief["fit"]["error"] is None
    error = chief["error"]
    # The property, not a list of racing detectors: the chief failed and
    # its error names the killed task (our stale heartbeat says
    # "worker:0 (127.0.0.1:...)", TensorFlow's coordination service or
    # collectives "/job:worker/replica:0/task:0").
    assert error, "the chief did not fail"
    assert names_task(error, "worker", 0), error
    assert chief["failed_after"] < bodies.TIMEOUT + MARGIN
