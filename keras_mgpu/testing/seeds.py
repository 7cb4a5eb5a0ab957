"""`set_random_seed` for tests, which lives in `keras_mgpu.backend.seeds`
(the backend layer seeds a multi-process JAX cluster with it too, and the
backend layer imports nothing above it)."""

from __future__ import annotations

from keras_mgpu.backend.seeds import set_random_seed

__all__ = ["set_random_seed"]
