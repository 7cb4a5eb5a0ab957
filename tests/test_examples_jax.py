"""The examples that run on both backends run on JAX too (with --quick), in a
process of their own, as a user runs them (`KERAS_BACKEND=jax`)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO_ROOT, "examples")


@pytest.mark.slow
def test_fine_tune_keras_hub_on_jax(tmp_path):
    if importlib.util.find_spec("keras_hub") is None:
        pytest.skip('keras-hub is not installed ("keras-mgpu[hub]")')
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(EXAMPLES, "fine_tune_keras_hub.py"),
            "--quick",
        ],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": REPO_ROOT, "KERAS_BACKEND": "jax"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "backend: jax" in out
    assert "2 replicas" in out
    assert "recomputed layers: 2 " in out and "BertBackbone" in out
    assert "global batch 64 = 8 per replica x 2 replicas x 4 steps" in out
    # 256 samples / 16 per step = 16 micro-steps an epoch, 2 epochs, K=4.
    assert "updates: 8" in out
    assert re.search(r"memory keys: mem/host_rss_mb", out)
    assert re.search(r"last epoch: \d+\.\d samples/s, \d+ tokens/s", out)
