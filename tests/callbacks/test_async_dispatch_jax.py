"""JAX: every callback of ours keeps Keras's asynchronous batch dispatch
with its default arguments, reads no `logs` value per batch, and adds no
device-to-host fetch per step beyond plain Keras's. Body shared with the
TensorFlow module: `async_dispatch_bodies.py`."""

from __future__ import annotations

import pytest
from callbacks.async_dispatch_bodies import (
    check_async_dispatch,
    check_no_transfer_per_step,
    public_callbacks,
)


@pytest.mark.parametrize("name", public_callbacks())
def test_keeps_async_dispatch(name, tmp_path):
    check_async_dispatch(name, tmp_path)


@pytest.mark.parametrize("name", public_callbacks())
def test_no_device_to_host_transfer_per_step(name, tmp_path):
    check_no_transfer_per_step(name, tmp_path)
