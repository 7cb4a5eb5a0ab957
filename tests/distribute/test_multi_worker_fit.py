"""Keras 3 `fit` / `evaluate` / `predict` under MultiWorkerMirroredStrategy
with `enable_multi_worker_fit()` (keras-team/keras#20585).

One 2-worker cluster runs every scenario (tests/distribute/mw_fit_bodies.py);
the references are the same training in one process on the global batch.
The unit tests below need no cluster: the patch is a no-op elsewhere,
reversible, idempotent and guarded by the Keras version.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _processes import run_workers
from _training import max_abs_diff, mlp, regression_data
from conftest import make_strategy

from keras_mgpu._flavour import keras
from keras_mgpu.distribute import (
    MultiWorkerFitWarning,
    disable_multi_worker_fit,
    enable_multi_worker_fit,
    multi_worker_fit_enabled,
)
from keras_mgpu.distribute import multi_worker_fit as patch_module

TOLERANCE = 1e-6  # float32 summation order; measured 6e-8 to 1.2e-7


@pytest.fixture(scope="module")
def cluster():
    return run_workers("distribute.mw_fit_bodies:fit_scenarios", 2, timeout=300)


@pytest.mark.slow
def test_fit_equals_one_process_on_the_global_batch(cluster):
    for result in cluster:
        assert result["replicas"] == 2
        plain = result["plain"]
        assert max_abs_diff(plain["weights"], plain["reference"]) < TOLERANCE
    assert cluster[0]["plain"]["weights"] == cluster[1]["plain"]["weights"]


@pytest.mark.slow
def test_evaluate_and_predict(cluster):
    for result in cluster:
        plain = result["plain"]
        # steps_per_execution=2 (untrained model): predict has no
        # multi-step loop, so it works and keras_mgpu lets it through.
        np.testing.assert_allclose(
            result["predict_spe2"], result["predict_spe2_reference"], atol=1e-6
        )
        assert plain["evaluate"] == pytest.approx(
            plain["evaluate_reference"], rel=1e-5
        )
        np.testing.assert_allclose(
            plain["predict"], plain["predict_reference"], atol=1e-5
        )


@pytest.mark.slow
def test_every_component_in_fit(cluster):
    for result in cluster:
        components = result["components"]
        assert (
            max_abs_diff(components["weights"], components["reference"])
            < TOLERANCE
        )
        assert components["updates"] == 12  # 3 epochs x 8 micro-steps / 2
        # Scaled 2x (global batch 16 / 8), warmed up over 6 updates.
        assert components["learning_rate"][-1] == pytest.approx(0.1)
        keys = components["log_keys"]
        for worker in (0, 1):  # gathered: every worker logs both
            assert f"mem/w{worker}_host_rss_mb" in keys
            assert f"cpu/w{worker}_util_mean_pct" in keys
    assert (
        cluster[0]["components"]["weights"]
        == cluster[1]["components"]["weights"]
    )
    # ThroughputMonitor: global rates, an update of 2 micro-steps, FLOPs
    # measured on the traced step, keys prefixed per worker.
    for rank, result in enumerate(cluster):
        figures = {
            key.split("_", 1)[1]: value
            for key, value in result["components"]["throughput"].items()
        }
        assert all(
            key.startswith(f"perf/w{rank}_")
            for key in result["components"]["throughput"]
        )
        assert figures["samples_per_sec"] == pytest.approx(
            figures["batches_per_sec"] * 8  # the global batch of a step
        )
        assert figures["updates_per_sec"] == pytest.approx(
            figures["batches_per_sec"] / 2
        )
        assert figures["flops_per_sample"] > 0


@pytest.mark.slow
def test_dataset_of_unknown_cardinality_with_validation(cluster):
    for result in cluster:
        run = result["tf_dataset"]
        assert max_abs_diff(run["weights"], run["reference"]) < TOLERANCE
        assert len(run["val_loss"]) == 2


@pytest.mark.slow
def test_shuffled_arrays_cover_every_sample_once_per_epoch(cluster):
    # Without the shared seed (measured): counts of 0, 1 and 2 in one
    # epoch, with no global seed and with a different seed per worker.
    for result in cluster:
        first, second = result["coverage"]["counts"]
        assert set(first) == {1.0}
        assert set(second) == {2.0}


@pytest.mark.slow
def test_clear_errors_and_warnings(cluster):
    for result in cluster:
        assert (
            "ValueError: `model.fit` with steps_per_execution=2"
            in (result["steps_per_execution_error"])
        )
        assert "keras-team/keras#19246" in result["steps_per_execution_error"]
        assert "keras_mgpu.callbacks.BackupAndRestore" in result["backup_error"]
        (warning,) = result["partial_batch_warnings"]
        assert "partial batch of 4 samples" in warning


@pytest.mark.slow
def test_a_slow_worker_is_flagged_on_every_worker(cluster):
    """Properties that hold under any load: the figures' definitions, the
    sleep as a lower bound of worker 1's busy time, the busiest worker
    named. (Gaps
    between the workers' figures, e.g. "worker 0 waits 500 ms more", were
    timing and failed on a loaded machine.)"""
    from distribute.mw_fit_bodies import STRAGGLER_SLEEP

    sleep_ms = 1000 * STRAGGLER_SLEEP
    for result in cluster:
        slow = result["straggler"]
        logs = slow["logs"]
        busy = []
        for worker in (0, 1):
            figures = [
                logs[f"workers/w{worker}_{name}"]
                for name in ("step_ms", "wait_ms", "busy_ms")
            ]
            step, wait, work = figures
            assert step == pytest.approx(wait + work, rel=1e-6, abs=1e-3)
            assert wait >= 0
            busy.append(work)
        # The sleep is outside every collective: all of it is busy time.
        assert busy[1] >= 0.99 * sleep_ms
        # Lockstep: worker 0's steps last through worker 1's sleeps.
        assert logs["workers/w0_step_ms"] > 0.75 * sleep_ms
        # The slowest is the worker with the most busy time: worker 1 (its
        # sleep) on a quiet machine; on CI's loaded 2 cores worker 0's own
        # busy time once exceeded it (2026-11-29), so the index is checked
        # against the figures, not assumed.
        assert logs["workers/slowest"] == float(
            max((0, 1), key=busy.__getitem__)
        )
        assert logs["workers/step_time_ratio"] == pytest.approx(
            max(busy) / min(busy), rel=1e-6
        )
        # The default warn_ratio, 1.25: one warning a fit, once the ratio
        # is past it (always, on a quiet machine, naming worker 1).
        assert len(slow["warnings"]) <= 1
        assert all("is a straggler" in w for w in slow["warnings"])
        if logs["workers/step_time_ratio"] > 1.25:
            assert slow["warnings"]
    assert cluster[0]["straggler"]["logs"] == cluster[1]["straggler"]["logs"]


@pytest.mark.slow
@pytest.mark.keras_limit
def test_keras_steps_per_execution_fails_under_multi_worker(cluster):
    """keras-team/keras#19246: what our ValueError replaces."""
    for result in cluster:
        error = result["keras_limits"]["steps_per_execution"]
        assert "must feed a value for placeholder" in error


