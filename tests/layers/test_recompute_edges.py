"""In-place recompute at its edges on TensorFlow; the tests are written once
in `recompute_edges_body.py` (also run on JAX by
`test_recompute_edges_jax.py`)."""

from layers.recompute_edges_body import (  # noqa: F401
    test_remat_scope_layers_train_as_plain,
    test_selective_saves_the_plain_config,
)
