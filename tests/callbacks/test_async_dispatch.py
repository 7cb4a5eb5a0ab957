"""TensorFlow: every callback of ours keeps Keras's asynchronous batch
dispatch with its default arguments (the rule as Keras applies it on a
thread-safe backend) and reads no `logs` value per batch. Body shared with
the JAX module: `async_dispatch_bodies.py`."""

from __future__ import annotations

import pytest
from callbacks.async_dispatch_bodies import (
    check_async_dispatch,
    public_callbacks,
)


@pytest.mark.parametrize("name", public_callbacks())
def test_keeps_async_dispatch(name, tmp_path):
    check_async_dispatch(name, tmp_path)
