"""The order in which tests/run_suite.py's pytest-xdist processes take the
test modules: the longest first.

`--dist loadfile` hands a process a whole module at a time, and by default
pytest-xdist (3.6 and later) queues the modules by their number of tests,
most first. Our slowest modules have few tests (the examples, the batch
finder's fresh processes, the fault matrices, a cluster per module), so
they came last, and one process ran a 2- to 4-minute module alone while the
other had nothing left. Taking the longest first (the LPT rule) leaves the
short modules for the end, where the two processes finish within a short
module of each other.

A module's cost is its entry in `MODULE_SECONDS` where it has one (the
seconds its tests took in CI, setup included: what the "slowest modules"
lines of each run print), else `SLOW_TEST_SECONDS` per test marked `slow`
plus `TEST_SECONDS` per other test. Only the order changes: every test
still runs, its module's tests in their own order in one process.

tests/run_suite.py loads this plugin (`-p tests._suite_order`); a plain
`pytest` run does not.
"""

from __future__ import annotations

import os

import pytest

# Seconds per module summed over its tests (setup included) on the loaded
# 2-core CI machine: stop 34's "slowest modules" lines (examples 271, the
# finder 247 less the ~50 of its bisection removed since, the TensorFlow
# fault matrix 159, compression 154 of which the cluster module ~40, the
# JAX fault matrix ~90); the rest estimated from single-module runs and
# what the modules start (processes, clusters, Keras's replayed cases).
# Order only: a stale figure costs a little balance, never a test.
MODULE_SECONDS = {
    # Keras 3 on TensorFlow (2026-11-28's run, under extra load)
    "tests/test_examples.py": 260,  # one shared process (ci-cuts)
    "tests/batch_size/test_finder.py": 250,
    "tests/distribute/test_fault_matrix.py": 200,
    "tests/optimizers/test_gradient_accumulation.py": 165,
    "tests/test_cli.py": 100,
    "tests/compression/test_optimizer_compression.py": 120,
    "tests/testing/test_plugin.py": 110,
    "tests/optimizers/test_keras_oracles.py": 100,
    "tests/normalization/test_window_statistics.py": 100,
    "tests/distribute/test_multi_worker_fit.py": 90,
    "tests/callbacks/test_backup_and_restore.py": 85,
    "tests/distribute/test_watchdog_faults.py": 85,
    "tests/layers/test_recompute_grad.py": 85,
    "tests/layers/test_recompute_in_place.py": 85,
    "tests/layers/test_recompute_keras_hub.py": 80,
    "tests/test_docs.py": 60,
    "tests/test_release.py": 60,
    "tests/optimizers/test_ema_window.py": 55,
    "tests/callbacks/test_async_dispatch.py": 45,
    "tests/compression/test_multi_worker_compression.py": 40,
    "tests/callbacks/test_throughput_monitor.py": 40,
    "tests/monitoring/test_communication.py": 35,
    "tests/layers/test_recompute_edges.py": 35,
    "tests/batch_size/test_multi_worker.py": 30,
    # tf_keras
    "tests/legacy/test_worker_failures.py": 50,  # kill, then restart
    "tests/legacy/test_tfmot.py": 40,
}
# The JAX job's figures (modules written once for both backends cost
# differently there; estimated from the helpers' single-module runs of
# 2026-11-28, scaled to an idle machine).
MODULE_SECONDS_JAX = {
    "tests/optimizers/test_accumulation_reduction_jax.py": 45,
    "tests/sharding/test_state_sharding.py": 35,
    "tests/layers/test_recompute_jax.py": 70,
    "tests/optimizers/test_gradient_accumulation.py": 120,
    "tests/distribute/test_fault_matrix.py": 100,
    "tests/distribute/test_jax_monitors_jax.py": 60,
    "tests/normalization/test_window_statistics.py": 50,
    "tests/optimizers/test_keras_oracles.py": 40,
    "tests/normalization/test_conversions.py": 40,
    "tests/distribute/test_jax_cluster_example_jax.py": 40,
    "tests/test_examples.py": 40,
    "tests/testing/test_run_workers_jax.py": 35,
    "tests/schedules/test_warmup.py": 30,
    "tests/callbacks/test_async_dispatch.py": 30,
    "tests/callbacks/test_throughput_monitor.py": 30,
    "tests/test_cli.py": 20,
}
SLOW_TEST_SECONDS = 10
TEST_SECONDS = 1


def module_cost(module: str, tests: int, slow_tests: int) -> float:
    """The seconds a module is expected to take (see the module docstring)
    in this job: `MODULE_SECONDS_JAX` in the JAX job, else
    `MODULE_SECONDS`."""
    jax = os.environ.get("KERAS_BACKEND") == "jax"
    table = MODULE_SECONDS_JAX if jax else MODULE_SECONDS
    if module in table:
        return table[module]
    return SLOW_TEST_SECONDS * slow_tests + TEST_SECONDS * (tests - slow_tests)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's own reordering (by number of tests) would undo ours.
    if getattr(config.option, "loadscopereorder", None) is not None:
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Modules by expected cost, most first; each module's tests together
    and in their order (a stable sort)."""
    tests: dict[str, int] = {}
    slow: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        tests[module] = tests.get(module, 0) + 1
        slow[module] = slow.get(module, 0) + (
            item.get_closest_marker("slow") is not None
        )
    cost = {m: module_cost(m, tests[m], slow[m]) for m in tests}
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])
