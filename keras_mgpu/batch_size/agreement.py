"""Every worker of a multi-worker cluster gets the same search result."""

from __future__ import annotations

from keras_mgpu.distribute import is_multi_worker  # noqa: F401
from keras_mgpu.distribute.collectives import gather_rows  # noqa: F401
