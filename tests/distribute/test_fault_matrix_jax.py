"""The fault matrix of keras_mgpu.callbacks.BackupAndRestore on a 2-process
x 2-CPU-device JAX cluster (`jax.distributed`, gloo): process 0 (which
writes the backup) and process 1 SIGKILLed mid-epoch, during the backup
write and during validation; then the whole job restarted from the backup.

Each killed run must end by itself: the killed process dies, and the
survivor, blocked in the step's collective or told by JAX's coordination
service (heartbeat_timeout), exits within a bound, leaving no process (the
test kills and reaps every process group whatever happens). The restart
must end at the weights and update count of an uninterrupted run (the same
job in this process, on its 4 CPU devices, to float rounding) and delete
its backup. To keep cluster launches few, one cluster restarts every case
in turn (`fault_matrix_jax_bodies.restart`), after one killed cluster per
case; the killed runs and the kill points are those of the TensorFlow
matrix (tests/distribute/test_fault_matrix.py, shared bodies).
"""

from __future__ import annotations

import json
import os
import re
import time
from unittest import mock

import pytest
from _training import max_abs_diff
from distribute import fault_matrix_bodies as shared

from keras_mgpu.testing import run_workers
from keras_mgpu.testing import workers as launcher

pytestmark = pytest.mark.slow

BODY = "distribute.fault_matrix_jax_bodies:train"
KILL_ENV = "KERAS_MGPU_TEST_KILL_AT"
# JAX's wait for the processes to meet and its heartbeat time-out
# (start_cluster's, through run_workers's child): a dead peer is declared
# after this many seconds at most.
HEARTBEAT = 10
SURVIVOR_BOUND = 2 * HEARTBEAT + 10  # seconds from the kill to its exit
RUN_LIMIT = 150  # seconds for a killed run to reach its kill

# case id: (seam spec or None, killer spec or None, save_freq, double).
# "chief" is process 0 (the writer), "worker" process 1. 6 steps an epoch,
# accumulation windows of 4: every int case restores a mid-epoch,
# mid-window backup (the damaged case falls back to one).
CASES = {
    "p0-mid-epoch-int-dc": (None, ["step", 1, 3, "chief"], 4, True),
    "p1-mid-epoch-epoch": (None, ["step", 2, 2, "worker"], "epoch", False),
    "p0-torn-weights-int-dc": ("weights_partial:chief:3", None, 2, True),
    "p1-during-backup-write-int": ("weights_written:worker:4", None, 2, False),
    "p0-validation-epoch-dc": (None, ["validation", 1, "chief"], "epoch", True),
    "p1-validation-int": (None, ["validation", 0, "worker"], 4, False),
}

# Its latest backup is damaged before the restart (double_checkpoint).
DAMAGED = "p0-mid-epoch-int-dc"


class _Ended(Exception):
    """Raised by `_await_the_kill` to end `run_workers` (which then kills
    and reaps every process group, and deletes its folder)."""


