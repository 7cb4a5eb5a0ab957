"""The fault matrix of keras_mgpu.callbacks.BackupAndRestore: a process
SIGKILLed at a training step, during the weights write (a torn file),
between the weights and the metadata, between the metadata and its rename,
after the commit, during `delete_checkpoint`, during validation; with
`save_freq="epoch"` and an int, `double_checkpoint` on and off.

Each case: the killed run, then a restart of the same job, which must end
with the weights of an uninterrupted run (to float rounding) and the same
update count on every process, and delete its backup; never a torn, mixed
or older state, never a hang (every process is time-bounded). The
file-level kill points are the callback's test-only seam
(KERAS_MGPU_TEST_KILL_AT); the step and validation kills a callback's
(`fault_matrix_bodies`).

TensorFlow: in one process and in 2-process MultiWorkerMirrored clusters
(workers only, and chief + worker). Single-process cases check the commit
protocol: the killed run is a child process, the restart runs here. The
cluster cases add what needs several processes: the chief's commit while a
worker saves privately, and a restart of every worker from the shared
backup.

JAX: a 2-process x 2-CPU-device `jax.distributed` cluster (gloo), process 0
(which writes the backup) and process 1 killed. Each killed run must end by
itself: the killed process dies, and the survivor, blocked in the step's
collective or told by JAX's coordination service (heartbeat_timeout), exits
within a bound, leaving no process (the test kills and reaps every process
group whatever happens). The uninterrupted run is the same job in this
process, on its 4 CPU devices. To keep cluster launches few, one cluster
restarts every case in turn (`fault_matrix_bodies.restart_jax`), after one
killed cluster per case; it also checks the refusals (a backup_dir that is
not shared, sharded state).
"""

from __future__ import annotations

import json
import os
import re
import time
from unittest import mock

import pytest
from _training import max_abs_diff
from conftest import BACKEND
from distribute import fault_matrix_bodies as bodies

# The JAX module fixture runs 7 clusters (~95 s on idle CI) inside the
# first test's time-out; every wait inside it has its own bound.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.backends("tensorflow", "jax"),
    pytest.mark.timeout(900),
]

KILL_ENV = "KERAS_MGPU_TEST_KILL_AT"

# ----------------------------------------------------------------------
# TensorFlow: one process, and MultiWorkerMirrored clusters
# ----------------------------------------------------------------------
BODY = "distribute.fault_matrix_bodies:train"

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


@pytest.fixture(scope="module", autouse=True)
def _timing_table():
    """Write `case | outcome | seconds` rows where KERAS_MGPU_FAULT_TABLE
    names a file (the README's table; the TensorFlow cases')."""
    yield
    path = os.environ.get("KERAS_MGPU_FAULT_TABLE")
    if path and TIMINGS:
        with open(path, "w") as f:
            for case, seconds in TIMINGS.items():
                f.write(f"| {case} | exact resume | {seconds:.0f} |\n")


def _run(processes, chief, args, env=None):
    from _processes import run_in_process, run_workers

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


def _tensorflow_case(case, backup):
    """Kill the case's job where it says, then restart it: the restarted
    processes' results."""
    processes, chief, kills, save_freq, double = CASES[case]
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
    if chief:
        assert [r["task_name"] for r in restarted] == ["chief:0", "worker:0"]
    return restarted


# ----------------------------------------------------------------------
# JAX: a 2-process jax.distributed cluster, one restart for every case
# ----------------------------------------------------------------------
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
JAX_CASES = {
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
    from keras_mgpu.testing import run_workers
    from keras_mgpu.testing import workers as launcher

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
                "distribute.fault_matrix_bodies:train_jax",
                2,
                *args,
                timeout=HEARTBEAT,
                # A killed non-writer leaves its private save folder.
                env=dict(env or {}, TMPDIR=str(os.path.dirname(args[0]))),
                cpu_devices=2,
            )
    return seen