@pytest.mark.slow
@pytest.mark.keras_limit
def test_keras_backup_and_restore_is_not_multi_worker_safe(cluster):
    """Keras 3's BackupAndRestore gives every worker the same files: with
    the workers' saves serialised (so the outcome does not depend on who
    wins a race), worker 1 writes over worker 0's backup in the shared
    `backup_dir`, every epoch. (Unserialised, they race on those files:
    one worker fails, with FileExistsError or an HDF5 lock error, or
    neither does.) tf_keras kept the non-chief's backup apart: a Keras
    release that does so makes this test fail."""
    by_rank = {r["keras_limits"]["backup"]["rank"]: r for r in cluster}
    assert set(by_rank) == {0, 1}
    files = ["latest.weights.h5", "training_metadata.json"]
    for result in cluster:
        backup = result["keras_limits"]["backup"]
        assert backup["error"] is None, backup
        assert backup["files"] == [files, files], backup  # each epoch
    backup = by_rank[1]["keras_limits"]["backup"]
    assert backup["rewritten_by_worker_1"] == [files, files], backup


# ----------------------------------------------------------------------
# Without a cluster
# ----------------------------------------------------------------------
@pytest.fixture
def restored():
    was = multi_worker_fit_enabled()
    yield
    disable_multi_worker_fit()
    if was:
        enable_multi_worker_fit()


def test_enable_is_idempotent_and_reversible(restored):
    from keras.src.backend.tensorflow import trainer

    original_fit = keras.Model.fit
    original_reduce = trainer.reduce_per_replica
    assert enable_multi_worker_fit() is True
    assert enable_multi_worker_fit() is True
    assert multi_worker_fit_enabled()
    assert keras.Model.fit is not original_fit
    assert keras.Model.fit.__wrapped__ is original_fit
    assert trainer.reduce_per_replica.__wrapped__ is original_reduce
    disable_multi_worker_fit()
    disable_multi_worker_fit()
    assert not multi_worker_fit_enabled()
    assert keras.Model.fit is original_fit
    assert trainer.reduce_per_replica is original_reduce


