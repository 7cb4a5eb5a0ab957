"""Gradient compression between 2 worker processes on 127.0.0.1
(MultiWorkerMirroredStrategy, Keras 3 `fit` with enable_multi_worker_fit):
bytes per update measured by CrossDeviceByteCounter on the demo CNN, and
every worker ends with the same weights."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _processes import REPO_ROOT, TESTS_DIR, run_workers
from _training import max_abs_diff
from compression_mw_bodies import UPDATES

DEMO_PARAMETERS = 47530
DEMO_POWER_SGD_ELEMENTS = 2496


@pytest.fixture(scope="module")
def cluster():
    # Imported as a top-level module: from Python 3.14 the standard library
    # has a `compression` package, which would shadow `tests/compression`.
    path = [os.path.dirname(__file__), TESTS_DIR, REPO_ROOT]
    path += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return run_workers(
        "compression_mw_bodies:compression_scenarios",
        2,
        timeout=400,
        env={"PYTHONPATH": os.pathsep.join(path)},
    )


def _payload(records: list, dtype: str) -> int:
    return sum(
        r["bytes"] for r in records if r["dtype"] == dtype and r["shape"]
    )


def _scalars(records: list) -> int:
    return sum(r["calls"] for r in records if not r["shape"])


@pytest.mark.slow
def test_bytes_per_update_between_workers(cluster):
    for result in cluster:
        assert result["replicas"] == 2
        plain = result["float32"]["records"]
        # Every gradient once per update. Scalars: Keras's own reduction of
        # the step's logs, and (float32 only) our "finite?" flag.
        assert _payload(plain, "float32") == UPDATES * 4 * DEMO_PARAMETERS
        assert _scalars(plain) == _scalars(result["power_sgd"]["records"]) + (
            UPDATES
        )
        # The distributed dataset's own "has data?" flags are int64.
        gradients = [r for r in plain if r["dtype"] == "float32" and r["shape"]]
        shapes = {tuple(r["shape"]) for r in gradients}
        for dtype in ("float16", "bfloat16"):
            records = result[dtype]["records"]
            assert _payload(records, dtype) * 2 == _payload(plain, "float32")
            half = {
                tuple(r["shape"]): r["bytes"]
                for r in records
                if r["dtype"] == dtype
            }
            for r in gradients:
                assert half[tuple(r["shape"])] * 2 == r["bytes"]
            assert set(half) == shapes
        power = result["power_sgd"]["records"]
        assert {r["dtype"] for r in power} == {"float32", "int64"}
        assert _payload(power, "float32") == UPDATES * (
            4 * DEMO_POWER_SGD_ELEMENTS
        )


@pytest.mark.slow
def test_workers_end_with_the_same_weights(cluster):
    for name in ("float32", "float16", "bfloat16", "power_sgd"):
        assert cluster[0][name]["weights"] == cluster[1][name]["weights"]
    # 16-bit floats stay close to float32 over 3 updates.
    for name in ("float16", "bfloat16"):
        difference = max_abs_diff(
            cluster[0][name]["weights"], cluster[0]["float32"]["weights"]
        )
        assert 0 < difference < 1e-3, name
    assert np.isfinite(
        max_abs_diff(
            cluster[0]["power_sgd"]["weights"], cluster[0]["float32"]["weights"]
        )
    )
