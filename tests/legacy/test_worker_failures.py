"""tf_keras twin of tests/distribute/test_worker_failures.py: a worker
SIGKILLed in the middle of a 2-worker tf_keras `fit` (mid-window, during
warmup); keras_mgpu's BackupAndRestore hands over to tf_keras's own
(multi-worker safe) and the restarted job ends with the weights of an
uninterrupted run."""

from __future__ import annotations

import pytest
from _training import max_abs_diff
from distribute._backup_scenario import interrupted_then_resumed

pytestmark = pytest.mark.slow


def test_killed_worker_named_and_restart_resumes_exactly(tmp_path):
    run = interrupted_then_resumed(str(tmp_path), "kill")
    survivor = run["first"][0]
    assert run["first"][1] is None  # SIGKILLed
    assert "worker 1 (127.0.0.1:" in survivor["error"]
    assert "no heartbeat" in survivor["error"]
    reference = run["reference"]
    for result in run["restarted"]:
        assert result["error"] is None
        assert result["epochs_run"] == [1, 2, 3]
        assert result["updates"] == reference["updates"]
        assert max_abs_diff(result["weights"], reference["weights"]) < 1e-6
