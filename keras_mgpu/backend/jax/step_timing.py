"""Time each train step of a JAX `fit` in two parts: fetching the batch
(this process's own input work) and the rest of the step (dispatch, the
compiled computation, and the wait for the other processes in its
collectives), for `StragglerMonitor`.

Keras's JAX trainer calls `model.train_function(state, iterator)` once per
step (Keras 3.15: built by `make_train_function()` before
`on_train_begin`). A `StepTimer` wraps that attribute: the batch is timed
through the iterator it hands on, and the step's outputs are waited for
(`jax.block_until_ready`) before the step is counted done; Keras does that
wait itself right after, when a callback has batch hooks, as this monitor
has. The collectives run inside XLA's compiled step, where nothing can time
them apart from the computation.
"""

from __future__ import annotations

import time
from typing import Any

_ORIGINAL = "_keras_mgpu_untimed"


class _TimedIterator:
    """Hands on `iterator`'s batches, adding the time each fetch took."""

    def __init__(self, iterator: Any) -> None:
        self._iterator = iterator
        self.spent = 0.0

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self._iterator)
        finally:
            self.spent += time.perf_counter() - start


class StepTimer:
    """Per-step times of a model's JAX train function, summed until
    `reset()`: `steps`, `data` (seconds fetching batches) and `in_step`
    (the rest of each step)."""

    def __init__(self) -> None:
        self.active = False
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.data = 0.0
        self.in_step = 0.0

    def install(self, model: Any, watch_frame: Any = None) -> bool:
        """Wrap `model.train_function` (unwrapping a wrapper an earlier
        `fit` left); False when there is none to wrap. With `watch_frame`
        (the `fit` call's frame), the wrapper stops timing and removes
        itself once that call has left the stack (`fit` raised: Keras
        then calls no `on_train_end`), so a later `fit` keeps Keras's
        asynchronous dispatch."""
        uninstall(model)
        original = getattr(model, "train_function", None)
        if original is None:
            return False
        import threading

        import jax

        from keras_mgpu._frames import frame_on_stack

        timer = self
        thread = threading.get_ident()

        def timed(*args: Any, **kwargs: Any) -> Any:
            if timer.active and watch_frame is not None:
                if not frame_on_stack(thread, watch_frame):
                    timer.active = False
                    uninstall(model)
            if not timer.active:
                return original(*args, **kwargs)
            start = time.perf_counter()
            proxy = None
            if len(args) == 2 and hasattr(args[1], "__next__"):
                proxy = _TimedIterator(args[1])
                args = (args[0], proxy)
            result = original(*args, **kwargs)
            jax.block_until_ready(result)
            spent = time.perf_counter() - start
            data = proxy.spent if proxy is not None else 0.0
            timer.steps += 1
            timer.data += data
            timer.in_step += spent - data
            return result

        setattr(timed, _ORIGINAL, original)
        model.train_function = timed
        self.active = True
        return True


def uninstall(model: Any) -> None:
    """Give `model` back its own train function (if a `StepTimer` wrapped
    it)."""
    function = getattr(model, "train_function", None)
    original = getattr(function, _ORIGINAL, None)
    if original is not None:
        model.train_function = original
