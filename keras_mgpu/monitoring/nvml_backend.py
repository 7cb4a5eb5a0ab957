"""GPU load through NVML (`nvidia-ml-py`, imported as `pynvml`), lazily."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

from keras_mgpu.monitoring.backend import BackendUnavailable

MB = 1024.0 * 1024.0
NAN = float("nan")
INSTALL_HINT = 'pip install "keras-mgpu[gpu]"'

# Clock-event ("throttle") reason bits, from nvml.h; the same in every
# NVML version, so they are not read from the module.
THROTTLE_BITS = {
    "power": 0x4 | 0x80,  # SwPowerCap | HwPowerBrakeSlowdown
    "thermal": 0x20 | 0x40,  # SwThermalSlowdown | HwThermalSlowdown
    "hw": 0x8,  # HwSlowdown
}


def visible_gpu_selectors(
    environ: Mapping[str, str] | None = None,
) -> list[str] | None:
    """The entries of `CUDA_VISIBLE_DEVICES`, or None when it is unset.

    An empty value (or one starting with "-1") hides every GPU: [].
    Entries are indices ("1"), GPU UUIDs or unique UUID prefixes
    ("GPU-8f3c..."), or MIG UUIDs ("MIG-...").
    """
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = [e.strip() for e in value.split(",")]
    selectors = []
    for entry in entries:
        if not entry or entry.startswith("-"):
            break  # CUDA ignores this entry and every later one
        selectors.append(entry)
    return selectors


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """Samples the GPUs this process uses through NVML.

    The GPUs are those `CUDA_VISIBLE_DEVICES` exposes (all when unset), in
    its order, which is CUDA's and TensorFlow's order: entry `i` is
    TensorFlow's physical `GPU:i` and is named `gpu{i}` here. Indices in
    `CUDA_VISIBLE_DEVICES` are NVML indices, which follow the PCI bus
    order; they match CUDA's numbering when `CUDA_DEVICE_ORDER=PCI_BUS_ID`
    (set it on machines with mixed GPU models).

    `sample()` returns, per GPU: `util` (percent of time a kernel ran),
    `mem_used_mb`, `mem_total_mb`, `power_w`, `temp_c` and
    `throttle_power` / `throttle_thermal` / `throttle_hw` (1.0 while that
    kind of clock slowdown is active). A figure the GPU does not report is
    NaN.

    Args:
        positions: sequence of int or None, which visible GPUs (by
            position) to sample; all when None.
        nvml: the `pynvml` module or a stand-in (tests); imported at
            `open()` when None.
        environ: mapping or None, where to read `CUDA_VISIBLE_DEVICES`.
    """

    def __init__(
        self,
        positions: Sequence[int] | None = None,
        nvml=None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._positions = None if positions is None else list(positions)
        self._nvml = nvml
        self._environ = environ
        self._lock = threading.Lock()
        self._initialised = False
        self._handles: list = []
        self.devices: list[str] = []
        self.uuids: list[str] = []
        self.notes: list[str] = []

    def _module(self):
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise BackendUnavailable(
                    "nvidia-ml-py (pynvml) is not installed; install it with: "
                    + INSTALL_HINT
                ) from exc
            self._nvml = pynvml
        return self._nvml

    def open(self) -> None:
        nvml = self._module()
        with self._lock:
            if self._initialised:
                return
            try:
                nvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, ...
                # nvidia-ml-py is installed (we got this far): what is
                # missing is the driver's NVML library, or a GPU.
                raise BackendUnavailable(
                    f"NVML could not start ({type(exc).__name__}: {exc}); "
                    "no NVIDIA driver or GPU on this machine?"
                ) from exc
            self._initialised = True
        try:
            handles, uuids = self._visible_handles(nvml)
            if self._positions is not None:
                keep = [p for p in self._positions if p < len(handles)]
                handles = [handles[p] for p in keep]
                uuids = [uuids[p] for p in keep]
                names = [f"gpu{p}" for p in keep]
            else:
                names = [f"gpu{i}" for i in range(len(handles))]
            if not handles:
                raise BackendUnavailable(
                    "no GPU is visible to this process (CUDA_VISIBLE_DEVICES="
                    f"{self._env().get('CUDA_VISIBLE_DEVICES')!r})"
                )
        except BackendUnavailable:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise BackendUnavailable(
                f"NVML could not list GPUs ({type(exc).__name__}: {exc})"
            ) from exc
        self._handles = handles
        self.uuids = uuids
        self.devices = names

    def _env(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    def _visible_handles(self, nvml):
        count = int(nvml.nvmlDeviceGetCount())
        all_handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        all_uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in all_handles]
        selectors = visible_gpu_selectors(self._env())
        if selectors is None:
            return all_handles, all_uuids
        handles, uuids = [], []
        for entry in selectors:
            found = None
            if entry.isdigit():
                if int(entry) < count:
                    found = (all_handles[int(entry)], all_uuids[int(entry)])
            else:
                matches = [
                    i for i, u in enumerate(all_uuids) if u.startswith(entry)
                ]
                if len(matches) == 1:
                    found = (all_handles[matches[0]], all_uuids[matches[0]])
                elif entry.startswith("MIG-"):
                    try:
                        found = (nvml.nvmlDeviceGetHandleByUUID(entry), entry)
                    except Exception:
                        found = None
            if found is None:
                # CUDA stops at the first entry it cannot resolve.
                self.notes.append(
                    f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no GPU "
                    "(or several); it and later entries are ignored"
                )
                break
            handles.append(found[0])
            uuids.append(found[1])
        return handles, uuids

    def total_memory_mb(self) -> dict[str, float]:
        """Each sampled GPU's memory capacity in MB (after `open()`)."""
        nvml = self._module()
        totals = {}
        for name, handle in zip(self.devices, self._handles, strict=True):
            try:
                totals[name] = nvml.nvmlDeviceGetMemoryInfo(handle).total / MB
            except Exception:
                totals[name] = NAN
        return totals

    def sample(self) -> dict[str, float]:
        nvml = self._module()
        sample: dict[str, float] = {}
        for name, handle in zip(self.devices, self._handles, strict=True):
            for figure, value in self._read(nvml, handle).items():
                sample[f"{name}/{figure}"] = value
        return sample

    @staticmethod
    def _read(nvml, handle) -> dict[str, float]:
        def query(fn, *args):
            try:
                return fn(handle, *args)
            except Exception:  # NVMLError_NotSupported and friends
                return None

        util = query(nvml.nvmlDeviceGetUtilizationRates)
        memory = query(nvml.nvmlDeviceGetMemoryInfo)
        power = query(nvml.nvmlDeviceGetPowerUsage)  # milliwatts
        temp = query(nvml.nvmlDeviceGetTemperature, 0)  # NVML_TEMPERATURE_GPU
        reasons_fn = getattr(
            nvml,
            "nvmlDeviceGetCurrentClocksEventReasons",
            getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
        )
        reasons = query(reasons_fn) if reasons_fn is not None else None
        figures = {
            "util": NAN if util is None else float(util.gpu),
            "mem_used_mb": NAN if memory is None else memory.used / MB,
            "mem_total_mb": NAN if memory is None else memory.total / MB,
            "power_w": NAN if power is None else power / 1000.0,
            "temp_c": NAN if temp is None else float(temp),
        }
        for kind, bits in THROTTLE_BITS.items():
            figures[f"throttle_{kind}"] = (
                NAN if reasons is None else float(bool(int(reasons) & bits))
            )
        return figures

    def close(self) -> None:
        with self._lock:
            if not self._initialised:
                return
            self._initialised = False
            self._handles = []
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    @property
    def is_open(self) -> bool:
        return self._initialised
