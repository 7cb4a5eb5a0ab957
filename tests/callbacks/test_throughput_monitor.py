"""ThroughputMonitor, one test per behaviour, collected by both backends'
jobs (a test marked with one backend runs in that job only)."""

from __future__ import annotations

import csv
import math
import threading
import time

import keras
import numpy as np
import pytest

from keras_mgpu.callbacks import ThroughputMonitor
from keras_mgpu.monitoring import device_peaks
from keras_mgpu.optimizers import GradientAccumulationOptimizer

FEATURES, HIDDEN, CLASSES = 32, 256, 8
BATCH = 16

pytestmark = pytest.mark.backends("tensorflow", "jax")

BAD_INPUT = [
    ({"window_size": 0}, ValueError, r"`window_size`.*Received: window_size=0"),
    ({"window_size": 2.0}, TypeError, r"`window_size`.*window_size=2.0"),
    (
        {"tokens_per_sample": 0},
        ValueError,
        r"`tokens_per_sample`.*tokens_per_sample=0",
    ),
    ({"token_input": 3}, TypeError, r"`token_input`.*token_input=3"),
    (
        {"token_input": "ids", "tokens_per_sample": 4},
        ValueError,
        r"cannot both.*tokens_per_sample=4, token_input='ids'",
    ),
    (
        {"flops_per_sample": -1.0},
        ValueError,
        r"`flops_per_sample`.*flops_per_sample=-1.0",
    ),
    ({"peak_flops": 0}, ValueError, r"`peak_flops`.*peak_flops=0"),
    ({"batch_size": 0}, ValueError, r"`batch_size`.*batch_size=0"),
    ({"worker_prefix": 1}, TypeError, r"`worker_prefix`.*worker_prefix=1"),
    (
        {"interconnect_gbps": "nvlink9"},
        ValueError,
        r"`interconnect_gbps`.*nvlink4.*interconnect_gbps='nvlink9'",
    ),
    ({"network_gbps": 0}, ValueError, r"`network_gbps`.*network_gbps=0"),
    ({"predict_at": 8}, TypeError, r"`predict_at`.*predict_at=8"),
    ({"predict_at": (8, 0)}, ValueError, r"`predict_at`"),
    ({"devices_per_host": 0}, ValueError, r"`devices_per_host`"),
]


def _mlp() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


def _data(samples: int = 8 * BATCH):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(samples,))
    return x, y


def _compile(model, optimizer=None) -> None:
    model.compile(
        optimizer or keras.optimizers.SGD(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def _mlp_model_flops() -> float:
    """Analytic model FLOPs of one sample: 3 x forward; forward = 2 x
    in x out per Dense (multiply-add), + out for the bias, + out for each
    ReLU."""
    sizes = [(FEATURES, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, CLASSES)]
    forward = sum(2 * i * o + o for i, o in sizes) + 2 * HIDDEN
    return 3.0 * forward


def _fit(model, monitor, epochs=1, samples=8 * BATCH, callbacks=(), **kw):
    x, y = _data(samples)
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=[monitor, *callbacks],
        **kw,
    )


def test_bad_arguments_are_refused_at_construction():
    # One test for the table: each case is a constructor call, no fit.
    for kwargs, error, match in BAD_INPUT:
        with pytest.raises(error, match=match):
            ThroughputMonitor(**kwargs)


def test_config_round_trips_through_keras_serialization():
    monitor = ThroughputMonitor(
        window_size=7, token_input="token_ids", peak_flops=1e12, batch_size=4
    )
    config = keras.saving.serialize_keras_object(monitor)
    again = keras.saving.deserialize_keras_object(config)
    assert isinstance(again, ThroughputMonitor)
    assert again.get_config() == monitor.get_config()


def test_keys_reach_history_and_csv_with_flops_of_the_analytic_count(
    tmp_path,
):
    model = _mlp()
    _compile(model)
    path = tmp_path / "log.csv"
    monitor = ThroughputMonitor(window_size=4)
    history = _fit(
        model,
        monitor,
        epochs=2,
        callbacks=[keras.callbacks.CSVLogger(str(path))],
    )
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    for key in monitor.keys:
        assert key.startswith("perf/")
        assert len(history.history[key]) == 2
        assert key in header
    logs = {k: v[-1] for k, v in history.history.items()}
    assert logs["perf/window_steps"] == 4
    assert logs["perf/samples_per_sec"] > 0
    assert logs["perf/samples_per_sec"] == pytest.approx(
        logs["perf/batches_per_sec"] * BATCH
    )
    # Model FLOPs within 5% of the analytic count (3 x forward).
    assert logs["perf/flops_per_sample"] == pytest.approx(
        _mlp_model_flops(), rel=0.05
    )
    # The step also does the loss and the optimizer's update; the first
    # layer's input gradient is not computed: within 15%.
    assert logs["perf/hardware_flops_per_sample"] == pytest.approx(
        _mlp_model_flops(), rel=0.15
    )
    assert logs["perf/tflops_per_device"] == pytest.approx(
        logs["perf/flops_per_sample"] * logs["perf/samples_per_sec"] / 1e12
    )
    # A CPU has no peak in the table: no MFU without `peak_flops`.
    assert math.isnan(logs["perf/mfu"]) and math.isnan(logs["perf/hfu"])


def test_mfu_and_hfu_against_a_given_peak():
    model = _mlp()
    _compile(model)
    monitor = ThroughputMonitor(window_size=4, peak_flops=1e9)
    _fit(model, monitor)
    figures = {k.split("/")[-1]: v for k, v in monitor.last.items()}
    assert figures["mfu"] == pytest.approx(
        figures["tflops_per_device"] * 1e12 / 1e9
    )
    assert figures["hfu"] == pytest.approx(
        figures["hardware_flops_per_sample"] * figures["samples_per_sec"] / 1e9
    )


class _Clock(keras.callbacks.Callback):
    """The test's own clock at each batch end; sleeps, so that a step is
    long against the clock's jitter (a thread switch, ~5 ms)."""

    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.sleep = sleep
        self.ends: dict[int, float] = {}

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.sleep)
        self.ends[batch] = time.perf_counter()


