"""Training speed per epoch in the logs: samples/s, tokens/s, TFLOP/s per
device, MFU and HFU, compile time left out."""

from __future__ import annotations

import math
import sys
import time
import types
from typing import Any

from keras_mgpu._flavour import callback_bases, register_serializable
from keras_mgpu._validation import check_bool, check_int, check_number
from keras_mgpu.backend import require_backend
from keras_mgpu.distribute import accumulation_steps_of
from keras_mgpu.distribute.strategy import current_strategy
from keras_mgpu.monitoring.device_peaks import peak_flops as table_peak
from keras_mgpu.monitoring.log_keys import make_key, worker_prefix
from keras_mgpu.monitoring.notices import Notices

NAN = float("nan")

# Keys, in log order (`perf/<name>`); `tokens_per_sec` only when tokens are
# counted (`tokens_per_sample` or `token_input`).
_RATE_KEYS = ("samples_per_sec", "batches_per_sec", "updates_per_sec")
_FLOP_KEYS = (
    "flops_per_sample",
    "hardware_flops_per_sample",
    "flops_per_update",
    "tflops_per_device",
    "mfu",
    "hfu",
)
_COMPILE_KEYS = ("compile_seconds", "compile_count", "window_steps")
_COMM_KEY = "comm_bytes_per_update"


def _fit_local(name: str, attribute: str) -> Any:
    """The local `name` of the `fit` call in progress, found on the stack
    (within 40 frames), when it has `attribute`; else None."""
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return None
        if frame.f_code.co_name == "fit":
            value = frame.f_locals.get(name)
            if value is not None and hasattr(value, attribute):
                return value
        frame = frame.f_back
    return None


def _fit_epoch_iterator() -> Any:
    """Keras's `EpochIterator` of the `fit` call in progress (Keras 3.15:
    `fit` keeps it in its local `epoch_iterator`; its `data_adapter` knows
    the batch size and the partial last batch). None when not called from
    inside a Keras 3 `fit`."""
    return _fit_local("epoch_iterator", "data_adapter")


class _TFKerasData:
    """tf_keras's `DataHandler` (its `fit` keeps it in `data_handler`:
    tf_keras 2.x) seen as Keras 3's epoch iterator: `data_adapter` with
    `batch_size`, `has_partial_batch`, `num_batches` as attributes, and the
    distributed dataset's `element_spec`."""

    def __init__(self, handler: Any) -> None:
        adapter = handler._adapter
        self._distributed_dataset = handler._dataset
        self.data_adapter = types.SimpleNamespace(
            batch_size=adapter.batch_size(),
            has_partial_batch=bool(adapter.has_partial_batch()),
            num_batches=handler._inferred_steps,
        )


def _tf_keras_data() -> Any:
    handler = _fit_local("data_handler", "_adapter")
    if handler is None:
        return None
    try:
        return _TFKerasData(handler)
    except Exception:  # noqa: BLE001 - another tf_keras layout
        return None


class _PeekIterator:
    """Hands on an iterator's batches; keeps the first batch's structure
    (shapes, dtypes, shardings: metadata, no device read)."""

    def __init__(self, iterator: Any, monitor: ThroughputMonitor) -> None:
        self._iterator = iterator
        self._monitor = monitor

    def __iter__(self) -> _PeekIterator:
        return self

    def __next__(self) -> Any:
        data = next(self._iterator)
        if self._monitor._batch is None:
            from keras_mgpu.backend.jax.flops import abstract_batch

            self._monitor._batch = abstract_batch(data)
        return data


