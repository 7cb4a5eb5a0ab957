"""GPU load (utilization, memory, power, temperature, throttling) per epoch."""

from __future__ import annotations

from typing import Any

from keras_mgpu._flavour import callback_bases, tf
from keras_mgpu._validation import (
    check_bool,
    check_number,
)
from keras_mgpu.callbacks._monitor_common import EpochMonitorMixin
from keras_mgpu.monitoring.aggregate import NAN, Stats, spread
from keras_mgpu.monitoring.backend import BackendUnavailable
from keras_mgpu.monitoring.log_keys import make_key
from keras_mgpu.monitoring.nvml_backend import NvmlBackend
from keras_mgpu.monitoring.sampler import Sampler, training_frame
from keras_mgpu.monitoring.tf_memory import (
    logical_to_physical_gpu,
    strategy_devices,
)

_MISSING = Stats(NAN, NAN, NAN, 0)
# (figure sampled, statistics logged, unit) per GPU, in log order.
_GPU_FIGURES = (
    ("util", ("mean", "max"), "pct"),
    ("mem_used", ("mean", "max"), "mb"),
    ("mem_total", ("max",), "mb"),
    ("power", ("mean", "max"), "w"),
    ("temp", ("mean", "max"), "c"),
    ("throttle_power", ("mean",), "frac"),
    ("throttle_thermal", ("mean",), "frac"),
    ("throttle_hw", ("mean",), "frac"),
)
_SAMPLE_NAME = {
    "mem_used": "mem_used_mb",
    "mem_total": "mem_total_mb",
    "power": "power_w",
    "temp": "temp_c",
}


def _gpu_key_name(device: str, figure: str, stat: str, unit: str) -> str:
    if figure == "mem_total":
        return f"{device}_mem_total_mb"
    if unit == "frac":
        return f"{device}_{figure}_frac"
    return f"{device}_{figure}_{stat}_{unit}"