def test_a_newer_keras_with_unchanged_code_is_accepted(restored, monkeypatch):
    disable_multi_worker_fit()
    monkeypatch.setattr(keras, "version", lambda: "3.99.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultiWorkerFitWarning)
        assert enable_multi_worker_fit() is True
    assert multi_worker_fit_enabled()


def test_changed_keras_code_is_refused_naming_what_differs(
    restored, monkeypatch
):
    """The version string alone says nothing: a Keras whose trainer code
    changed is refused, whatever version it claims to be."""
    from keras.src.backend.tensorflow import trainer
    from keras.src.trainers.data_adapters import array_data_adapter

    disable_multi_worker_fit()

    def reduce_per_replica(values, strategy, reduction):
        return values  # a "changed" Keras function

    def get_tf_dataset(self):
        return None

    monkeypatch.setattr(trainer, "reduce_per_replica", reduce_per_replica)
    monkeypatch.setattr(
        array_data_adapter.ArrayDataAdapter, "get_tf_dataset", get_tf_dataset
    )
    with pytest.warns(MultiWorkerFitWarning) as caught:
        assert enable_multi_worker_fit() is False
    (message,) = [str(w.message) for w in caught]
    assert f"Keras {keras.version()}" in message
    assert "reduce_per_replica differs from Keras 3.10-3.15" in message
    assert "ArrayDataAdapter.get_tf_dataset differs" in message
    assert "TFEpochIterator" not in message  # unchanged: not named
    assert not multi_worker_fit_enabled()
    assert trainer.reduce_per_replica is reduce_per_replica  # untouched


# Edits of Keras's data adapters that would hand TensorFlow batches around
# the per-instance replacements of `_copy_python_batches` (and of the
# PyDataset shuffle): (name, installed text, changed text).
_BYPASSES = [
    # The attribute renamed: the generator keras_mgpu replaced goes unused.
    (
        "GeneratorDataAdapter.get_tf_dataset",
        "self.generator()",
        "self._generator()",
    ),
    ("PyDatasetAdapter.get_tf_dataset", "self._get_iterator,", "self._it,"),
    # Looked up on the class: a per-instance replacement is skipped.
    (
        "PyDatasetAdapter._get_iterator",
        "self._finite_generator()",
        "PyDatasetAdapter._finite_generator(self)",
    ),
    *[
        (
            f"PyDatasetAdapter.{name}",
            "self._standardize_batch(",
            "PyDatasetAdapter._standardize_batch(self, ",
        )
        for name in (
            "_finite_generator",
            "_infinite_generator",
            "_finite_enqueuer_generator",
            "_infinite_enqueuer_generator",
        )
    ],
]


@pytest.mark.parametrize(
    ("name", "installed", "changed"), _BYPASSES, ids=[b[0] for b in _BYPASSES]
)
def test_a_change_to_the_data_code_the_batch_copy_relies_on_is_named(
    name, installed, changed, tmp_path, monkeypatch
):
    """A Keras whose data adapters would pass a generator's or PyDataset's
    batches around keras_mgpu's per-instance copy (TensorFlow then
    overwrites the user's arrays) is refused, naming the function."""
    import importlib.util
    import inspect
    import sys
    import textwrap

    from keras_mgpu.distribute import _keras_trainer_patch

    live = _keras_trainer_patch._relied_on()[name]
    owner_name, attribute = name.split(".")
    owner = getattr(sys.modules[live.__module__], owner_name)
    source = textwrap.dedent(inspect.getsource(live))
    assert installed in source

    def replace_with(text: str, stem: str) -> None:
        # A real file: the fingerprint reads the function's source.
        path = tmp_path / f"{stem}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setattr(owner, attribute, getattr(module, attribute))

    replace_with(source, "same_code")  # a copy of the code is no change
    assert _keras_trainer_patch.structure_differences() == []
    replace_with(source.replace(installed, changed), "changed_code")
    (difference,) = _keras_trainer_patch.structure_differences()
    assert difference.startswith(f"{name} differs from Keras 3.")


def test_the_installed_keras_matches_a_known_release():
    from keras_mgpu.distribute import _keras_trainer_patch

    assert _keras_trainer_patch.structure_differences() == []
    minor = int(keras.version().split(".")[1])
    expected = {10: "3.10", 11: "3.11", 16: _keras_trainer_patch.NIGHTLY}
    assert _keras_trainer_patch.keras_release_of_installed_code() == (
        expected.get(minor, "3.12-3.15")
    )


def test_a_missing_trainer_class_is_named_with_every_other_difference(
    restored, monkeypatch
):
    """keras-nightly 3.16 renamed `TensorFlowTrainer`: the refusal named
    only the missing class (the first lookup that failed). Every difference
    is named: each function looked up on the missing class, and a changed
    data adapter beside it."""
    from keras.src.backend.tensorflow import trainer
    from keras.src.trainers.data_adapters import array_data_adapter

    from keras_mgpu.distribute import _keras_trainer_patch

    disable_multi_worker_fit()
    for name in _keras_trainer_patch.TRAINER_CLASS_NAMES:
        monkeypatch.delattr(trainer, name, raising=False)

    def get_tf_dataset(self):
        return None

    monkeypatch.setattr(
        array_data_adapter.ArrayDataAdapter, "get_tf_dataset", get_tf_dataset
    )
    with pytest.warns(MultiWorkerFitWarning) as caught:
        assert enable_multi_worker_fit() is False
    (message,) = [str(w.message) for w in caught]
    assert "TensorFlowTrainer._maybe_symbolic_build is gone" in message
    assert "no trainer class (looked for TensorFlowTrainer or Trainer)" in (
        message
    )
    assert "ArrayDataAdapter.get_tf_dataset differs" in message
    assert "TensorFlowTrainer is gone" in message  # fit/evaluate/predict
    assert "reduce_per_replica" not in message  # unchanged: not named
    assert not multi_worker_fit_enabled()


def test_the_trainer_class_is_found_under_either_name(restored, monkeypatch):
    """Keras 3.16 names it `Trainer`: the patch installs on whichever name
    the module defines, and uninstalls from it."""
    from keras.src.backend.tensorflow import trainer

    from keras_mgpu.distribute import _keras_trainer_patch

    disable_multi_worker_fit()
    cls = _keras_trainer_patch._trainer_class()
    for name in _keras_trainer_patch.TRAINER_CLASS_NAMES:
        monkeypatch.delattr(trainer, name, raising=False)
    other = (
        "Trainer"
        if cls.__name__ == "TensorFlowTrainer"
        else ("TensorFlowTrainer")
    )
    monkeypatch.setattr(trainer, other, cls, raising=False)
    assert _keras_trainer_patch.structure_differences() == []
    original_fit = vars(cls)["fit"]
    assert enable_multi_worker_fit() is True
    assert vars(cls)["fit"].__wrapped__ is original_fit
    disable_multi_worker_fit()
    assert vars(cls)["fit"] is original_fit


def _array_orders(epochs: int) -> list[list[int]]:
    """The sample order of each epoch of Keras's own epoch iterator on
    shuffled arrays, one process, driven as `fit` drives it."""
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    x = np.arange(16, dtype="float32").reshape(16, 1)
    iterator = TFEpochIterator(
        x=x,
        y=x,
        batch_size=4,
        shuffle=True,
        distribute_strategy=tf.distribute.get_strategy(),
    )
    iterator.reset()
    orders = []
    for _ in range(epochs):
        ids = []
        for *_, batches in iterator:
            for batch in batches:
                ids += [int(v) for v in batch[0].numpy().ravel()]
        orders.append(ids)
    return orders


@pytest.mark.keras_limit
def test_keras_3_16_shuffles_arrays_in_one_order_for_every_epoch():
    """keras-nightly 3.16.0.dev2026102704 (TensorFlow backend): the array
    shuffle became a `stateless_shuffle` seeded by the adapter's epoch
    counter when the dataset is built, and the TensorFlow trainer builds it
    once per `fit`: every epoch, and every run whatever the seed, sees the
    same order (3.10-3.15: a new order every epoch). Under a multi-worker
    strategy `enable_multi_worker_fit()` reseeds it per epoch
    (test_mw_data_order.py). Fails when Keras reshuffles again."""
    from keras.src.trainers.data_adapters import array_data_adapter

    if not hasattr(array_data_adapter.ArrayDataAdapter, "_tf_shuffle"):
        pytest.skip(f"Keras {keras.version()} shuffles with the graph seed")
    first, second, third = _array_orders(3)
    assert sorted(first) == list(range(16))
    assert first == second == third
    keras.utils.set_random_seed(7)
    assert _array_orders(1) == [first]  # the seed changes nothing


def test_version_guard():
    assert patch_module.keras_version_is_tested("3.15.1")
    assert patch_module.keras_version_is_tested("3.10.0")
    assert not patch_module.keras_version_is_tested("3.9.2")
    assert not patch_module.keras_version_is_tested("4.0.0")


@pytest.mark.parametrize("name", ["default", "mirrored_2"])
def test_no_change_outside_multi_worker_training(name, restored):
    """Bit-identical training with and without the fix."""

    def train():
        strategy = make_strategy(name)
        x, y = regression_data(40)
        with strategy.scope():
            model = mlp()
            model.compile(optimizer="sgd", loss="mse")
        with warnings.catch_warnings():
            warnings.simplefilter("error", MultiWorkerFitWarning)
            model.fit(x, y, batch_size=8, epochs=2, verbose=0)  # partial
            loss = model.evaluate(x, y, verbose=0)
            model.predict(x, verbose=0)
        return model.get_weights(), loss

    disable_multi_worker_fit()
    plain = train()
    enable_multi_worker_fit()
    patched = train()
    assert max_abs_diff(plain[0], patched[0]) == 0.0
    assert plain[1] == patched[1]
