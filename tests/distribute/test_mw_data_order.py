"""Data order of multi-worker `fit` with `enable_multi_worker_fit()`.

One 2-worker cluster (tests/distribute/mw_data_bodies.py) trains a model
that records the sample ids of every batch each worker trained on, for
arrays, `tf.data`, `PyDataset` and a generator, 3 epochs each. Per epoch,
the two workers' ids together must be every sample exactly once; a shuffled
input must change order every epoch, and a seeded run must repeat exactly.
"""

from __future__ import annotations

import pytest
from _processes import run_workers
from _training import max_abs_diff

SAMPLES = 64
EPOCHS = 3
TOLERANCE = 1e-6  # float32 summation order


@pytest.fixture(scope="module")
def cluster():
    return run_workers(
        "distribute.mw_data_bodies:data_order_scenarios", 2, timeout=400
    )


@pytest.fixture(scope="module")
def seeded_again():
    """A second program run, the same seeded scenarios in the same order."""
    return run_workers(
        "distribute.mw_data_bodies:data_order_scenarios",
        2,
        timeout=300,
        args=(True,),
    )


def _epochs(cluster, name):
    """Per epoch: (worker 0's ids, worker 1's ids)."""
    return list(
        zip(cluster[0][name]["epochs"], cluster[1][name]["epochs"], strict=True)
    )


def _assert_every_sample_once_per_epoch(cluster, name):
    epochs = _epochs(cluster, name)
    assert len(epochs) == EPOCHS
    for epoch, (first, second) in enumerate(epochs):
        ids = sorted(first + second)
        assert ids == list(range(SAMPLES)), (name, epoch, ids)


def _orders(cluster, name):
    return {tuple(a + b) for a, b in _epochs(cluster, name)}


def _warnings(cluster, name):
    return [w for result in cluster for w in result[name]["warnings"]]


SHUFFLED = [
    "arrays",
    "arrays_seeded",
    "arrays_seed_per_worker",
    "tf_data_seeded_shuffle",
    "py_dataset",
    "py_dataset_seeded",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", SHUFFLED)
def test_shuffled_input_covers_every_sample_once_in_a_new_order(cluster, name):
    # Before the fix (measured): arrays kept one order for all 3 epochs.
    _assert_every_sample_once_per_epoch(cluster, name)
    assert len(_orders(cluster, name)) == EPOCHS
    assert not _warnings(cluster, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["py_dataset", "py_dataset_seeded"])
def test_each_step_trains_one_py_dataset_batch(cluster, name):
    """Each worker takes its half of every global batch: the halves form
    one of the PyDataset's batches only if both workers drew the same batch
    order. (Before the fix, measured: each worker shuffled with its own
    Python `random`, and every step mixed halves of two batches.)"""
    half = 4  # 8 per global batch, 2 workers
    for first, second in _epochs(cluster, name):
        for step in range(0, len(first), half):
            ids = sorted(first[step : step + half] + second[step : step + half])
            assert ids[0] % 8 == 0 and ids == list(range(ids[0], ids[0] + 8))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["tf_data", "py_dataset_unshuffled", "generator"]
)
def test_unshuffled_input_covers_every_sample_once_in_order(cluster, name):
    _assert_every_sample_once_per_epoch(cluster, name)
    assert len(_orders(cluster, name)) == 1


@pytest.mark.slow
def test_unshuffled_input_equals_one_process(cluster):
    for result in cluster:
        assert (
            max_abs_diff(result["tf_data"]["weights"], result["reference"])
            < TOLERANCE
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["arrays", "py_dataset"])
def test_a_seeded_run_is_bit_reproducible(cluster, seeded_again, name):
    seeded = f"{name}_seeded"
    for first, second in zip(cluster, seeded_again, strict=True):
        assert first[seeded]["epochs"] == second[seeded]["epochs"]
        if name == "arrays":  # the first fit of both clusters
            assert first[seeded]["weights"] == second[seeded]["weights"]
    # ... and the seed matters: the unseeded run drew other orders.
    assert not _orders(cluster, seeded) & _orders(cluster, name)


@pytest.mark.slow
def test_a_fit_after_every_other_kind_trains_as_the_first(cluster):
    """The seeded arrays fit, run again at the end of the same process
    (after tf.data, generator and PyDataset fits), draws the same orders
    and ends at the same weights, bit for bit."""
    for result in cluster:
        first, again = result["arrays_seeded"], result["arrays_seeded_again"]
        assert again["initial"] == first["initial"]
        assert again["epochs"] == first["epochs"]
        assert again["weights"] == first["weights"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["generator", "py_dataset"])
def test_python_batches_leave_the_users_arrays_alone(cluster, kind):
    """A generator or PyDataset yielding views of the user's arrays
    (`y[i:i + batch]`), 64-byte aligned: after a multi-worker fit both
    arrays are unchanged on every worker. (Before the copy, measured: the
    chief's share of every other batch of `y` was overwritten.)"""
    for result in cluster:
        assert result[f"{kind}_views_kept"] == {"x_rows": [], "y_rows": []}


@pytest.mark.slow
def test_tensorflow_overwrites_aliased_python_batches_without_the_copy(
    cluster,
):
    """The TensorFlow behaviour the copy is for (seen on TensorFlow 2.19
    and 2.21): without it, the chief's share of the PyDataset's batches is
    overwritten in the user's `y`. Fails when TensorFlow stops doing so;
    then the copy can go (docs/compatibility.md)."""
    changed = [r["py_dataset_views_uncopied"] for r in cluster]
    assert any(c["y_rows"] for c in changed), changed
    assert all(not c["x_rows"] for c in changed), changed


@pytest.mark.slow
def test_the_workers_train_the_same_weights(cluster):
    for name in SHUFFLED:
        assert cluster[0][name]["weights"] == cluster[1][name]["weights"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, message",
    [
        ("tf_data_unseeded_shuffle", "unseeded shuffle()"),
        ("tf_data_seed_per_worker", "seeds differ between workers"),
        ("generator", "Keras cannot shard it"),
    ],
)
def test_orders_the_workers_cannot_agree_on_are_warned_about(
    cluster, name, message
):
    found = _warnings(cluster, name)
    assert len(found) == 2  # once per worker
    assert all(message in w for w in found)
    if name.startswith("tf_data"):
        # What the warning is about (measured: 45-49 of 64 per epoch).
        covered = [len(set(a + b)) for a, b in _epochs(cluster, name)]
        assert min(covered) < SAMPLES


@pytest.mark.slow
def test_no_warning_where_the_order_is_agreed(cluster):
    for name in ("tf_data", "py_dataset_unshuffled", "arrays_seeded"):
        assert not _warnings(cluster, name)
