"""The flavour switch, read once when `keras_mgpu` is imported.

Kept apart from `_flavour` (which imports Keras) so that importing
`keras_mgpu` stays cheap: the package loads its modules on first use, but the
flavour is the one the environment asked for at `import keras_mgpu`, even if
something (e.g. `import tensorflow_model_optimization`, which sets
`TF_USE_LEGACY_KERAS=1`) changes the variable afterwards.
"""

from __future__ import annotations

import os

LEGACY_ENV_VAR = "TF_USE_LEGACY_KERAS"


def legacy_keras_requested(environ: dict | None = None) -> bool:
    """True when the environment asks TensorFlow for tf_keras."""
    value = (environ if environ is not None else os.environ).get(
        LEGACY_ENV_VAR, ""
    )
    return value.strip().lower() in ("1", "true", "yes")


LEGACY_REQUESTED_AT_IMPORT: bool = legacy_keras_requested()