@pytest.fixture(scope="module")
def jax_matrix(tmp_path_factory):
    """Every case's killed run, then one restart cluster for all."""
    root = tmp_path_factory.mktemp("fault_matrix_jax")
    killed, restarts = {}, []
    for case, (seam, stop, save_freq, double) in JAX_CASES.items():
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
    from keras_mgpu.testing import run_workers

    restarted = run_workers(
        "distribute.fault_matrix_bodies:restart_jax",
        2,
        restarts,
        unshared,
        timeout=300,
        cpu_devices=2,
    )
    return {
        "killed": killed,
        "restarted": dict(
            zip(JAX_CASES, zip(*(r["cases"] for r in restarted), strict=True))
        ),
        "backups": {
            case: backup for case, (backup, *_) in zip(JAX_CASES, restarts)
        },
        "refusals": restarted,
    }


# ----------------------------------------------------------------------
# Every backend
# ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run in this process: TensorFlow without a
    strategy; JAX under DataParallel over its 4 CPU devices."""
    if BACKEND == "tensorflow":
        return bodies.reference()
    import jax
    import keras

    distribution = keras.distribution.DataParallel(devices=jax.devices())
    with distribution.scope():
        return bodies.reference()


def _cases():
    return [
        pytest.param(case, marks=pytest.mark.backends("tensorflow"))
        for case in CASES
    ] + [
        pytest.param(case, marks=pytest.mark.backends("jax"))
        for case in JAX_CASES
    ]


@pytest.mark.parametrize("case", _cases())
def test_killed_then_restarted_ends_like_an_uninterrupted_run(
    case, reference, tmp_path, request
):
    if BACKEND == "tensorflow":
        backup = str(tmp_path / "backup")
        restarted = _tensorflow_case(case, backup)
    else:
        matrix = request.getfixturevalue("jax_matrix")
        restarted, backup = matrix["restarted"][case], matrix["backups"][case]
        # It resumed from a backup the killed job committed.
        assert "training_metadata.json" in matrix["killed"][case]["files"]
    for result in restarted:
        assert result["error"] is None, result["error"]
        assert result["updates"] == reference["updates"]
        assert max_abs_diff(result["weights"], reference["weights"]) < 1e-5
        assert result["weights"] == restarted[0]["weights"]
        # JAX: a process of the job never imports TensorFlow.
        assert not result.get("tensorflow_imported")
    assert not os.path.exists(backup)  # deleted when training ended


@pytest.mark.backends("jax")
@pytest.mark.parametrize("case", list(JAX_CASES))
def test_the_killed_process_dies_and_the_survivor_exits_by_itself(
    case, jax_matrix
):
    run = jax_matrix["killed"][case]
    victim = 0 if "chief" in str(JAX_CASES[case][:2]) else 1
    assert run["codes"][victim] == -9, run["codes"]
    assert run["codes"][1 - victim] != 0, run["outputs"][1 - victim][-3000:]
    assert run["survivor_s"] < SURVIVOR_BOUND


@pytest.mark.backends("jax")
def test_a_damaged_latest_backup_falls_back_on_every_process(jax_matrix):
    """The case whose latest backup was truncated restarted exactly
    (above): both processes loaded the previous one."""
    results = jax_matrix["restarted"][DAMAGED]
    assert [r["error"] for r in results] == [None, None]


@pytest.mark.backends("jax")
def test_a_backup_dir_that_is_not_shared_is_refused_by_every_process(
    jax_matrix,
):
    for result in jax_matrix["refusals"]:
        assert re.search(
            r"ValueError: backup_dir='.*unshared-[01]' is not one folder for "
            r"every process: process 1 cannot see the file process 0 wrote "
            r"into it \(waited 5 s\)\. On several JAX processes process 0 "
            r"writes the backup .* No process starts training",
            result["unshared"],
        ), result["unshared"]


@pytest.mark.backends("jax")
@pytest.mark.parametrize("layout", ["split", "local"])
def test_sharded_state_is_refused_by_every_process(jax_matrix, layout):
    for result in jax_matrix["refusals"]:
        assert re.search(
            r"ValueError: BackupAndRestore on several JAX processes needs "
            r"every variable replicated on every device .* 1 variable\(s\) "
            r"are sharded by the distribution's layout \(.*wide/kernel\)",
            str(result[f"{layout}_error"]),
        ), result[f"{layout}_error"]