@register_serializable
class ThroughputMonitor(*callback_bases()):
    """Logs how fast training runs: samples/s, batches/s, tokens/s, model
    FLOPs per sample and per update, achieved TFLOP/s per device, MFU and
    HFU, and the compile time left out of them.

    At each epoch end it adds to `logs` (so the progress bar, `History`,
    `CSVLogger` and `TensorBoard` show them; list it *before* `CSVLogger`
    and `TensorBoard`), averaged over the last `window_size` steps of the
    epoch:

    - `perf/samples_per_sec`, `perf/batches_per_sec` (steps of `fit`),
      `perf/updates_per_sec` (optimizer updates: a window of
      `GradientAccumulationOptimizer` or Keras's
      `gradient_accumulation_steps` counts as one), and
      `perf/tokens_per_sec` when `tokens_per_sample` or `token_input` is
      given.
    - `perf/flops_per_sample`: model FLOPs, forward + backward (3 x the
      forward pass, the MFU convention) of one sample;
      `perf/hardware_flops_per_sample`: what the compiled step executes
      (recompute, loss and optimizer update included);
      `perf/flops_per_update`: model FLOPs of one update (the accumulation
      window's samples).
    - `perf/tflops_per_device`: achieved model TFLOP/s per device (all
      devices of every process or worker), `perf/mfu` its fraction of the
      device's dense peak (`keras_mgpu.monitoring.device_peaks`, or
      `peak_flops`), `perf/hfu` the same for hardware FLOPs. NaN where the
      peak is unknown (a CPU: give `peak_flops`).
    - `perf/compile_seconds`, `perf/compile_count`: compilation during this
      `fit` so far, left out of the rates; `perf/window_steps`: the steps
      the rates cover.

    **No per-step device sync.** The per-batch hook reads only the host
    clock, never `logs` (`async_safe = True`: Keras's asynchronous callback
    dispatch stays on). Keras calls the batch hooks after it has converted
    the step's logs to Python numbers (in its dispatch thread when
    asynchronous), so the clock is read when a step's results exist; the
    window runs from the end of one step (never the first of an epoch,
    which holds the compile and the pipeline's fill) to the end of the last
    full batch.

    **FLOPs** come from the compiled step, measured once per `fit` at the
    first epoch end (never in the training loop). On JAX: XLA's HLO cost
    analysis of Keras's `train_step` and of the forward pass, lowered for
    the global batch `fit` feeds (`keras_mgpu.backend.jax.flops`); the
    batch's shapes are read from the first batch through a wrapper of
    `model.train_function` that removes itself after the first step.
    Compilations are counted by JAX's monitoring events (exact count and
    seconds; a recompile inside the window, as for a partial last batch,
    is subtracted). On TensorFlow: TensorFlow's graph profiler on the traced
    forward pass and train step (`keras_mgpu.backend.tensorflow.flops`); the
    batch size from the `fit` data (or `batch_size`); compile count is the
    train function's traces in this `fit`, compile seconds the first step's
    time beyond a steady step. `flops_per_sample` overrides the measurement
    (model FLOPs) and skips it: hardware FLOPs and HFU are then NaN.

    Under `tf.distribute` (Mirrored, MultiWorkerMirrored) and
    `keras.distribution` (DataParallel, ModelParallel, several JAX
    processes) the rates are global (the global batch per step) and
    per-device figures divide by every device of the strategy or mesh.
    In a cluster of several workers keys carry the `w<rank>_` prefix as the
    other monitors' do.

    Args:
        window_size: int >= 1, steps the rates average over (the last ones
            of each epoch). Defaults to 100.
        tokens_per_sample: int >= 1 or None, tokens in one sample, for
            `perf/tokens_per_sec`. Defaults to None.
        token_input: str or None, the name of the input (a key of the
            model's input dict) that holds token ids: its sequence length
            (dimension 1) is the tokens per sample. Defaults to None.
        flops_per_sample: float > 0 or None, model FLOPs (forward +
            backward) of one sample, instead of the measurement.
        peak_flops: float > 0 or None, dense peak FLOP/s of one device,
            instead of the table (needed for MFU on a CPU or a device the
            table lacks).
        batch_size: int >= 1 or None, the global batch of one step, where
            `fit`'s data does not tell it (a generator). Defaults to None.
        worker_prefix: bool or None, force the `w<rank>_` key prefix on or
            off; None (default) adds it when the cluster has several workers.
        interconnect_gbps: float > 0, a key of
            `keras_mgpu.monitoring.INTERCONNECTS` ("nvlink4", "pcie5_x16",
            ...) or None: the link between the devices of one host, in GB/s
            (bytes) per direction. Given, the monitor also logs
            `perf/scaling_efficiency_at_<N>` for each N of `predict_at`:
            `keras_mgpu.monitoring.predict_scaling` of the measured time per
            update and `perf/comm_bytes_per_update` (ring all-reduce, not
            overlapped: a lower bound where the backend overlaps). The
            measured time is taken as one device's compute: exact on one
            device, pessimistic on several (it already holds their
            reduction). Defaults to None.
        network_gbps: like `interconnect_gbps`, the link each host sends to
            the network (`"network_400gbit"`, ...), for the N of
            `predict_at` beyond one host; None (default) leaves those NaN.
        predict_at: device counts to predict for. Defaults to (8, 64, 512).
        devices_per_host: int >= 1, devices in one host for the prediction.
            Defaults to 8.

    Example:

    ```python
    history = model.fit(x, y, epochs=2, callbacks=[
        keras_mgpu.callbacks.ThroughputMonitor(window_size=20),
    ])
    history.history["perf/samples_per_sec"]
    ```
    """

    # The per-batch hook reads the host clock only, never a device value:
    # Keras 3 may dispatch it asynchronously, and tf_keras need not turn
    # the step's logs into NumPy for it.
    async_safe = True
    _supports_tf_logs = True

    def __init__(
        self,
        *,
        window_size: int = 100,
        tokens_per_sample: int | None = None,
        token_input: str | None = None,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
        batch_size: int | None = None,
        worker_prefix: bool | None = None,
        interconnect_gbps: float | str | None = None,
        network_gbps: float | str | None = None,
        predict_at: tuple[int, ...] | list[int] = (8, 64, 512),
        devices_per_host: int = 8,
    ) -> None:
        super().__init__()
        self._backend_name = require_backend("ThroughputMonitor")
        self.window_size = check_int(window_size, "window_size", minimum=1)
        self.tokens_per_sample = check_int(
            tokens_per_sample, "tokens_per_sample", minimum=1, allow_none=True
        )
        if token_input is not None and not isinstance(token_input, str):
            raise TypeError(
                "Argument `token_input` must be the name of a model input "
                f"(a str) or None. Received: token_input={token_input!r} "
                f"(of type {type(token_input).__name__})"
            )
        if token_input is not None and tokens_per_sample is not None:
            raise ValueError(
                "Arguments `tokens_per_sample` and `token_input` cannot both "
                "be given. Received: tokens_per_sample="
                f"{tokens_per_sample!r}, token_input={token_input!r}"
            )
        self.token_input = token_input
        self.flops_per_sample = check_number(
            flops_per_sample,
            "flops_per_sample",
            minimum=0,
            exclusive_minimum=True,
            allow_none=True,
        )
        self.peak_flops = check_number(
            peak_flops,
            "peak_flops",
            minimum=0,
            exclusive_minimum=True,
            allow_none=True,
        )
        self.batch_size = check_int(
            batch_size, "batch_size", minimum=1, allow_none=True
        )
        self.worker_prefix = check_bool(
            worker_prefix, "worker_prefix", allow_none=True
        )
        self.interconnect_gbps = _check_link(
            interconnect_gbps, "interconnect_gbps"
        )
        self.network_gbps = _check_link(network_gbps, "network_gbps")
        if isinstance(predict_at, int) or not isinstance(
            predict_at, (tuple, list)
        ):
            raise TypeError(
                "Argument `predict_at` must be a tuple or list of device "
                f"counts (ints >= 1). Received: predict_at={predict_at!r}"
            )
        self.predict_at = tuple(
            check_int(n, "predict_at", minimum=1) for n in predict_at
        )
        self.devices_per_host = check_int(
            devices_per_host, "devices_per_host", minimum=1
        )
        self._notices = Notices()
        self.keys: list[str] = []
        self._prefix = ""
        self._ends: dict[int, float] = {}
        self._batch: Any = None  # JAX: the first batch's structure
        self._measured: dict[str, float | None] | None = None
        self._excluded: list[tuple[float, float]] = []
        self.last: dict[str, float] = {}

    def get_config(self) -> dict[str, Any]:
        return {
            "window_size": self.window_size,
            "tokens_per_sample": self.tokens_per_sample,
            "token_input": self.token_input,
            "flops_per_sample": self.flops_per_sample,
            "peak_flops": self.peak_flops,
            "batch_size": self.batch_size,
            "worker_prefix": self.worker_prefix,
            "interconnect_gbps": self.interconnect_gbps,
            "network_gbps": self.network_gbps,
            "predict_at": list(self.predict_at),
            "devices_per_host": self.devices_per_host,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ThroughputMonitor:
        return cls(**config)

    def _key(self, name: str) -> str:
        return make_key("perf", name, self._prefix)

    # -- the run ---------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._notices.reset()
        self._strategy = current_strategy(
            getattr(self.model, "distribute_strategy", None)
        )
        self._prefix = worker_prefix(self.worker_prefix, self._strategy)
        names = list(_RATE_KEYS)
        if self.tokens_per_sample or self.token_input:
            names.append("tokens_per_sec")
        names += list(_FLOP_KEYS) + list(_COMPILE_KEYS) + [_COMM_KEY]
        if self.interconnect_gbps is not None:
            names += [f"scaling_efficiency_at_{n}" for n in self.predict_at]
        self.keys = [self._key(n) for n in names]
        self._traffic: Any = None
        self._fit_start = time.perf_counter()
        self._excluded = []
        self._first_epoch = True
        self._compile_seconds = NAN
        epoch_iterator = _fit_epoch_iterator() or _tf_keras_data()
        self._adapter = getattr(epoch_iterator, "data_adapter", None)
        self._steps_per_execution = int(
            getattr(self.model, "steps_per_execution", 1) or 1
        )
        self._batch = None
        self._measured = None
        if self._backend_name == "jax":
            from keras_mgpu.backend.jax.flops import COMPILE_LOG

            COMPILE_LOG.ensure_listening()
        else:
            from keras_mgpu.backend.tensorflow.flops import tracing_count

            self._traces_at_begin = tracing_count(
                getattr(self.model, "train_function", None)
            )
            self._element_spec = None
            dataset = getattr(epoch_iterator, "_distributed_dataset", None)
            try:
                self._element_spec = dataset.element_spec
            except Exception:  # noqa: BLE001 - no spec: FLOPs need shapes
                self._element_spec = None

    def on_epoch_begin(self, epoch, logs=None):
        self._ends = {}
        self._epoch_begin = time.perf_counter()
        if self._backend_name == "jax" and self._batch is None:
            self._peek_first_batch()

    def _peek_first_batch(self) -> None:
        """Wrap `model.train_function` for one call, to read the first
        batch's shapes (installed at epoch begin: the LR callbacks make a
        new train function in their `on_train_begin`)."""
        model = self.model
        original = getattr(model, "train_function", None)
        if original is None:
            return
        monitor = self

        def peeking(state, iterator, *args, **kwargs):
            if model.train_function is peeking:
                model.train_function = original
            if hasattr(iterator, "__next__"):
                iterator = _PeekIterator(iterator, monitor)
            return original(state, iterator, *args, **kwargs)

        model.train_function = peeking
        self._peeking = (peeking, original)

    def on_train_batch_end(self, batch, logs=None):
        # Host clock only: `logs` is never read (async_safe).
        self._ends[batch] = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        figures = self.read()
        self._first_epoch = False
        if logs is not None:
            logs.update(figures)

    def on_train_end(self, logs=None):
        peeking = getattr(self, "_peeking", None)
        if (
            peeking
            and getattr(self.model, "train_function", None) is (peeking[0])
        ):
            # `fit` ended before its first step: no wrapper stays behind.
            self.model.train_function = peeking[1]
        self._peeking = None

    # -- the figures -----------------------------------------------------

    def _global_batch(self) -> int | None:
        if self.batch_size is not None:
            return self.batch_size
        if self._backend_name == "jax" and self._batch is not None:
            leaves = [
                leaf
                for leaf in _leaves(self._batch)
                if getattr(leaf, "shape", None)
            ]
            if leaves:
                return int(leaves[0].shape[0])
        size = getattr(self._adapter, "batch_size", None)
        return int(size) if size else None

    def _partial_step(self) -> int | None:
        """The step index of a partial last batch (left out of windows:
        fewer samples, and a new shape compiles again), or None."""
        adapter = self._adapter
        try:
            if adapter is not None and adapter.has_partial_batch:
                return int(adapter.num_batches) - 1
        except Exception:  # noqa: BLE001 - an adapter that cannot tell
            return None
        return None

    def _window(self) -> tuple[int, float]:
        """Steps and seconds of the window (compile inside it left out)."""
        partial = self._partial_step()
        steps = sorted(self._ends)
        if partial is not None:
            steps = [s for s in steps if s < partial]
        if len(steps) < 2:
            return 0, NAN
        last = steps[-1]
        first = steps[0]
        for step in steps:
            if last - step <= self.window_size:
                first = step
                break
        # Under Keras's asynchronous dispatch the batch-end hooks run on a
        # thread pool, when each step's results are ready: their clocks
        # may come out of step order (measured: 8 steps within 0.1 ms, in
        # the order 5, 6, 7, 3, 2, 4, 1, 0), so the window's span is the
        # earliest to the latest of its stamps, never negative.
        stamps = [self._ends[s] for s in steps if first <= s <= last]
        start, end = min(stamps), max(stamps)
        seconds = end - start - self._compile_within(start, end)
        return last - first, seconds

    def _compile_within(self, start: float, end: float) -> float:
        if self._backend_name != "jax":
            return 0.0
        from keras_mgpu.backend.jax.flops import COMPILE_LOG

        # Only the part of each compilation inside the window: an event is
        # logged at its end, and one that began before `start` (the steps'
        # host clock lags the dispatching thread under asynchronous
        # dispatch) counted whole made the window's seconds negative and
        # the rates NaN (seen once in CI on a loaded machine).
        # Compilations may overlap (several threads): their union counts.
        _, _, events = COMPILE_LOG.since(start)
        spans = sorted(
            (max(start, e[0] - e[1]), min(end, e[0])) for e in events if e[2]
        )
        covered, reach = 0.0, start
        for begin, finish in spans:
            begin = max(begin, reach)
            if finish > begin:
                covered += finish - begin
                reach = finish
        return covered

    def _compile(self, step_seconds: float) -> tuple[float, float]:
        """Compilations during this `fit` so far: (count, seconds)."""
        if self._backend_name == "jax":
            from keras_mgpu.backend.jax.flops import COMPILE_LOG

            _, _, events = COMPILE_LOG.since(self._fit_start)
            events = [
                e
                for e in events
                if not any(a <= e[0] <= b for a, b in self._excluded)
            ]
            return (
                float(sum(1 for e in events if e[2])),
                float(sum(e[1] for e in events)),
            )
        from keras_mgpu.backend.tensorflow.flops import tracing_count

        now = tracing_count(getattr(self.model, "train_function", None))
        count = (
            NAN
            if now is None or self._traces_at_begin is None
            else float(now - self._traces_at_begin)
        )
        if self._first_epoch and self._ends:
            first = self._ends[min(self._ends)] - self._epoch_begin
            steady = step_seconds if math.isfinite(step_seconds) else 0.0
            self._compile_seconds = max(0.0, first - steady)
        return count, self._compile_seconds

    def _tokens_per_sample(self) -> float:
        if self.tokens_per_sample is not None:
            return float(self.tokens_per_sample)
        if self.token_input is None:
            return NAN
        shape = self._input_shape(self.token_input)
        if shape is None or len(shape) < 2 or shape[1] is None:
            self._notices.warn(
                "tokens",
                "ThroughputMonitor: cannot read the sequence length of "
                f"input {self.token_input!r} (token_input); tokens/s is NaN. "
                "Pass tokens_per_sample instead.",
            )
            return NAN
        return float(shape[1])

    def _input_shape(self, name: str) -> tuple | None:
        structure = (
            self._batch if self._backend_name == "jax" else self._element_spec
        )
        x = structure[0] if isinstance(structure, tuple) else structure
        if isinstance(x, dict) and name in x:
            spec = x[name]
            # Under a tf.distribute strategy: a PerReplicaSpec, one
            # TensorSpec per local replica (the sequence axis is theirs).
            value_specs = getattr(spec, "_value_specs", None)
            if value_specs:
                spec = value_specs[0]
            shape = getattr(spec, "shape", None)
            return None if shape is None else tuple(shape)
        return None

    def _measure(self, batch: int | None) -> dict[str, float | None]:
        """Model and hardware FLOPs of one step, per sample (once)."""
        if self._measured is not None:
            return self._measured
        result: dict[str, float | None] = {"model": None, "hardware": None}
        start = time.perf_counter()
        try:
            if batch is None:
                raise ValueError("the batch size is unknown")
            if self._backend_name == "jax":
                from keras_mgpu.backend.jax.flops import step_flops

                if self._batch is None:
                    raise ValueError("the first batch was not seen")
                step = step_flops(self.model, self._batch)
            else:
                from keras_mgpu.backend.tensorflow.flops import step_flops

                specs = self._per_replica_specs(batch)
                step = step_flops(self.model, specs, self._strategy)
            result = {
                k: (None if v is None else v / batch) for k, v in step.items()
            }
        except Exception as exc:  # noqa: BLE001 - a monitor never fails fit
            self._notices.warn(
                "flops",
                "ThroughputMonitor: could not measure the step's FLOPs "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                "FLOPs, TFLOP/s and MFU are NaN. Pass flops_per_sample.",
            )
        self._excluded.append((start, time.perf_counter()))
        self._measured = result
        return result

    def _per_replica_specs(self, batch: int) -> Any:
        import tensorflow as tf

        replicas = max(1, int(self._strategy.num_replicas_in_sync))
        per_replica = batch // replicas
        if per_replica * replicas != batch:
            raise ValueError(f"batch {batch} is not split evenly")

        def spec(element):
            element = getattr(element, "_value_specs", [element])[0]
            shape = tuple(element.shape)
            if None in shape[1:]:
                raise ValueError(f"the data's shape {shape} is not static")
            return tf.TensorSpec((per_replica,) + shape[1:], element.dtype)

        if self._element_spec is None:
            raise ValueError("the data's element spec is unknown")
        return tf.nest.map_structure(spec, self._element_spec)

    def _device_peak(self) -> tuple[int, float | None]:
        if self._backend_name == "jax":
            from keras_mgpu.backend.jax.flops import device_count_and_kind
        else:
            from keras_mgpu.backend.tensorflow.flops import (
                device_count_and_kind,
            )
        count, kind = device_count_and_kind(self._strategy)
        if self.peak_flops is not None:
            return count, self.peak_flops
        dtype = getattr(
            getattr(self.model, "dtype_policy", None), "compute_dtype", None
        )
        return count, table_peak(kind, dtype or "float32")

    def _scaling(self, step_seconds: float) -> dict[str, float]:
        """`comm_bytes_per_update` (once per `fit`) and, with a link given,
        the predicted scaling efficiency at each N of `predict_at`."""
        from keras_mgpu.monitoring.communication import (
            predict_scaling,
            update_bytes,
        )

        if self._traffic is None:
            try:
                self._traffic = update_bytes(self.model)
            except Exception as exc:  # noqa: BLE001 - a monitor never fails
                self._traffic = False
                self._notices.warn(
                    "comm",
                    "ThroughputMonitor: could not size the update's "
                    f"reduction ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200]}); "
                    "perf/comm_bytes_per_update is NaN.",
                )
        traffic = self._traffic or None
        figures = {
            _COMM_KEY: NAN if traffic is None else traffic.bytes_per_update
        }
        if self.interconnect_gbps is None:
            return figures
        accumulation = accumulation_steps_of(self.model.optimizer)
        update_seconds = step_seconds * accumulation
        for n in self.predict_at:
            hosts = max(1, math.ceil(n / self.devices_per_host))
            efficiency = NAN
            usable = (
                traffic is not None
                and update_seconds > 0
                and n % hosts == 0
                and (hosts == 1 or self.network_gbps is not None)
            )
            if usable:
                efficiency = predict_scaling(
                    step_seconds=update_seconds,
                    bytes_per_update=traffic,
                    devices=n,
                    hosts=hosts,
                    intra_host_gbps=self.interconnect_gbps,
                    inter_host_gbps=self.network_gbps,
                ).efficiency
            figures[f"scaling_efficiency_at_{n}"] = efficiency
        return figures

    def read(self) -> dict[str, float]:
        """The figures of the epoch so far, keyed as in the logs."""
        steps, seconds = self._window()
        batch = self._global_batch()
        accumulation = accumulation_steps_of(self.model.optimizer)
        batches_per_sec = steps / seconds if steps and seconds > 0 else NAN
        samples_per_sec = batches_per_sec * (batch or NAN)
        figures = {
            "samples_per_sec": samples_per_sec,
            "batches_per_sec": batches_per_sec,
            "updates_per_sec": batches_per_sec / accumulation,
        }
        if self.tokens_per_sample or self.token_input:
            figures["tokens_per_sec"] = (
                samples_per_sec * self._tokens_per_sample()
            )
        measured = (
            self._measure(batch)
            if self.flops_per_sample is None
            else {"model": None, "hardware": None}
        )
        model_flops = self.flops_per_sample or measured["model"] or NAN
        hardware = measured["hardware"] or NAN
        devices, peak = self._device_peak()
        tflops = model_flops * samples_per_sec / devices
        figures["flops_per_sample"] = model_flops
        figures["hardware_flops_per_sample"] = hardware
        figures["flops_per_update"] = (
            model_flops * (batch or NAN) * accumulation
        )
        figures["tflops_per_device"] = tflops / 1e12
        figures["mfu"] = tflops / peak if peak else NAN
        figures["hfu"] = (
            hardware * samples_per_sec / devices / peak if peak else NAN
        )
        count, compile_seconds = self._compile(
            seconds / steps if steps else NAN
        )
        figures["compile_seconds"] = compile_seconds
        figures["compile_count"] = count
        figures["window_steps"] = float(steps)
        figures.update(self._scaling(seconds / steps if steps else NAN))
        self.last = {self._key(k): float(v) for k, v in figures.items()}
        return dict(self.last)


def _check_link(value: Any, argument: str) -> float | str | None:
    """A bandwidth in GB/s (> 0), a key of `INTERCONNECTS`, or None."""
    from keras_mgpu.monitoring.communication import INTERCONNECTS

    if value is None or (isinstance(value, str) and value in INTERCONNECTS):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0 and math.isfinite(value):
            return float(value)
    raise ValueError(
        f"Argument `{argument}` must be a bandwidth in GB/s (a number > 0), "
        f"a key of keras_mgpu.monitoring.INTERCONNECTS "
        f"({', '.join(sorted(INTERCONNECTS))}) or None. "
        f"Received: {argument}={value!r}"
    )


def _leaves(structure: Any) -> list:
    import keras

    return keras.tree.flatten(structure)
