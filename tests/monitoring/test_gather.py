"""gather_worker_figures / WorkerGathering against a stand-in 2-worker
strategy (the real 2-process run is in tests/callbacks)."""

from __future__ import annotations

import types
import warnings
import zlib

import numpy as np
import pytest

from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor
from keras_mgpu.monitoring import MonitorWarning
from keras_mgpu.monitoring.gather import (
    KeysDiffer,
    WorkerGathering,
    gather_worker_figures,
)
from keras_mgpu.monitoring.notices import Notices


class TwoWorkerStandIn:
    """Worker 0 of a 2-worker cluster whose other worker sent `other`."""

    def __init__(self, other_figures: dict):
        self.extended = types.SimpleNamespace(worker_devices=["/cpu:0"])
        names = sorted(other_figures)
        row = [other_figures[k] for k in names]
        parsed = [
            (k.split("/")[0], k.split("/", 1)[1].split("_", 1)[1])
            for k in names
        ]
        checksum = float(zlib.crc32(repr(parsed).encode()))
        # What the other worker contributes: its header, then its row.
        self.contributions = [
            np.array([[0.0, 0.0], [len(names), checksum]]),
            np.array([[0.0] * len(names), row]),
        ]

    def experimental_distribute_values_from_function(self, fn):
        return fn(types.SimpleNamespace(replica_id_in_sync_group=0))

    def reduce(self, op, value, axis):
        return np.asarray(value) + self.contributions.pop(0)


def test_every_workers_figures_on_each():
    mine = {"mem/w0_host_rss_mb": 100.0, "cpu/w0_util_mean_pct": 50.0}
    theirs = {"mem/w1_host_rss_mb": 200.0, "cpu/w1_util_mean_pct": np.nan}
    gathered = gather_worker_figures(mine, TwoWorkerStandIn(theirs), 0, 2)
    assert gathered["mem/w0_host_rss_mb"] == 100.0
    assert gathered["mem/w1_host_rss_mb"] == 200.0
    assert gathered["cpu/w0_util_mean_pct"] == 50.0
    # A NaN stays in its own cell.
    assert np.isnan(gathered["cpu/w1_util_mean_pct"])
    assert len(gathered) == 4


def test_different_key_sets_are_detected_and_warned_once():
    mine = {"mem/w0_gpu0_peak_mb": 1.0}
    theirs = {"mem/w1_gpu0_peak_mb": 1.0, "mem/w1_gpu1_peak_mb": 2.0}
    with pytest.raises(KeysDiffer, match="different figures"):
        gather_worker_figures(mine, TwoWorkerStandIn(theirs), 0, 2)
    gathering = WorkerGathering(True, "MemoryMonitor")
    gathering._strategy = TwoWorkerStandIn({**theirs, **theirs})
    gathering.num_workers = 2
    notices = Notices()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gathering.gather(mine, notices) == mine
        assert gathering.gather(mine, notices) == mine
    messages = [str(w.message) for w in caught if w.category is MonitorWarning]
    assert len(messages) == 1
    assert "MemoryMonitor: not gathering" in messages[0]


def test_keys_of_every_worker():
    gathering = WorkerGathering(True, "GPULoadMonitor")
    gathering._strategy, gathering.task_id, gathering.num_workers = (
        object(),
        1,
        3,
    )
    assert gathering.expand_keys(["gpu/w1_gpu0_util_mean_pct"]) == [
        "gpu/w0_gpu0_util_mean_pct",
        "gpu/w1_gpu0_util_mean_pct",
        "gpu/w2_gpu0_util_mean_pct",
    ]


def test_one_worker_gathers_nothing():
    import numpy as np

    from keras_mgpu._flavour import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    monitor = MemoryMonitor(gather_workers=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(
            np.ones((4, 2)), np.ones((4, 1)), verbose=0, callbacks=[monitor]
        )
    assert "mem/host_rss_mb" in history.history  # no w0_ prefix


@pytest.mark.parametrize("monitor", [MemoryMonitor, GPULoadMonitor])
def test_bad_gather_workers(monitor):
    with pytest.raises(
        TypeError, match=r"`gather_workers` must be a bool.*gather_workers=1"
    ):
        monitor(gather_workers=1)
