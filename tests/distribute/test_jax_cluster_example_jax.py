"""examples/jax_multi_process.py --quick: 2 local processes x 2 devices,
started with the variables `srun` sets, both ending at the same weights
(Keras's own variables are what `run_workers` clusters use)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


@pytest.mark.slow
def test_jax_multi_process_example(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "TF_CONFIG")
        and not k.startswith(("KERAS_DISTRIBUTION_", "SLURM_"))
    }
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "examples", "jax_multi_process.py"),
            "--quick",
            "--local-launcher",
            "slurm",
        ],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": REPO_ROOT, "KERAS_BACKEND": "jax"},
        capture_output=True,
        text=True,
        timeout=400,
        start_new_session=True,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    lines = re.findall(
        r"process:(\d) \(through slurm's variables\): 2 processes, "
        r"4 devices, loss \S+, weights checksum (\d+\.\d{6})",
        out,
    )
    assert sorted(rank for rank, _ in lines) == ["0", "1"], out
    assert lines[0][1] == lines[1][1]
