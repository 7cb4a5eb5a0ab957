"""Whether a Python frame still runs: how a timer or watchdog installed for
one `fit` call notices that the call has left the stack (it raised, so Keras
runs no `on_train_end`). Pure Python, below every other module."""

from __future__ import annotations

import sys
import types


def frame_on_stack(thread_id: int, frame: types.FrameType) -> bool:
    """Whether `frame` is still executing on thread `thread_id`."""
    top = sys._current_frames().get(thread_id)
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False
