"""A worker killed or stalled in the middle of a 2-worker Keras 3 `fit`:
the survivor fails within the watchdog's bound, naming it, and the
restarted job resumes from the chief's backup to the weights of an
uninterrupted run (accumulation window, warmup and update counter
included)."""

from __future__ import annotations

import re

import pytest
from _training import max_abs_diff
from distribute import mw_backup_bodies as bodies
from distribute._backup_scenario import (
    assert_names_the_killed_worker,
    interrupted_then_resumed,
    names_worker_1,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    return interrupted_then_resumed(
        str(tmp_path_factory.mktemp("killed")), "kill"
    )


def test_survivor_fails_in_bounded_time_naming_the_dead_worker(killed):
    dead, survivor = killed["first"][1], killed["first"][0]
    assert dead is None  # SIGKILLed
    assert_names_the_killed_worker(survivor["error"])
    # Bounded: whichever detector wins, within the watchdog's timeout and
    # the margin of tests/distribute/test_watchdog_faults.py (a heartbeat,
    # a read, a loaded host), not a race between detectors.
    assert survivor["failed_after"] < bodies.WATCHDOG_TIMEOUT + 5


def test_only_the_chief_backup_is_kept(killed):
    files = killed["backup_files"]
    assert "training_metadata.json" in files
    weights = [f for f in files if f.endswith(".weights.h5")]
    # One file, named by the run that wrote it (never overwritten later).
    assert len(weights) == 1
    assert re.fullmatch(r"backup-[0-9a-f]{12}-000001\.weights\.h5", weights[0])
    assert not killed["backup_left"]  # deleted when training ended


def test_restart_resumes_to_the_uninterrupted_weights(killed):
    reference = killed["reference"]
    for result in killed["restarted"]:
        assert result["error"] is None
        assert result["epochs_run"] == [1, 2, 3]  # resumed after epoch 0
        assert result["updates"] == reference["updates"]
        assert max_abs_diff(result["weights"], reference["weights"]) < 1e-6
    assert (
        killed["restarted"][0]["weights"] == killed["restarted"][1]["weights"]
    )


def test_a_stalled_worker_is_named_with_where_it_is_stuck(tmp_path):
    from _processes import run_workers

    survivor, stalled = run_workers(
        "distribute.mw_backup_bodies:train",
        2,
        timeout=180,
        args=(str(tmp_path / "backup"), "stall"),
    )
    assert "WorkerWatchdog" in survivor["error"]
    assert names_worker_1(survivor["error"]), survivor["error"]
    assert "stalled in Python" in survivor["error"]
    assert "in on_train_batch_begin" in survivor["error"]
    assert bodies.WATCHDOG_TIMEOUT <= survivor["failed_after"]
    assert survivor["failed_after"] < bodies.WATCHDOG_TIMEOUT + 3
    # The stalled worker fails too once it resumes: nothing hangs.
    assert stalled["error"] is not None


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    from _processes import run_workers

    return run_workers(
        "distribute.mw_backup_bodies:restore_agreement",
        2,
        timeout=150,  # a worker left waiting in a collective: a failure
        args=(str(tmp_path_factory.mktemp("agreement") / "backup"),),
    )


def test_a_worker_that_cannot_load_makes_every_worker_raise(agreement):
    """No worker is left blocked in a collective: all raise the same."""
    for result in agreement:
        error = result["none_loadable"]["error"]
        assert error.startswith("ValueError: No backup in backup_dir=")
        assert "(epoch 2): worker 1 cannot read it" in error
        assert "(epoch 1): worker 1 cannot read it" in error
        assert "No worker starts training" in error
        assert result["none_loadable"]["after"] < 30
    assert (
        "simulated: cannot read any backup"
        in agreement[1]["none_loadable"]["error"]
    )


def test_workers_verify_the_weights_they_loaded(agreement):
    for result in agreement:
        error = result["other_weights"]["error"]
        assert error.startswith("ValueError: The workers loaded different ")
        assert "worker 0: " in error and "worker 1: " in error


def test_the_double_checkpoint_fallback_is_decided_for_all_workers(agreement):
    """Worker 1 cannot read the latest backup: both start from the
    previous one (not worker 1 alone), and end with the same weights."""
    chief, other = (r["latest_unreadable"] for r in agreement)
    assert chief["error"] is None and other["error"] is None
    assert chief["epochs"] == other["epochs"] == [1, 2]
    assert chief["weights"] == other["weights"]
