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