class GPULoadMonitor(EpochMonitorMixin, *callback_bases()):
    """Logs per-GPU load, sampled off the training thread, per epoch.

    A daemon thread reads NVML (`nvidia-ml-py`, `import pynvml`) every
    `interval` seconds from `on_train_begin` on; at each epoch end the
    epoch's readings are aggregated into `logs` (progress bar, `History`,
    `CSVLogger`, `TensorBoard`; list this callback *before* `CSVLogger` and
    `TensorBoard`). Keys, per GPU `i` (see
    `keras_mgpu.monitoring.log_keys`):

    - `gpu/gpu<i>_util_mean_pct`, `gpu/gpu<i>_util_max_pct`: percent of
      time a kernel ran;
    - `gpu/gpu<i>_mem_used_mean_mb`, `gpu/gpu<i>_mem_used_max_mb`,
      `gpu/gpu<i>_mem_total_mb`: device memory as NVML sees it (TensorFlow
      reserves most of it up front unless memory growth is on);
    - `gpu/gpu<i>_power_mean_w`, `..._power_max_w`, `..._temp_mean_c`,
      `..._temp_max_c`;
    - `gpu/gpu<i>_throttle_power_frac`, `..._throttle_thermal_frac`,
      `..._throttle_hw_frac`: fraction of readings with that kind of clock
      slowdown active;

    and for all GPUs: `gpu/util_spread_pct` (mean utilization of the
    busiest GPU minus the idlest: load imbalance), `gpu/stall_suspected`
    (1.0 when a GPU ran below `stall_utilization` percent with its memory
    at least `stall_memory_fraction` full: the model is resident but
    waiting, most often for the input pipeline; a `MonitorWarning` says
    so once per `fit`) and `gpu/samples` (readings in the epoch). A figure
    a GPU does not report is NaN.

    Only the GPUs this process uses are sampled: those `CUDA_VISIBLE_DEVICES`
    exposes (indices or UUIDs), restricted to the ones the strategy in scope
    runs on. Without NVML, a driver or a visible GPU, one `MonitorWarning`
    says so and the monitor logs CPU utilization from psutil instead:
    `cpu/util_mean_pct`, `cpu/util_max_pct`, `cpu/core<j>_util_mean_pct`
    (with `per_core`), `cpu/util_spread_pct` (busiest minus idlest core),
    `cpu/samples`. A monitor never makes training fail.

    The thread stops at `on_train_end`, and also when `fit` ends by an
    exception or KeyboardInterrupt (Keras skips `on_train_end` then), and
    NVML is shut down with it; a later `fit` starts afresh.

    **On Keras's JAX backend** it is the same monitor, without TensorFlow:
    the GPUs sampled are those of this process that the `keras.distribution`
    in force runs on (the default device without one), by CUDA ordinal;
    where JAX sees no GPU it behaves as on TensorFlow without GPUs (NVML's
    visible GPUs, else the psutil fallback). XLA preallocates 75% of each
    GPU's memory by default, which NVML reports as used: a
    `MonitorWarning` says so once per process (shared with
    `MemoryMonitor`), with how to turn it off
    (`XLA_PYTHON_CLIENT_PREALLOCATE=false`).

    **Under tf.distribute** every worker samples its own GPUs; in a
    multi-worker cluster its keys carry a `w<rank>_` prefix; with
    `gather_workers=True` every worker (the chief included) also logs the
    other workers' figures, exchanged at each epoch end.

    Args:
        interval: float > 0, seconds between readings. Defaults to 1.0.
        stall_utilization: float in [0, 100], utilization (percent) below
            which a GPU with full memory is flagged. Defaults to 30.
        stall_memory_fraction: float in (0, 1], memory-used fraction that
            counts as full. Defaults to 0.8.
        per_core: bool, log each CPU core in the psutil fallback. Defaults
            to True.
        update_freq: "epoch" (default) or int >= 1: also log the latest
            reading (`gpu/gpu<i>_util_pct`, `gpu/gpu<i>_mem_used_mb`,
            `cpu/util_pct`) every that many batches, as Keras's
            `TensorBoard(update_freq=...)`. (`log_every_n_batches` before
            0.2; still accepted, with a `FutureWarning`, until 0.3.)
        gather_workers: bool, in a cluster of several workers, also log every
            other worker's figures (one collective all-reduce of a small
            matrix per epoch), so the chief's History / CSV / TensorBoard
            hold the whole cluster. Implies the `w<rank>_` prefix.
            Defaults to False.
        worker_prefix: bool or None, force the `w<rank>_` prefix on or
            off; None (default) adds it when the cluster has several
            workers.

    Example:

    ```python
    model.fit(dataset, epochs=3, callbacks=[
        keras_mgpu.callbacks.GPULoadMonitor(interval=0.5),
        keras.callbacks.TensorBoard("logs"),
    ])
    ```
    """

    # The batch hook (only with an integer `update_freq`) reads host-side
    # figures (allocator statistics, the sampler's latest reading), never a
    # tensor: Keras's asynchronous batch dispatch stays on.
    async_safe = True

    def __init__(
        self,
        *,
        interval: float = 1.0,
        stall_utilization: float = 30.0,
        stall_memory_fraction: float = 0.8,
        per_core: bool = True,
        update_freq: str | int = "epoch",
        worker_prefix: bool | None = None,
        gather_workers: bool = False,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        self._init_monitor(
            "GPULoadMonitor",
            update_freq,
            worker_prefix,
            gather_workers,
            deprecated,
        )
        self.interval = check_number(
            interval, "interval", minimum=0.0, exclusive_minimum=True
        )
        self.stall_utilization = check_number(
            stall_utilization, "stall_utilization", minimum=0.0, maximum=100.0
        )
        self.stall_memory_fraction = check_number(
            stall_memory_fraction,
            "stall_memory_fraction",
            minimum=0.0,
            exclusive_minimum=True,
            maximum=1.0,
        )
        self.per_core = check_bool(per_core, "per_core")
        # NVML (None: opened at train begin) beside the psutil fallback
        # (`_host_backend`); tests replace both with stand-ins before `fit`.
        self._backend_arg: Any = None
        self._sampler: Sampler | None = None
        self._backend = None
        self.mode: str | None = None  # "gpu", "cpu" or None (nothing)
        self.devices: list[str] = []

    # -- set-up ------------------------------------------------------------

    def _gpu_positions(self, strategy) -> list[int] | None:
        """Physical GPU positions the strategy (on JAX, the distribution)
        runs on (None: the framework sees no GPU)."""
        if self._backend_name == "jax":
            from keras_mgpu.backend.jax import devices

            return devices.gpu_positions(strategy)
        if not tf.config.get_visible_devices("GPU"):
            return None
        mapping = logical_to_physical_gpu()
        positions = {
            mapping.get(int(d[4:]), int(d[4:]))
            for d in strategy_devices(strategy)
            if d.startswith("GPU:")
        }
        return sorted(positions)

    def _open_backend(self, strategy):
        if self._backend_arg is not None:
            backend = self._backend_arg
        else:
            backend = NvmlBackend(positions=self._gpu_positions(strategy))
        try:
            backend.open()
            for note in getattr(backend, "notes", ()):
                self._notices.warn(note, f"GPULoadMonitor: {note}.")
            self._preallocation_note()
            return backend, "gpu"
        except BackendUnavailable as exc:
            reason = str(exc)
        except Exception as exc:  # a monitor never fails training
            reason = f"{type(exc).__name__}: {exc}"
        # The reason names what is missing: the `gpu` extra (pynvml not
        # installed) or the NVIDIA driver (NVML could not start).
        self._notices.warn(
            "nogpu",
            f"GPULoadMonitor: no GPU figures: {reason}. Logging CPU "
            "utilization per core from psutil instead (keys cpu/...).",
        )
        try:
            self._host_backend.open()
            return self._host_backend, "cpu"
        except Exception as exc:
            self._notices.warn(
                "nohost",
                f"GPULoadMonitor: no CPU figures either ({exc}); nothing "
                "is logged.",
            )
            return None, None

    def _preallocation_note(self) -> None:
        """On JAX, say once per process (shared with MemoryMonitor) that
        NVML's used memory is XLA's preallocated pool."""
        if self._backend_name != "jax":
            return
        from keras_mgpu.backend.jax import devices, memory

        if not devices.local_gpus():
            return
        note = memory.preallocation_note()
        if note:
            self._notices.warn(
                "jax-preallocation", f"GPULoadMonitor: {note}.", True
            )

    def on_train_begin(self, logs=None):
        self.stop()  # a run that ended by an exception may have left one
        strategy = self._begin_monitor()
        self._backend, self.mode = self._open_backend(strategy)
        self.devices = list(self._backend.devices) if self._backend else []
        self.keys = self._gathering.expand_keys(self._epoch_keys())
        if self._backend is None:
            return
        self._sampler = Sampler(
            self._backend.sample,
            self.interval,
            on_stop=self._backend.close,
            name=type(self).__name__,
        )
        self._sampler.start(watch_frame=training_frame())

    def stop(self) -> None:
        """Stop sampling and release NVML (idempotent)."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._backend is not None:
            self._backend.close()

    def on_train_end(self, logs=None):
        self.stop()

    # -- keys and figures --------------------------------------------------

    def _key(self, name: str) -> str:
        return make_key(self.mode or "gpu", name, self._prefix)

    def _epoch_keys(self) -> list[str]:
        if self.mode == "gpu":
            keys = [
                self._key(_gpu_key_name(device, figure, stat, unit))
                for device in self.devices
                for figure, stats, unit in _GPU_FIGURES
                for stat in stats
            ]
            return keys + [
                self._key("util_spread_pct"),
                self._key("stall_suspected"),
                self._key("samples"),
            ]
        if self.mode == "cpu":
            keys = [self._key("util_mean_pct"), self._key("util_max_pct")]
            if self.per_core:
                keys += [self._key(f"{c}_util_mean_pct") for c in self.devices]
            return keys + [self._key("util_spread_pct"), self._key("samples")]
        return []

    def on_epoch_begin(self, epoch, logs=None):
        if self._sampler is not None:
            self._sampler.collect()  # readings from before this epoch

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or self._sampler is None:
            return
        if self._sampler.samples == 0:
            self._sampler.sample_now()  # an epoch shorter than `interval`
        samples = self._sampler.samples
        stats = self._sampler.collect()
        if self._sampler.error is not None:
            self._notices.warn(
                "error",
                "GPULoadMonitor: sampling failed "
                f"({type(self._sampler.error).__name__}: "
                f"{self._sampler.error}); figures are NaN from here on.",
            )
        figures = self.figures(stats, samples, epoch)
        logs.update(self._gathering.gather(figures, self._notices))

    def figures(
        self, stats: dict[str, Stats], samples: int, epoch: int | None = None
    ) -> dict[str, float]:
        """The logged figures from a window's statistics."""
        if self.mode == "cpu":
            return self._cpu_figures(stats, samples)
        if self.mode != "gpu":
            return {}
        figures: dict[str, float] = {}
        stalled = []
        for device in self.devices:
            for figure, stat_names, unit in _GPU_FIGURES:
                s = stats.get(f"{device}/{_SAMPLE_NAME.get(figure, figure)}")
                s = s or _MISSING
                for stat in stat_names:
                    name = _gpu_key_name(device, figure, stat, unit)
                    figures[self._key(name)] = getattr(s, stat)
            util = stats.get(f"{device}/util", _MISSING).mean
            used = stats.get(f"{device}/mem_used_mb", _MISSING).max
            total = stats.get(f"{device}/mem_total_mb", _MISSING).max
            if (
                util < self.stall_utilization
                and total > 0
                and used / total >= self.stall_memory_fraction
            ):
                stalled.append(
                    f"{device} ({util:.0f}% busy, {used / total:.0%} memory)"
                )
        figures[self._key("util_spread_pct")] = spread(
            stats.get(f"{d}/util", _MISSING).mean for d in self.devices
        )
        figures[self._key("stall_suspected")] = 1.0 if stalled else 0.0
        figures[self._key("samples")] = float(samples)
        if stalled:
            when = f" in epoch {epoch}" if epoch is not None else ""
            self._notices.warn(
                "stall",
                f"GPULoadMonitor: low utilization with full memory{when} on "
                f"{', '.join(stalled)}: the model is resident but the GPU "
                "waits, most likely for the input pipeline. Try "
                "`dataset.prefetch(tf.data.AUTOTUNE)`, "
                "`map(..., num_parallel_calls=tf.data.AUTOTUNE)`, "
                "`dataset.cache()`, or a larger batch.",
            )
        return figures

    def _cpu_figures(self, stats, samples) -> dict[str, float]:
        util = stats.get("util", _MISSING)
        figures = {
            self._key("util_mean_pct"): util.mean,
            self._key("util_max_pct"): util.max,
        }
        core_means = [
            stats.get(f"{c}_util", _MISSING).mean for c in self.devices
        ]
        if self.per_core:
            for core, mean in zip(self.devices, core_means, strict=True):
                figures[self._key(f"{core}_util_mean_pct")] = mean
        figures[self._key("util_spread_pct")] = spread(core_means)
        figures[self._key("samples")] = float(samples)
        return figures

    def _log_batch(self, batch, logs=None):
        if not self._batch_due(logs) or self._sampler is None:
            return
        latest = self._sampler.latest()
        if self.mode == "gpu":
            for device in self.devices:
                logs[self._key(f"{device}_util_pct")] = latest.get(
                    f"{device}/util", NAN
                )
                logs[self._key(f"{device}_mem_used_mb")] = latest.get(
                    f"{device}/mem_used_mb", NAN
                )
        else:
            logs[self._key("util_pct")] = latest.get("util", NAN)