def test_samples_per_sec_is_the_wall_clock_rate_of_its_window():
    model = _mlp()
    _compile(model)
    monitor = ThroughputMonitor(window_size=5)
    clock = _Clock(sleep=0.03)
    start = time.perf_counter()
    _fit(model, monitor, callbacks=[clock])
    outside = time.perf_counter() - start
    figures = {k.split("/")[-1]: v for k, v in monitor.last.items()}
    steps = sorted(clock.ends)
    last, first = steps[-1], steps[-1] - 5
    # Steps are >= 30 ms each: the same 5 steps timed by the test's clock.
    expected = 5 * BATCH / (clock.ends[last] - clock.ends[first])
    assert figures["samples_per_sec"] == pytest.approx(expected, rel=0.1)
    # And never faster than the wall clock around the whole `fit` allows
    # for the steps it covers.
    assert figures["samples_per_sec"] >= 5 * BATCH / outside


def _read_a_set_model(**arguments) -> tuple:
    """(model, monitor, figures) of a `ThroughputMonitor(**arguments)` on a
    model that is set, not fitted (an accumulating step takes ~20 s to
    compile on JAX), K = 2, its clock given 8 steps 10 ms apart."""
    model = _mlp()
    _compile(
        model,
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.01), accumulation_steps=2
        ),
    )
    monitor = ThroughputMonitor(**arguments)
    monitor.set_model(model)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    for step in range(8):
        monitor._ends[step] = 10.0 + 0.01 * step
    figures = {k.split("/")[-1]: v for k, v in monitor.read().items()}
    return model, monitor, figures


def test_an_accumulation_window_is_one_update():
    _, _, figures = _read_a_set_model(
        window_size=4, flops_per_sample=1000.0, batch_size=BATCH
    )
    assert figures["window_steps"] == 4
    assert figures["batches_per_sec"] == pytest.approx(100.0)
    assert figures["samples_per_sec"] == pytest.approx(100.0 * BATCH)
    assert figures["updates_per_sec"] == pytest.approx(50.0)
    assert figures["flops_per_update"] == pytest.approx(1000.0 * BATCH * 2)
    assert math.isnan(figures["hardware_flops_per_sample"])


