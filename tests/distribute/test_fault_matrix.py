"""The fault matrix of keras_mgpu.callbacks.BackupAndRestore: a process
SIGKILLed at a training step, during the weights write (a torn file),
between the weights and the metadata, between the metadata and its rename,
after the commit, during `delete_checkpoint`, during validation; with
`save_freq="epoch"` and an int, `double_checkpoint` on and off; in one
process and in 2-process clusters (workers only, and chief + worker).

Each case: the killed run, then a restart of the same command, which must
end with the weights of an uninterrupted run (to float rounding) and the
same update count on every worker, and delete its backup; never a torn,
mixed or older state, never a hang (every process is time-bounded).

The file-level kill points are the callback's test-only seam
(KERAS_MGPU_TEST_KILL_AT). Single-process cases check the commit protocol:
the killed run is a child process, the restart runs here. The cluster cases
add what needs several processes: the chief's commit while a worker saves
privately, and a restart of every worker from the shared backup.
"""

from __future__ import annotations

import os
import time

import pytest
from _processes import run_in_process, run_workers
from _training import max_abs_diff
from distribute import fault_matrix_bodies as bodies

pytestmark = pytest.mark.slow

BODY = "distribute.fault_matrix_bodies:train"
KILL_ENV = "KERAS_MGPU_TEST_KILL_AT"

# case id: (processes, chief task, kills in turn, save_freq, double ckpt).
# A kill is (seam spec or None, kill callback spec or None); each kill is
# one run of the job, then a last run completes it.
CASES = {
    "1p-step-int": (1, False, [(None, ["step", 1, 3, "any"])], 2, False),
    "1p-torn-weights-int-dc": (
        1,
        False,
        [("weights_partial:chief:3", None)],
        2,
        True,
    ),
    "1p-weights-before-metadata-epoch": (
        1,
        False,
        [("weights_written:chief:2", None)],
        "epoch",
        False,
    ),
    "1p-metadata-before-rename-int-dc": (
        1,
        False,
        [("metadata_written:chief:4", None)],
        3,
        True,
    ),
    "1p-after-commit-epoch-dc": (
        1,
        False,
        [("committed:chief:2", None)],
        "epoch",
        True,
    ),
    "1p-delete-checkpoint-epoch": (
        1,
        False,
        [("pointer_deleted:chief", None)],
        "epoch",
        False,
    ),
    "1p-validation-epoch-dc": (
        1,
        False,
        [(None, ["validation", 1, "any"])],
        "epoch",
        True,
    ),
    "1p-two-crashes-int": (
        1,
        False,
        [(None, ["step", 0, 4, "any"]), ("weights_written:chief:2", None)],
        2,
        False,
    ),
    "2p-chief+worker-chief-at-step-int-dc": (
        2,
        True,
        [(None, ["step", 1, 2, "chief"])],
        2,
        True,
    ),
    "2p-worker-during-its-save-epoch": (
        2,
        False,
        [("weights_written:worker:2", None)],
        "epoch",
        False,
    ),
    "2p-chief-torn-weights-int-dc": (
        2,
        False,
        [("weights_partial:chief:3", None)],
        4,
        True,
    ),
}

TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def reference():
    return bodies.reference()


@pytest.fixture(scope="module", autouse=True)
def _timing_table():
    """Write `case | outcome | seconds` rows where KERAS_MGPU_FAULT_TABLE
    names a file (the README's table)."""
    yield
    path = os.environ.get("KERAS_MGPU_FAULT_TABLE")
    if path:
        with open(path, "w") as f:
            for case, seconds in TIMINGS.items():
                f.write(f"| {case} | exact resume | {seconds:.0f} |\n")


def _run(processes, chief, args, env=None):
    if processes == 1:
        return [
            run_in_process(
                BODY,
                timeout=150,
                args=(*args, False),
                env=env,
                may_die=env is not None or args[3] is not None,
            )
        ]
    return run_workers(
        BODY,
        processes,
        timeout=200,
        args=args,
        env=env,
        chief=chief,
        stop_all_on_kill=True,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_killed_then_restarted_ends_like_an_uninterrupted_run(
    case, reference, tmp_path
):
    processes, chief, kills, save_freq, double = CASES[case]
    backup = str(tmp_path / "backup")
    started = time.monotonic()
    for seam, stop in kills:
        results = _run(
            processes,
            chief,
            (backup, save_freq, double, stop),
            env={KILL_ENV: seam} if seam else None,
        )
        assert None in results, f"{case}: no process was killed"
    if processes == 1:
        # The restart runs here (no strategy, as the killed child).
        restarted = [bodies.train(0, backup, save_freq, double, None, False)]
    else:
        restarted = _run(processes, chief, (backup, save_freq, double, None))
    TIMINGS[case] = time.monotonic() - started
    for result in restarted:
        assert result["error"] is None, result["error"]
        assert result["updates"] == reference["updates"]
        assert max_abs_diff(result["weights"], reference["weights"]) < 1e-5
        assert result["weights"] == restarted[0]["weights"]
    if chief:
        assert [r["task_name"] for r in restarted] == ["chief:0", "worker:0"]
    assert not os.path.exists(backup)  # deleted when training ended
