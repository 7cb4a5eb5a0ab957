"""PruningStepSync under Keras 3: TFMOT needs tf_keras, so it says so.

Its behaviour with TFMOT is tested in tests/legacy/test_tfmot.py."""

from __future__ import annotations

import pytest

from keras_mgpu.callbacks import PruningStepSync


def test_needs_the_tf_keras_flavour():
    with pytest.raises(
        RuntimeError, match=r"needs the tf_keras flavour.*TF_USE_LEGACY_KERAS=1"
    ):
        PruningStepSync()