def _killed_run(args: tuple, env: dict | None) -> dict:
    """`run_workers` with its wait replaced: wait for the kill, then for
    the survivor to exit by itself; everything else (process groups,
    reaper, child entry, start_cluster with waits of `HEARTBEAT` seconds)
    is run_workers's own."""
    seen: dict = {}

    def await_the_kill(procs, logs, timeout, target):
        deadline = time.monotonic() + RUN_LIMIT
        while all(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                pytest.fail("no process died" + launcher._tails(logs))
            time.sleep(0.05)
        died = time.monotonic()
        while any(p.poll() is None for p in procs):
            if time.monotonic() - died > SURVIVOR_BOUND:
                pytest.fail(
                    f"the survivor ran {SURVIVOR_BOUND} s after its peer "
                    "died (a hang)" + launcher._tails(logs)
                )
            time.sleep(0.05)
        seen["survivor_s"] = time.monotonic() - died
        seen["codes"] = [p.returncode for p in procs]
        seen["outputs"] = launcher._outputs(logs)
        raise _Ended

    with mock.patch.object(launcher, "_wait", await_the_kill):
        with pytest.raises(_Ended):
            run_workers(
                BODY,
                2,
                *args,
                timeout=HEARTBEAT,
                # A killed non-writer leaves its private save folder.
                env=dict(env or {}, TMPDIR=str(os.path.dirname(args[0]))),
                cpu_devices=2,
            )
    return seen


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every case's killed run, then one restart cluster for all."""
    root = tmp_path_factory.mktemp("fault_matrix_jax")
    killed, restarts = {}, []
    for case, (seam, stop, save_freq, double) in CASES.items():
        backup = str(root / case)
        killed[case] = _killed_run(
            (backup, save_freq, double, stop),
            {KILL_ENV: seam} if seam else None,
        )
        killed[case]["files"] = sorted(os.listdir(backup))
        restarts.append((backup, save_freq, double))
    # double_checkpoint: damage the latest backup of one case; every
    # process must fall back to the previous one, and still end exact.
    damaged = os.path.join(root, DAMAGED)
    with open(os.path.join(damaged, "training_metadata.json")) as f:
        latest = json.load(f)
    assert latest["previous"] is not None
    with open(os.path.join(damaged, latest["weights"]), "r+b") as f:
        f.truncate(100)
    # A backup_dir that is not shared (a local path on each host), with no
    # backup yet: refused at the start, not at the restart.
    unshared = [str(root / "unshared-0"), str(root / "unshared-1")]
    restarted = run_workers(
        "distribute.fault_matrix_jax_bodies:restart",
        2,
        restarts,
        unshared,
        timeout=300,
        cpu_devices=2,
    )
    return {
        "killed": killed,
        "restarted": dict(
            zip(CASES, zip(*(r["cases"] for r in restarted), strict=True))
        ),
        "backups": {
            case: backup for case, (backup, *_) in zip(CASES, restarts)
        },
        "refusals": restarted,
    }


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted job in this process, on its 4 CPU devices."""
    import jax
    import keras

    distribution = keras.distribution.DataParallel(devices=jax.devices())
    with distribution.scope():
        return shared.reference()


@pytest.mark.parametrize("case", list(CASES))
def test_the_killed_process_dies_and_the_survivor_exits_by_itself(case, matrix):
    run = matrix["killed"][case]
    victim = 0 if "chief" in str(CASES[case][:2]) else 1
    assert run["codes"][victim] == -9, run["codes"]
    assert run["codes"][1 - victim] != 0, run["outputs"][1 - victim][-3000:]
    assert run["survivor_s"] < SURVIVOR_BOUND


@pytest.mark.parametrize("case", list(CASES))
def test_the_restarted_job_ends_like_an_uninterrupted_run(
    case, matrix, reference
):
    results = matrix["restarted"][case]
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["updates"] == reference["updates"]
        assert max_abs_diff(result["weights"], reference["weights"]) < 1e-5
        assert result["weights"] == results[0]["weights"]
        assert not result["tensorflow_imported"]
    # It resumed from a backup the killed job committed.
    assert "training_metadata.json" in matrix["killed"][case]["files"]
    assert not os.path.exists(matrix["backups"][case])


def test_a_damaged_latest_backup_falls_back_on_every_process(matrix):
    """The case whose latest backup was truncated restarted exactly
    (above): both processes loaded the previous one."""
    results = matrix["restarted"][DAMAGED]
    assert [r["error"] for r in results] == [None, None]


def test_a_backup_dir_that_is_not_shared_is_refused_by_every_process(
    matrix,
):
    for result in matrix["refusals"]:
        assert re.search(
            r"ValueError: backup_dir='.*unshared-[01]' is not one folder for "
            r"every process: process 1 cannot see the file process 0 wrote "
            r"into it \(waited 5 s\)\. On several JAX processes process 0 "
            r"writes the backup .* No process starts training",
            result["unshared"],
        ), result["unshared"]


@pytest.mark.parametrize("layout", ["split", "local"])
def test_sharded_state_is_refused_by_every_process(matrix, layout):
    for result in matrix["refusals"]:
        assert re.search(
            r"ValueError: BackupAndRestore on several JAX processes needs "
            r"every variable replicated on every device .* 1 variable\(s\) "
            r"are sharded by the distribution's layout \(.*wide/kernel\)",
            str(result[f"{layout}_error"]),
        ), result[f"{layout}_error"]