def test_bytes_per_update_and_predicted_scaling_at_n_devices():
    from keras_mgpu.monitoring import (
        INTERCONNECTS,
        predict_scaling,
        update_bytes,
    )

    model, monitor, figures = _read_a_set_model(
        window_size=4,
        flops_per_sample=1000.0,
        batch_size=BATCH,
        interconnect_gbps="nvlink4",
        network_gbps="network_400gbit",
        predict_at=(1, 8, 64),
    )
    assert set(monitor.keys) >= {
        f"perf/scaling_efficiency_at_{n}" for n in (1, 8, 64)
    }
    traffic = update_bytes(model)
    # The gradients' bytes (float32), times the reductions of one update.
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    assert traffic.parameters == parameters
    assert figures["comm_bytes_per_update"] == traffic.bytes_per_update > 0
    # One device: the prediction is the measurement.
    assert figures["scaling_efficiency_at_1"] == 1.0
    for n, hosts in ((8, 1), (64, 8)):
        expected = predict_scaling(
            step_seconds=0.02,  # 2 steps of 10 ms per update
            bytes_per_update=traffic,
            devices=n,
            hosts=hosts,
            intra_host_gbps=INTERCONNECTS["nvlink4"],
            inter_host_gbps=INTERCONNECTS["network_400gbit"],
        ).efficiency
        assert figures[f"scaling_efficiency_at_{n}"] == pytest.approx(expected)
        assert 0 < expected < 1
    assert (
        figures["scaling_efficiency_at_64"] < figures["scaling_efficiency_at_8"]
    )


def test_compile_time_is_reported_once_and_a_second_fit_compiles_nothing():
    model = _mlp()
    _compile(model)
    first = ThroughputMonitor(window_size=4)
    _fit(model, first)
    assert first.last["perf/compile_count"] >= 1
    assert first.last["perf/compile_seconds"] > 0
    second = ThroughputMonitor(window_size=4)
    _fit(model, second)
    # Same model, same shapes: Keras reuses its compiled step.
    assert second.last["perf/compile_count"] == 0


def test_the_per_batch_hook_reads_no_log_value():
    class Untouchable(dict):
        def __getitem__(self, key):
            raise AssertionError("a log value was read")

        def items(self):
            raise AssertionError("log values were read")

        def values(self):
            raise AssertionError("log values were read")

        def get(self, *args):
            raise AssertionError("a log value was read")

    monitor = ThroughputMonitor()
    assert monitor.async_safe is True
    monitor.on_train_batch_end(0, Untouchable(loss=object()))


# Keras dispatches callbacks asynchronously only on JAX.
@pytest.mark.backends("jax")
def test_fit_keeps_keras_asynchronous_dispatch():

    class Thread(keras.callbacks.Callback):
        async_safe = True
        threads: set = set()

        def on_train_batch_end(self, batch, logs=None):
            self.threads.add(threading.get_ident())

    monitor = ThroughputMonitor(window_size=4)
    callbacks = keras.callbacks.CallbackList([monitor, Thread()])
    assert callbacks._async_train is True
    model = _mlp()
    _compile(model)
    probe = Thread()
    _fit(model, monitor, callbacks=[probe])
    # The batch hooks ran in Keras's dispatch threads, not the loop's.
    assert threading.get_ident() not in probe.threads


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("mirrored_2", marks=pytest.mark.backends("tensorflow")),
        pytest.param("data_parallel_2", marks=pytest.mark.backends("jax")),
        pytest.param("model_parallel_2x2", marks=pytest.mark.backends("jax")),
    ],
)
def test_figures_are_global_under_a_strategy(name):
    from conftest import make_strategy

    model = _mlp()
    _compile(model)
    alone = ThroughputMonitor(window_size=4)
    _fit(model, alone)
    strategy = make_strategy(name)
    monitor = ThroughputMonitor(window_size=4)
    with strategy.scope():
        model = _mlp()
        _compile(model)
        _fit(model, monitor)
    devices = 4 if name.endswith("2x2") else 2
    figures = {k.split("/")[-1]: v for k, v in monitor.last.items()}
    assert figures["flops_per_sample"] == pytest.approx(
        alone.last["perf/flops_per_sample"], rel=0.01
    )
    assert figures["tflops_per_device"] == pytest.approx(
        figures["flops_per_sample"]
        * figures["samples_per_sec"]
        / devices
        / 1e12
    )


