"""A background thread that samples a backend at a fixed interval.

The thread never touches tensors: it calls a plain function (NVML, psutil)
off the training thread, so training gets no host-device synchronisation.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable

from keras_mgpu._frames import frame_on_stack
from keras_mgpu._validation import check_number
from keras_mgpu.monitoring.aggregate import Aggregator, Stats

THREAD_NAME_PREFIX = "keras_mgpu-sampler"

# Every sampler that may have a live thread, so `atexit` stops them all.
_LIVE: weakref.WeakSet = weakref.WeakSet()

# Module prefixes of the callback machinery between `fit` and a monitor's
# `on_train_begin`; the first frame outside them owns the training run.
_CALLBACK_MODULES = (
    "keras_mgpu.callbacks",
    "keras_mgpu.monitoring",
    "keras.src.callbacks",
    "tf_keras.src.callbacks",
)


def training_frame() -> types.FrameType | None:
    """The frame that runs the training loop calling the current callback.

    Keras (3.15 and tf_keras 2.21) does not call `on_train_end` when `fit`
    raises, so a sampler started in `on_train_begin` would outlive the
    run. The sampler watches this frame (Keras's `fit`, or a custom loop
    that calls the callbacks) and stops once it has left the stack. This
    reads CPython frames (`sys._getframe`), the only private hook used here.
    """
    try:
        frame = sys._getframe(1)
    except (AttributeError, ValueError):  # not CPython: no watching
        return None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_CALLBACK_MODULES):
            return frame
        frame = frame.f_back
    return None


class Sampler:
    """Calls `sample_fn` every `interval` seconds on a daemon thread.

    Readings go into an `Aggregator`; `collect()` returns the statistics of
    the readings since the previous `collect()`. `start()` and `stop()` are
    idempotent; `start()` on a running sampler first stops it. A sampling
    error never propagates: the first one is kept in `error` and sampling
    stops.

    Args:
        sample_fn: callable returning `{name: float}`.
        interval: float > 0, seconds between readings.
        on_stop: callable or None, run exactly once when the thread ends,
            whichever way (e.g. the backend's `close`).
        name: str, thread name suffix.
    """

    def __init__(
        self,
        sample_fn: Callable[[], dict[str, float]],
        interval: float,
        on_stop: Callable[[], None] | None = None,
        name: str = "",
    ) -> None:
        self.interval = check_number(
            interval, "interval", minimum=0.0, exclusive_minimum=True
        )
        self._sample_fn = sample_fn
        self._on_stop = on_stop
        self._name = (
            f"{THREAD_NAME_PREFIX}-{name}" if name else (THREAD_NAME_PREFIX)
        )
        self._aggregator = Aggregator()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped_callback_ran = True
        self.error: BaseException | None = None

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self, watch_frame: types.FrameType | None = None) -> None:
        """Start sampling; stop by itself when `watch_frame` returns."""
        self.stop()
        self.error = None
        self._aggregator.collect()
        self._stop_event = threading.Event()
        self._stopped_callback_ran = False
        owner = (threading.get_ident(), watch_frame) if watch_frame else None
        self._thread = threading.Thread(
            target=self._run,
            args=(self._stop_event, owner),
            name=self._name,
            daemon=True,
        )
        _LIVE.add(self)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it; run `on_stop` once."""
        self._stop_event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None
        self._finish()

    def sample_now(self) -> None:
        """Take one reading on the calling thread (for windows with none)."""
        try:
            self._aggregator.add(self._sample_fn())
        except Exception as exc:  # a monitor never fails training
            self.error = self.error or exc

    def collect(self) -> dict[str, Stats]:
        """Statistics since the previous `collect()`; starts a new window."""
        return self._aggregator.collect()

    @property
    def samples(self) -> int:
        """Readings in the current window."""
        return self._aggregator.samples

    def latest(self) -> dict[str, float]:
        """The most recent reading ({} before the first)."""
        return self._aggregator.latest()

    def _finish(self) -> None:
        with self._lock:
            if self._stopped_callback_ran:
                return
            self._stopped_callback_ran = True
        if self._on_stop is not None:
            try:
                self._on_stop()
            except Exception as exc:
                self.error = self.error or exc

    def _run(self, stop_event: threading.Event, owner) -> None:
        # Check the training frame more often than a long interval, so a
        # run that raised releases the thread (and NVML) within ~0.25 s.
        tick = min(self.interval, 0.25)
        try:
            next_reading = time.monotonic()
            while not stop_event.is_set():
                if owner is not None and not frame_on_stack(*owner):
                    break  # the training run ended without on_train_end
                now = time.monotonic()
                if now >= next_reading:
                    next_reading = now + self.interval
                    try:
                        self._aggregator.add(self._sample_fn())
                    except Exception as exc:
                        self.error = exc
                        break
                wait = min(tick, max(next_reading - time.monotonic(), 0.0))
                stop_event.wait(wait)
        finally:
            owner = None  # drop the frame: it holds the model and data
            if not stop_event.is_set():
                # Ended on its own: release the backend from here.
                self._finish()


@atexit.register
def _stop_all() -> None:
    for sampler in list(_LIVE):
        sampler.stop(timeout=1.0)


def live_sampler_threads() -> list[threading.Thread]:
    """Sampler threads alive in this process (for tests and diagnostics)."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(THREAD_NAME_PREFIX) and t.is_alive()
    ]
