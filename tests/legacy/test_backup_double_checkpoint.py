"""tf_keras: keras_mgpu.callbacks.BackupAndRestore hands a tf_keras `fit` to
tf_keras's own BackupAndRestore, which keeps one TensorFlow checkpoint:
`double_checkpoint=True` is refused there instead of silently promising a
previous backup that does not exist."""

from __future__ import annotations

import os

import pytest
from _training import mlp, regression_data

from keras_mgpu.callbacks import BackupAndRestore


def test_double_checkpoint_is_refused_in_a_tf_keras_fit(tmp_path):
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    backup = str(tmp_path / "backup")
    with pytest.raises(
        ValueError,
        match=r"Argument `double_checkpoint` cannot be True in a tf_keras "
        r"`fit`: .* keeps one TensorFlow checkpoint .* Pass "
        r"double_checkpoint=False, or train a Keras 3 model\. Received: "
        r"double_checkpoint=True",
    ):
        model.fit(
            x,
            y,
            epochs=1,
            verbose=0,
            callbacks=[BackupAndRestore(backup, double_checkpoint=True)],
        )
    assert not os.path.exists(backup)  # refused before anything is written
    history = model.fit(
        x, y, epochs=2, verbose=0, callbacks=[BackupAndRestore(backup)]
    )
    assert history.epoch == [0, 1]