def test_gpt2_backbone_flops_and_tokens_per_sec():
    keras_hub = pytest.importorskip("keras_hub")
    layers, hidden, seq, vocab = 2, 64, 32, 100
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab,
        num_layers=layers,
        num_heads=4,
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
        dropout=0.0,
        max_sequence_length=seq,
    )
    backbone.compile(keras.optimizers.SGD(0.01), "mse")
    samples = 4 * BATCH // 2
    x = {
        "token_ids": np.ones((samples, seq), "int32"),
        "padding_mask": np.ones((samples, seq), "int32"),
    }
    y = np.zeros((samples, seq, hidden), "float32")
    monitor = ThroughputMonitor(window_size=2, token_input="token_ids")
    backbone.fit(
        x, y, batch_size=BATCH // 2, epochs=1, verbose=0, callbacks=[monitor]
    )
    figures = {k.split("/")[-1]: v for k, v in monitor.last.items()}
    # N: the weights a token's matmuls use (embedding lookups excluded).
    n = sum(
        int(np.prod(w.shape))
        for w in backbone.trainable_weights
        if "embedding" not in w.path
    )
    # 6 N per token, + attention's QK^T and AV: 12 x layers x hidden x seq
    # per token (forward 4 L H S, x 3).
    analytic = seq * (6 * n + 12 * layers * hidden * seq)
    assert figures["flops_per_sample"] == pytest.approx(analytic, rel=0.05)
    assert figures["tokens_per_sec"] == pytest.approx(
        figures["samples_per_sec"] * seq
    )


# A table lookup, the same on either backend: one job checks it.
@pytest.mark.backends("tensorflow")
def test_peaks_table_by_device_kind_and_dtype():
    tera = 1e12
    assert device_peaks.peak_flops(
        "NVIDIA H100 80GB HBM3", "bfloat16"
    ) == pytest.approx(989.4 * tera)
    # float32 matmuls run as TF32 on Ampere and newer.
    assert device_peaks.peak_flops(
        "NVIDIA A100-SXM4-80GB", "float32"
    ) == pytest.approx(156 * tera)
    assert device_peaks.peak_flops(
        "NVIDIA H100 PCIe", "float16"
    ) == pytest.approx(756 * tera)
    assert device_peaks.peak_flops("NVIDIA H200", "float8") == pytest.approx(
        1978.9 * tera
    )
    assert device_peaks.peak_flops("Tesla T4", "float32") == pytest.approx(
        8.1 * tera
    )
    assert device_peaks.peak_flops("TPU v5 lite", "bfloat16") == pytest.approx(
        197 * tera
    )
    assert device_peaks.peak_flops("TPU v4", "float16") is None
    assert device_peaks.peak_flops("cpu", "float32") is None


@pytest.mark.backends("jax")
def test_only_the_part_of_a_compilation_inside_the_window_is_left_out(
    monkeypatch,
):
    """A compilation is logged at its end; one that began before the
    window's first step counts only from there (counted whole it made the
    window's seconds negative and every rate NaN, once in CI)."""
    from keras_mgpu.backend.jax import flops

    monitor = ThroughputMonitor()
    # (end, seconds, is a backend compile): 3 s ending 1 s into the window
    # [10, 12]; 0.5 s wholly inside it; a trace that is no backend compile.
    events = [(11.0, 3.0, True), (11.8, 0.5, True), (11.9, 0.2, False)]
    monkeypatch.setattr(flops.COMPILE_LOG, "events", events)
    assert monitor._compile_within(10.0, 12.0) == pytest.approx(1.5)
    # Two compilations at once (threads) count once: their union.
    events = [(11.5, 1.0, True), (11.6, 1.0, True)]
    monkeypatch.setattr(flops.COMPILE_LOG, "events", events)
    assert monitor._compile_within(10.0, 12.0) == pytest.approx(1.1)


def test_the_window_spans_its_stamps_in_any_order():
    """Keras's asynchronous dispatch runs the batch-end hooks on a thread
    pool: their clocks may come out of step order (measured: 5, 6, 7, 3, 2,
    4, 1, 0 within 0.1 ms), and the window from the first step's stamp to
    the last's went negative (every rate NaN, seen under load)."""
    monitor = ThroughputMonitor(window_size=4)
    monitor._backend_name = "tensorflow"  # no compile log to read
    monitor._adapter = None
    monitor._ends = {5: 9.0, 6: 9.5, 7: 9.6, 3: 10.0, 2: 10.1, 4: 10.2}
    steps, seconds = monitor._window()
    assert steps == 4  # steps 3..7
    assert seconds == pytest.approx(1.2)  # 9.0 .. 10.2
