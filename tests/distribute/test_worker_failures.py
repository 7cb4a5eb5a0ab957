"""A worker killed or stalled in the middle of a 2-worker Keras 3 `fit`:
the survivor fails within the watchdog's bound, naming it, and the
restarted job resumes from the chief's backup to the weights of an
uninterrupted run (accumulation window, warmup and update counter
included)."""

from __future__ import annotations

import pytest
from _training import max_abs_diff
from distribute import mw_backup_bodies as bodies
from distribute._backup_scenario import interrupted_then_resumed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    return interrupted_then_resumed(
        str(tmp_path_factory.mktemp("killed")), "kill"
    )


def test_survivor_fails_in_bounded_time_naming_the_dead_worker(killed):
    dead, survivor = killed["first"][1], killed["first"][0]
    assert dead is None  # SIGKILLed
    assert "UnavailableError" in survivor["error"]
    assert "WorkerWatchdog" in survivor["error"]
    assert "worker 1 (127.0.0.1:" in survivor["error"]
    assert "no heartbeat" in survivor["error"]
    # Detected through stale heartbeats, well before the step timeout.
    assert survivor["failed_after"] < bodies.WATCHDOG_TIMEOUT + 2


def test_only_the_chief_backup_is_kept(killed):
    files = killed["backup_files"]
    assert "training_metadata.json" in files
    assert [f for f in files if f.endswith(".weights.h5")] == [
        "backup-1-e1.weights.h5"
    ]
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
    assert "worker 1 (127.0.0.1:" in survivor["error"]
    assert "stalled in Python" in survivor["error"]
    assert "in on_train_batch_begin" in survivor["error"]
    assert bodies.WATCHDOG_TIMEOUT <= survivor["failed_after"]
    assert survivor["failed_after"] < bodies.WATCHDOG_TIMEOUT + 3
    # The stalled worker fails too once it resumes: nothing hangs.
    assert stalled["error"] is not None
