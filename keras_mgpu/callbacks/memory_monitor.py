"""Per-device and host memory, per epoch, in the training logs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from keras_mgpu._flavour import callback_bases
from keras_mgpu._validation import (
    check_bool,
    check_number,
)
from keras_mgpu.backend.jax.devices import distribution_devices
from keras_mgpu.backend.jax.memory import JAXMemoryReader, preallocation_note
from keras_mgpu.callbacks._monitor_common import EpochMonitorMixin
from keras_mgpu.monitoring.log_keys import make_key
from keras_mgpu.monitoring.tf_memory import (
    TFMemoryReader,
    device_label,
    strategy_devices,
)

NAN = float("nan")
REMEDIES = (
    "To lower it: accumulate gradients over smaller micro-batches "
    "(keras_mgpu.optimizers.GradientAccumulationOptimizer), recompute "
    "activations in the backward pass (keras_mgpu.layers.apply_recompute), "
    "or use a smaller per-replica batch."
)


class MemoryMonitor(EpochMonitorMixin, *callback_bases()):
    """Logs current and peak memory of every device the strategy uses.

    At each epoch end it adds to `logs` (so the progress bar, `History`,
    `CSVLogger` and `TensorBoard` show them; list this callback *before*
    `CSVLogger` and `TensorBoard`):

    - `mem/gpu<i>_current_mb`, `mem/gpu<i>_peak_mb`: TensorFlow's allocator
      figures (`tf.config.experimental.get_memory_info`) for each logical
      accelerator device the strategy in scope computes or keeps variables
      on; the peak is the epoch's (reset with `reset_memory_stats` at each
      epoch begin). `mem/gpu<i>_peak_frac`: peak over capacity, when the
      capacity is known (a logical device's `memory_limit`, the GPU's total
      memory through NVML, or `capacity_mb`).
    - `mem/host_tf_current_mb`, `mem/host_tf_peak_mb`: TensorFlow's CPU
      allocator, once for the host. On CPU these figures are process-wide
      (every logical CPU device reports the same numbers, oneDNN on) or
      not kept at all ("Allocator stats not available", oneDNN off; the
      keys are then left out): they are never reported per CPU device. A
      `MonitorWarning` says so once per process.
    - `mem/host_rss_mb` (this process's resident memory),
      `mem/host_system_used_mb`, `mem/host_system_available_mb` (psutil).

    The keys are fixed at train begin and identical every epoch (see
    `keras_mgpu.monitoring.log_keys`). Readings are host calls made at
    epoch boundaries (or every `update_freq` batches): no tensor
    is read, no host-device synchronisation is added.

    When a device's epoch peak crosses `warn_fraction` of its capacity, a
    `MonitorWarning` names the device and the remedies (gradient
    accumulation, recompute, a smaller batch), once per device per `fit`.

    **On Keras's JAX backend** the devices are this process's devices of
    the `keras.distribution` in force (`DataParallel`, `ModelParallel`; the
    default device without one) and of the model's variables, with the same
    keys: `mem/gpu<i>_current_mb` is `Device.memory_stats()["bytes_in_use"]`
    (GPU and TPU, `<i>` the CUDA ordinal), `mem/gpu<i>_peak_mb` its
    "peak_bytes_in_use" (the process's peak so far: JAX cannot reset it per
    epoch), `mem/gpu<i>_peak_frac` the peak over "bytes_limit" (or
    `capacity_mb`). JAX keeps no statistics for CPU devices
    (`memory_stats()` is None): on CPU only the psutil host figures are
    logged (a `MonitorWarning` says so once per process; there are no
    `mem/host_tf_*` keys). Under XLA's default GPU preallocation a
    `MonitorWarning` says once per process that the memory the GPU reports
    in use is the preallocated pool, and how to turn it off
    (`XLA_PYTHON_CLIENT_PREALLOCATE=false`). Nothing imports TensorFlow.
    Across the processes of a JAX cluster
    (`keras_mgpu.distribute.start_cluster()`) keys carry the `w<rank>_`
    prefix (the process index) as on TensorFlow, and `gather_workers=True`
    gives every process every process's figures, exchanged at each epoch
    end with one small `process_allgather` (exact float64); on one JAX
    process it gathers nothing.

    **Under tf.distribute** each worker of a multi-worker cluster reports
    its own devices into its own logs; keys then carry a `w<rank>_`
    prefix (`mem/w1_gpu0_peak_mb`) so the workers' CSV files can be merged.
    With `gather_workers=True` every worker (the chief included) also logs
    the other workers' figures, exchanged at each epoch end.

    Args:
        warn_fraction: float in (0, 1] or None, the peak-over-capacity
            fraction that triggers the warning. Defaults to 0.9; None turns
            the warning off.
        capacity_mb: float, dict or None, device capacity in MB overriding
            the detected one: one number for every accelerator, or a dict
            keyed by label (`{"gpu0": 16000}`). Defaults to None.
        host: bool, whether to log the psutil host figures. Defaults to True.
        update_freq: "epoch" (default) or int >= 1: also log
            `..._current_mb` every that many batches, as Keras's
            `TensorBoard(update_freq=...)`. (`log_every_n_batches` before
            0.2; still accepted, with a `FutureWarning`, until 0.3.)
        gather_workers: bool, in a cluster of several workers (JAX:
            processes), also log every other worker's memory figures,
            exchanged at each epoch end as described above, so that the
            chief's History / CSV / TensorBoard hold the memory of the
            whole cluster. Implies the `w<rank>_` prefix. Defaults to False.
        worker_prefix: bool or None, force the `w<rank>_` prefix of the
            `mem/` keys on or off; None (default) adds it when the cluster
            has several workers (JAX: processes).

    Example:

    ```python
    model.fit(x, y, epochs=3, callbacks=[
        keras_mgpu.callbacks.MemoryMonitor(),
        keras.callbacks.CSVLogger("log.csv"),
    ])
    # history.history["mem/gpu0_peak_mb"] holds one peak per epoch
    ```
    """

    # The batch hook (only with an integer `update_freq`) reads host-side
    # figures (allocator statistics, the sampler's latest reading), never a
    # tensor: Keras's asynchronous batch dispatch stays on.
    async_safe = True

    def __init__(
        self,
        *,
        warn_fraction: float | None = 0.9,
        capacity_mb: float | Mapping[str, float] | None = None,
        host: bool = True,
        update_freq: str | int = "epoch",
        worker_prefix: bool | None = None,
        gather_workers: bool = False,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        self._init_monitor(
            "MemoryMonitor",
            update_freq,
            worker_prefix,
            gather_workers,
            deprecated,
        )
        self.warn_fraction = check_number(
            warn_fraction,
            "warn_fraction",
            minimum=0.0,
            exclusive_minimum=True,
            maximum=1.0,
            allow_none=True,
        )
        if isinstance(capacity_mb, Mapping):
            self.capacity_mb = {
                str(k): check_number(
                    v, f"capacity_mb[{k!r}]", minimum=0, exclusive_minimum=True
                )
                for k, v in capacity_mb.items()
            }
        else:
            self.capacity_mb = check_number(
                capacity_mb,
                "capacity_mb",
                minimum=0,
                exclusive_minimum=True,
                allow_none=True,
            )
        self.host = check_bool(host, "host")
        # The backend's memory figures (TensorFlow's allocator, or JAX's
        # `memory_stats()`) beside psutil's (`_host_backend`); tests replace
        # both with stand-ins before `fit`.
        self._reader = (
            JAXMemoryReader()
            if self._backend_name == "jax"
            else TFMemoryReader()
        )
        self._devices: list[str] = []  # accelerator devices, "GPU:0"
        self._capacity: dict[str, float | None] = {}
        self._host_tf = False

    def _key(self, name: str) -> str:
        return make_key("mem", name, self._prefix)

    def _local_devices(self, strategy) -> list[str]:
        variables = getattr(self.model, "variables", ())
        if self._backend_name == "jax":
            return self._reader.bind(distribution_devices(strategy, variables))
        return strategy_devices(strategy, variables)

    def on_train_begin(self, logs=None):
        strategy = self._begin_monitor()
        devices = self._local_devices(strategy)
        self._devices = []
        for device in devices:
            if device.startswith("CPU:"):
                continue
            if self._reader.read(device) is None:
                source = (
                    "JAX reports no memory statistics (memory_stats())"
                    if self._backend_name == "jax"
                    else "TensorFlow keeps no allocator statistics"
                )
                self._notices.warn(
                    f"nostats:{device}",
                    f"MemoryMonitor: {source} for {device}; it is left out "
                    "of the logs.",
                )
                continue
            self._devices.append(device)
        self._host_tf = False
        if self._backend_name == "jax":
            self._jax_notes(devices)
        elif any(d.startswith("CPU:") for d in devices):
            self._host_tf = self._reader.read("CPU:0") is not None
            if self._host_tf:
                note = (
                    "figures are process-wide (every logical CPU device "
                    "reports the same numbers), so they are logged once as "
                    "host figures (mem/host_tf_current_mb, "
                    "mem/host_tf_peak_mb), not per device"
                )
            else:
                note = (
                    "statistics are not available: TensorFlow keeps them on "
                    "CPU only with oneDNN on, which is off by default on "
                    "many CPUs (set TF_ENABLE_ONEDNN_OPTS=1 before "
                    "TensorFlow starts); only the psutil host figures are "
                    "logged"
                )
            self._notices.warn(
                f"cpu:{self._host_tf}",
                f"MemoryMonitor: TensorFlow's CPU allocator {note}.",
                per_process=True,
            )
        self._capacity = {d: self._capacity_of(d) for d in self._devices}
        self.keys = self._gathering.expand_keys(self._epoch_keys())
        self._reset_peaks()

    def _jax_notes(self, devices: list[str]) -> None:
        """Say once per process what JAX cannot report, and when XLA's GPU
        preallocation changes what the figures mean."""
        if any(d.startswith("CPU:") for d in devices):
            self._notices.warn(
                "jax-cpu",
                "MemoryMonitor: JAX keeps no memory statistics for CPU "
                "devices (Device.memory_stats() is None there), so only the "
                "psutil host figures are logged (mem/host_rss_mb, ...), "
                "not per device.",
                per_process=True,
            )
        if any(self._reader.platform(d) == "gpu" for d in self._devices):
            note = preallocation_note()
            if note:
                self._notices.warn(
                    "jax-preallocation", f"MemoryMonitor: {note}.", True
                )

    def _capacity_of(self, device: str) -> float | None:
        if isinstance(self.capacity_mb, dict):
            return self.capacity_mb.get(device_label(device))
        if self.capacity_mb is not None:
            return self.capacity_mb
        capacity = self._reader.capacity_mb(device)
        return capacity if capacity and not math.isnan(capacity) else None

    def _epoch_keys(self) -> list[str]:
        keys = []
        for device in self._devices:
            label = device_label(device)
            keys += [
                self._key(f"{label}_current_mb"),
                self._key(f"{label}_peak_mb"),
            ]
            if self._capacity[device]:
                keys.append(self._key(f"{label}_peak_frac"))
        if self._host_tf:
            keys += [
                self._key("host_tf_current_mb"),
                self._key("host_tf_peak_mb"),
            ]
        if self.host:
            keys += [
                self._key("host_rss_mb"),
                self._key("host_system_used_mb"),
                self._key("host_system_available_mb"),
            ]
        return keys

    def _reset_peaks(self) -> None:
        for device in self._devices + (["CPU:0"] if self._host_tf else []):
            self._reader.reset(device)

    def on_epoch_begin(self, epoch, logs=None):
        self._reset_peaks()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        logs.update(self._gathering.gather(self.read(epoch), self._notices))

    def read(self, epoch: int | None = None) -> dict[str, float]:
        """The figures now, keyed as in the logs; warns on memory pressure."""
        figures: dict[str, float] = {}
        for device in self._devices:
            label = device_label(device)
            info = self._reader.read(device) or {}
            peak = info.get("peak_mb", NAN)
            figures[self._key(f"{label}_current_mb")] = info.get(
                "current_mb", NAN
            )
            figures[self._key(f"{label}_peak_mb")] = peak
            capacity = self._capacity[device]
            if capacity:
                fraction = peak / capacity
                figures[self._key(f"{label}_peak_frac")] = fraction
                self._check_pressure(device, peak, capacity, epoch)
        if self._host_tf:
            info = self._reader.read("CPU:0") or {}
            figures[self._key("host_tf_current_mb")] = info.get(
                "current_mb", NAN
            )
            figures[self._key("host_tf_peak_mb")] = info.get("peak_mb", NAN)
        if self.host:
            try:
                memory = self._host_backend.memory()
            except Exception:  # a monitor never fails training
                memory = {}
            figures[self._key("host_rss_mb")] = memory.get("rss_mb", NAN)
            figures[self._key("host_system_used_mb")] = memory.get(
                "system_used_mb", NAN
            )
            figures[self._key("host_system_available_mb")] = memory.get(
                "system_available_mb", NAN
            )
        return figures

    def _check_pressure(self, device, peak, capacity, epoch) -> None:
        if self.warn_fraction is None or not peak >= (
            self.warn_fraction * capacity
        ):
            return
        when = f" in epoch {epoch}" if epoch is not None else ""
        self._notices.warn(
            f"pressure:{device}",
            f"MemoryMonitor: peak memory on {device} reached "
            f"{peak / capacity:.0%} of its {capacity:.0f} MB capacity{when} "
            f"({peak:.0f} MB; warning threshold {self.warn_fraction:.0%}). "
            + REMEDIES,
        )

    def _log_batch(self, batch, logs=None):
        if not self._batch_due(logs):
            return
        for device in self._devices:
            info = self._reader.read(device) or {}
            logs[self._key(f"{device_label(device)}_current_mb")] = info.get(
                "current_mb", NAN
            )
        if self._host_tf:
            info = self._reader.read("CPU:0") or {}
            logs[self._key("host_tf_current_mb")] = info.get("current_mb", NAN)
