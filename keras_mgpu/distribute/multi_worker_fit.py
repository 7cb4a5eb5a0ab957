"""Keras 3 `model.fit` / `evaluate` / `predict` under
`MultiWorkerMirroredStrategy`: an explicit, reversible fix of keras#20585.

Keras 3 (TensorFlow backend) fails there since TensorFlow 2.16
(keras-team/keras#20585, open; Ray Train's TensorFlow example fails the same
way, ray-project/ray#47464). Measured with Keras 3.15.1 / TensorFlow 2.21 in
`keras/src/backend/tensorflow/trainer.py`:

1. `TensorFlowTrainer._maybe_symbolic_build` learns the input shapes by
   all-reducing the first distributed batch with
   `strategy.reduce("MEAN", (x, y), axis=None)`. The multi-worker strategy
   hands the whole tuple to its cross-device ops, which cannot convert a
   tuple of `PerReplica` ("Attempt to convert a value (PerReplica...)").
   Only shapes and dtypes are needed: one local replica's batch gives them,
   without any collective.
2. `reduce_per_replica` reduces scalar step outputs with
   `strategy.reduce("MEAN", v, axis=0)` in multi-worker mode ("Invalid
   reduction dimension 0 for input with 0 dimensions"); the mean over
   replicas is `axis=None`, as tf_keras did and as Keras does under
   `MirroredStrategy`.

`enable_multi_worker_fit()` replaces exactly those two (and wraps `fit` /
`evaluate` / `predict` and the epoch iterator for the checks below); every
replacement hands over to Keras's own code unless the model's strategy is a
`MultiWorkerMirroredStrategy` in multi-worker mode, so nothing changes
elsewhere. Nothing is patched at import: call it once, before `fit`.

Beyond the crash, multi-worker `fit` has four sharp edges that this module
handles explicitly (evidence in the README's compatibility table):

- Data order. Each worker builds the whole input pipeline and
  auto-sharding keeps its share of the batches, so an epoch covers every
  sample once only if every worker produces the same order. With
  `shuffle=True` on in-memory arrays, each worker shuffled with its own
  random seed (one epoch covered 50 of 64 samples on one worker). The
  workers now share a base seed (drawn on the chief, from its global seed
  when one is set, and broadcast once per `fit`) and shuffle each epoch with
  a seed derived from it and the epoch: every sample once per epoch, a new
  order every epoch, bit-reproducible when seeded; the user's global seed
  state is left as it was. A `keras.utils.PyDataset` with `shuffle=True`
  (`workers=1`) gets the same treatment for its batch order. Where the
  order cannot be agreed on, a `MultiWorkerFitWarning` says so: a Python
  generator (each worker runs it whole and keeps every N-th batch), an
  unseeded or per-worker-seeded `tf.data` `shuffle()`, a shuffled
  `PyDataset` with `workers > 1` or `use_multiprocessing`.
- Python batches: TensorFlow wraps a 64-byte-aligned NumPy array a
  generator or `PyDataset` yields without copying it, the chief's share of
  the batch keeps aliasing it, and the train step wrote its output there:
  a batch that is a view of the user's `y` overwrote labels in the user's
  array (TensorFlow 2.19 and 2.21, oneDNN on or off). Every NumPy array
  such inputs yield is copied first.
- `steps_per_execution > 1`: Keras's multi-step loop fails with the default
  `CollectiveAllReduce` ("You must feed a value for placeholder",
  keras-team/keras#19246). TensorFlow defers collective instance keys to
  call time, and Keras calls its inner `tf.function` inside a
  `tf.while_loop`. Switching TensorFlow to trace-time keys makes it run, but
  TensorFlow itself warns those keys mismatch if workers retrace at
  different times: a silent pairing of the wrong collectives. We raise a
  `ValueError` with the remedy instead.
- An uneven last batch is weighted per replica by Keras (each replica's
  mean loss, averaged over replicas), also under `MirroredStrategy`: a
  warning names the remedy (a batch size that divides the samples, or
  `drop_remainder=True`).

And `keras.callbacks.BackupAndRestore`, which is not multi-worker safe in
Keras 3 (every worker creates the same directory), is refused with a
pointer to `keras_mgpu.callbacks.BackupAndRestore`.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

from keras_mgpu.backend import ON_JAX_MULTI_PROCESS, require_backend
from keras_mgpu.distribute.fit_warnings import MultiWorkerFitWarning

# Keras versions whose code this fix was read from and tested with. What
# decides whether it applies is the code itself: `enable_multi_worker_fit`
# compares fingerprints of every Keras function it replaces or relies on
# (`_keras_trainer_patch.KNOWN_FINGERPRINTS`), so a later release with the
# same code is accepted and a changed function is refused by name.
TESTED_KERAS_VERSIONS = ("3.10", "3.11", "3.12", "3.13", "3.14", "3.15")

UPSTREAM_ISSUE = "https://github.com/keras-team/keras/issues/20585"


_LOCK = threading.Lock()
_ORIGINALS: dict[str, Any] = {}


def _keras3() -> Any | None:
    """The Keras 3 package on the TensorFlow backend, or None.

    Imported directly, not through `keras_mgpu._flavour`: the fix concerns
    Keras 3 objects whatever flavour `TF_USE_LEGACY_KERAS` selects for
    `tf.keras` (Ray Train sets it while user code does `import keras`).
    """
    try:
        import keras
    except ImportError:
        return None
    if not hasattr(keras, "version"):
        return None
    major = keras.version().split(".")[0]
    if not major.isdigit() or int(major) < 3:
        return None
    if keras.backend.backend() != "tensorflow":
        return None
    return keras


def keras_version_is_tested(version: str) -> bool:
    """Whether `version` ("3.15.1") is a release this fix was tested on."""
    major_minor = ".".join(version.split(".")[:2])
    return major_minor in TESTED_KERAS_VERSIONS


def keras_code_differences() -> list[str]:
    """What differs between the installed Keras's trainer code and the code
    the fix was read from, one line per function; empty when it all
    matches. Where it is not empty, `enable_multi_worker_fit()` patches
    nothing and warns (what `keras-mgpu info` reports)."""
    from keras_mgpu.distribute import _keras_trainer_patch

    return _keras_trainer_patch.structure_differences()


def multi_worker_fit_enabled() -> bool:
    """Whether `enable_multi_worker_fit()` is in effect in this process."""
    return bool(_ORIGINALS)


def enable_multi_worker_fit() -> bool:
    """Make Keras 3 `model.fit`, `evaluate` and `predict` work under
    `tf.distribute.MultiWorkerMirroredStrategy` (keras-team/keras#20585).

    Call it once per process, before `fit` (any time before is fine: before
    or after building the strategy and model). Idempotent. A no-op returning
    False where it is not needed or not safe: another Keras backend, no
    Keras 3 installed, or a Keras whose code differs from the code this fix
    was read from (Keras 3.10-3.15): every Keras function it replaces or
    relies on is compared by fingerprint, and a mismatch gives a
    `MultiWorkerFitWarning` naming the functions that differ, instead of
    patching code it has not read. A later Keras whose functions are
    unchanged is accepted (with a note in the `keras_mgpu` log). Under every
    strategy other than a multi-worker `MultiWorkerMirroredStrategy`,
    Keras's own code runs unchanged. `disable_multi_worker_fit()` undoes
    it.

    What it changes under a multi-worker strategy (see the module docstring
    and the README's compatibility table for the evidence):

    - the two Keras functions that fail there learn shapes from a local
      replica's batch and reduce scalar outputs over replicas;
    - with `shuffle=True` on arrays (or a `PyDataset` with `workers=1`),
      the workers agree on each epoch's order: every sample once per epoch,
      a new order every epoch, reproducible under a global seed; where they
      cannot agree (generators, unseeded `tf.data` shuffles), a warning;
    - `steps_per_execution > 1` and `keras.callbacks.BackupAndRestore`
      raise a `ValueError` naming the remedy instead of failing obscurely;
    - a final partial batch gives a `MultiWorkerFitWarning`.

    Returns:
        True when the fix is in effect, False when it was not applied.

    Example:

    ```python
    import keras, tensorflow as tf
    import keras_mgpu

    keras_mgpu.distribute.enable_multi_worker_fit()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # TF_CONFIG set
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(dataset, epochs=2)
    ```
    """
    require_backend(
        "enable_multi_worker_fit",
        ("tensorflow",),
        instead=ON_JAX_MULTI_PROCESS,
    )
    keras = _keras3()
    if keras is None:
        return False
    from keras_mgpu.distribute import _keras_trainer_patch

    with _LOCK:
        if _ORIGINALS:
            return True
        differences = _keras_trainer_patch.structure_differences()
        if differences:
            warnings.warn(
                "keras_mgpu.distribute.enable_multi_worker_fit() patched "
                f"nothing: the code of Keras {keras.version()} differs from "
                "the Keras code it was read from and tested with (Keras "
                f"{TESTED_KERAS_VERSIONS[0]}-{TESTED_KERAS_VERSIONS[-1]}): "
                + "; ".join(differences)
                + f". Check whether {UPSTREAM_ISSUE} is fixed in this "
                "release; if not, use the tf_keras flavour or a custom "
                "training loop for multi-worker training.",
                MultiWorkerFitWarning,
                stacklevel=2,
            )
            return False
        if not keras_version_is_tested(keras.version()):
            logging.getLogger("keras_mgpu").info(
                "enable_multi_worker_fit: Keras %s is newer than the "
                "releases it was tested with (%s), but every Keras function "
                "it replaces or relies on is unchanged: patched.",
                keras.version(),
                ", ".join(TESTED_KERAS_VERSIONS),
            )
        _ORIGINALS.update(_keras_trainer_patch.install())
    return True


def disable_multi_worker_fit() -> None:
    """Undo `enable_multi_worker_fit()` (a no-op when it is not in effect)."""
    with _LOCK:
        if _ORIGINALS:
            from keras_mgpu.distribute import _keras_trainer_patch

            _keras_trainer_patch.uninstall(_ORIGINALS)
            _ORIGINALS.clear()
