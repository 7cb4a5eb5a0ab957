"""The kill / stall and restart scenario shared by both flavours' tests."""

from __future__ import annotations

import os

from _processes import run_workers
from distribute import mw_backup_bodies as bodies

BODY = "distribute.mw_backup_bodies:train"


def interrupted_then_resumed(tmp_dir: str, mode: str) -> dict:
    """Run the job with worker 1 killed or stalled, then restart it whole.

    Returns the survivor's result of the first run, the backup files, both
    workers' results of the restart and the uninterrupted reference
    (computed in this process, without a strategy).
    """
    backup = os.path.join(tmp_dir, "backup")
    first = run_workers(BODY, 2, timeout=240, args=(backup, mode), may_die=(1,))
    backup_files = sorted(os.listdir(backup)) if os.path.isdir(backup) else []
    restarted = run_workers(BODY, 2, timeout=240, args=(backup, "none"))
    return {
        "first": first,
        "backup_files": backup_files,
        "restarted": restarted,
        "reference": bodies.uninterrupted(0),
        "backup_left": os.path.exists(backup),
    }


def names_worker_1(error: str) -> bool:
    """The watchdog's message names task worker:1 as TF_CONFIG does, with
    its address."""
    return "worker:1 (127.0.0.1:" in error


def assert_names_the_killed_worker(error: str) -> None:
    """The survivor's error names the killed task, whichever of three
    detectors wins the race: WorkerWatchdog's stale heartbeat; TensorFlow's
    peer health check (every 30 s: "task:1 is down"); or the collective in
    flight when the peer died, whose gRPC call to it fails ("Socket closed"
    from remote target task:1; measured in CI). The stall test, where no
    socket closes, needs the watchdog."""
    assert "UnavailableError" in error
    ours = "WorkerWatchdog" in error and names_worker_1(error)
    health_check = "/job:worker/replica:0/task:1 is down" in error
    socket = "from remote target /job:worker/replica:0/task:1" in error
    assert ours or health_check or socket, error
