"""Run the whole test suite: Keras 3 on TensorFlow, Keras 3 on JAX, then the
tf_keras flavour.

Keras 3 on JAX runs in pytest processes of its own with `KERAS_BACKEND=jax`
and 4 CPU devices (`XLA_FLAGS`, set by keras_mgpu.testing before JAX
starts): `tests/conftest.py` collects there the modules that declare
`pytest.mark.backends(..., "jax")` (most: a test is written once for both
backends) and the JAX-only `test_*_jax.py` ones. `--backend jax` (or
`tensorflow`) runs one backend's jobs only.

The Keras flavour is fixed per process, so the tf_keras tests
(`tests/legacy`) run in a pytest process of their own with
`TF_USE_LEGACY_KERAS=1`. Each run spreads its test files over two
pytest-xdist processes (three in the Keras 3 on TensorFlow job, see
KERAS3_WORKERS; `--dist loadfile`: a module's tests, and the multi-worker
cluster its module fixture starts, stay in one process), which take the
longest modules first (`tests/_suite_order.py`): the run ends when the
process with the last module ends, so a 4-minute module (the examples)
must not be the last one. Extra arguments are passed to
every pytest run (`-n 0` runs everything in one process;
KERAS_MGPU_TEST_WORKERS sets the number of processes).

CI (`.ci/run`, 2 cores) on e30831c took 38.3 min: Keras 3 on TensorFlow
1674 tests in 26m46s, JAX 354 in 4m03s, tf_keras 117 in 2m03s, the oldest
floors ~3 min with their install, and the `.venv` install. Each run prints
its slowest modules at its end (where the budget goes; the figures of
`tests/_suite_order.py` come from there).

The runs go one after the other. Running tf_keras and then the oldest
floors on one process beside the JAX job's two (each of those runs leaves
the cores 8-20% idle alone) was measured slower (2026-11-29): the JAX run
took 11m15s instead of 7m18s and tf_keras 8m13s on its process: three
processes with XLA's and TensorFlow's thread pools on 2 cores did less
work per second than two.

A third, smaller run checks the oldest TensorFlow and Keras that
pyproject.toml accepts (its `tensorflow>=` and `keras>=` floors, installed
exactly): a virtual environment of its own, `.venv-oldest` in the repository
root, installed with a time bound (in the background from the start, beside
the Keras 3 tests: mostly download and disk), runs `OLDEST_TESTS` (the code
that depends most on Keras internals: multi-worker `fit`, the optimizers,
the schedules, BatchNormalization's window statistics).
KERAS_MGPU_SKIP_OLDEST=1 skips it (for a quick local run).

`--quick` is the everyday tier: the Keras 3 tests not marked `slow`, less
the modules in QUICK_IGNORED (processes, clusters, Keras's replayed cases):
518 tests in 4.5 min on 2 cores (measured 2026-11-25 with the
normalization package and the batch finder's confirmation run). JAX's quick
tier is `--quick --backend jax`.

`--nightly` (by hand, never part of `.ci/run`) runs only `NIGHTLY_TESTS`
against the newest keras-nightly and tf-nightly, in `.venv-nightly` in the
repository root (upgraded each time, install bounded by
NIGHTLY_INSTALL_TIMEOUT; KERAS_MGPU_NIGHTLY_PINS="keras-nightly==X
tf-nightly==Y" pins them): a Keras rename that switches multi-worker `fit`
off is seen before the release.

Prints one closing line with the totals of all runs and exits non-zero if
any run failed.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
WORKERS = os.environ.get("KERAS_MGPU_TEST_WORKERS", "2")
# The Keras 3 on TensorFlow job takes a third process on the 2 cores: its
# two kept the cores ~84% busy (2026-11-28: 3,050 CPU-s over 2 x 1,807 s;
# the rest spent waiting on processes the tests start: clusters, examples,
# fresh interpreters). KERAS_MGPU_TEST_WORKERS sets every job's count.
KERAS3_WORKERS = os.environ.get("KERAS_MGPU_TEST_WORKERS", "3")

OLDEST_VENV = os.path.join(REPO_ROOT, ".venv-oldest")
OLDEST_INSTALL_TIMEOUT = 900  # seconds; measured 41 s with a warm cache
OLDEST_TESTS = [
    "tests/distribute/test_multi_worker_fit.py",
    "tests/distribute/test_mw_data_order.py",
    "tests/schedules",
    "tests/optimizers/test_gradient_accumulation.py",
    "tests/optimizers/test_gradient_accumulation_state.py",
    # Window statistics rely on private hooks of Keras's layers (the
    # tracker's lock, `_untrack_variable`): 59 passed on Keras 3.10.0
    # (2026-11-25; 2 more tests since).
    "tests/normalization",
]


def _counts(junit_path: str) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not os.path.exists(junit_path):
        return counts
    root = ET.parse(junit_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def slowest_modules(junit_path: str, most: int = 12) -> list[tuple]:
    """(seconds, test module) of the `most` modules whose tests took the
    longest in total (setup, such as a module's cluster, included): where
    the CI budget goes."""
    if not os.path.exists(junit_path):
        return []
    totals: dict[str, float] = {}
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        parts = case.get("classname", "?").split(".")
        if len(parts) > 1 and parts[-1][:1].isupper():  # a test class
            parts = parts[:-1]
        module = ".".join(parts)
        totals[module] = totals.get(module, 0.0) + float(case.get("time", 0))
    return sorted(((t, m) for m, t in totals.items()), reverse=True)[:most]


def _run(
    label: str,
    extra_env: dict[str, str],
    paths: list[str],
    python: str = sys.executable,
) -> tuple:
    junit = os.path.join(tempfile.mkdtemp(), f"{label}.xml")
    env = {**os.environ, **extra_env}
    cmd = [
        python,
        "-m",
        "pytest",
        *paths,
        "-n",
        KERAS3_WORKERS if label == "keras3" else WORKERS,
        "--dist",
        "loadfile",
        # The longest modules first (tests/_suite_order.py).
        "-p",
        "tests._suite_order",
        f"--junitxml={junit}",
        *_pytest_arguments(),
    ]
    print(f"== {label}: {' '.join(cmd)}", flush=True)
    rc = subprocess.call(cmd, cwd=REPO_ROOT, env=env)
    print(f"== {label}: slowest modules (seconds, summed over tests)")
    for seconds, module in slowest_modules(junit):
        print(f"   {seconds:7.1f}  {module}")
    return rc, _counts(junit)


def oldest_pins() -> list[str]:
    """`tensorflow==X` and `keras==Y` for the floors in pyproject.toml."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
        text = f.read()
    pins = []
    for name in ("tensorflow", "keras"):
        match = re.search(rf'"{name}>=([0-9.]+)"', text)
        if match is None:
            raise ValueError(f"pyproject.toml has no {name}>= floor")
        pins.append(f"{name}=={match.group(1)}")
    return pins


def _pip(python: str, *arguments: str, timeout: float) -> None:
    subprocess.run(
        [python, "-m", "pip", "install", "-q", *arguments],
        check=True,
        timeout=max(timeout, 1),
        capture_output=True,
        text=True,
    )


def _oldest_venv(editable: bool) -> tuple[str | None, str]:
    """Create or update `.venv-oldest` on the floors: its python (None when
    the install failed or ran past OLDEST_INSTALL_TIMEOUT) and what to
    print about it.

    In two parts: the floors and pytest (`editable=False`: downloads and
    disk, run in the background beside the Keras 3 tests, see `main`),
    then keras_mgpu itself (`editable=True`: a few seconds, when the run
    comes; its build writes `keras_mgpu.egg-info` into the repository,
    which tests/test_release.py's build also writes)."""
    python = os.path.join(OLDEST_VENV, "bin", "python")
    pins = oldest_pins()
    start = time.monotonic()
    try:
        if not editable:
            if not os.path.exists(python):
                subprocess.run(
                    [sys.executable, "-m", "venv", OLDEST_VENV],
                    check=True,
                    timeout=120,
                    capture_output=True,
                    text=True,
                )
            _pip(
                python,
                *pins,
                "pytest>=8",
                "pytest-timeout>=2.2",
                "pytest-xdist>=3.5",
                timeout=OLDEST_INSTALL_TIMEOUT,
            )
        else:
            # The floors are installed: only keras_mgpu and what else it
            # needs (the pins again, so nothing moves them).
            _pip(python, *pins, "-e", REPO_ROOT, timeout=300)
    except (subprocess.SubprocessError, OSError) as exc:
        output = getattr(exc, "stderr", None) or ""
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        return None, (
            f"== oldest: install of {pins} failed: {exc}\n{output[-3000:]}"
        ).rstrip()
    part = "keras_mgpu" if editable else " ".join(pins)
    return python, (
        f"== oldest: {part} installed in {time.monotonic() - start:.0f} s"
    )


NIGHTLY_VENV = os.path.join(REPO_ROOT, ".venv-nightly")
NIGHTLY_INSTALL_TIMEOUT = 900  # seconds; measured 74 s with a cold cache
NIGHTLY_TESTS = [
    "tests/distribute/test_code_fingerprint.py",
    "tests/distribute/test_multi_worker_fit.py",
    "tests/distribute/test_mw_data_order.py",
]


def _nightly_venv() -> str | None:
    """Create or upgrade `.venv-nightly` on the newest nightlies (or the
    pins of KERAS_MGPU_NIGHTLY_PINS); its python, or None when the install
    failed or ran past NIGHTLY_INSTALL_TIMEOUT. keras_mgpu goes in without
    its dependencies: `keras` and `tensorflow` would replace the
    nightlies."""
    python = os.path.join(NIGHTLY_VENV, "bin", "python")
    pins = os.environ.get(
        "KERAS_MGPU_NIGHTLY_PINS", "keras-nightly tf-nightly"
    ).split()
    pip = [python, "-m", "pip", "install", "-q"]
    start = time.monotonic()
    try:
        if not os.path.exists(python):
            subprocess.run(
                [sys.executable, "-m", "venv", NIGHTLY_VENV],
                check=True,
                timeout=120,
            )
        for command in (
            [
                *pip,
                "numpy>=1.23",
                "psutil>=5.9",
                "pytest>=8",
                "pytest-timeout>=2.2",
                "pytest-xdist>=3.5",
            ],
            [*pip, "--pre", "--upgrade", *pins],
            [*pip, "--no-deps", "-e", REPO_ROOT],
        ):
            left = NIGHTLY_INSTALL_TIMEOUT - (time.monotonic() - start)
            subprocess.run(command, check=True, timeout=max(left, 1))
        versions = subprocess.run(
            [
                python,
                "-c",
                "import keras, tensorflow as tf; "
                "print('keras', keras.version(), 'tensorflow', tf.__version__)",
            ],
            check=True,
            timeout=300,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"== nightly: install of {pins} failed: {exc}", flush=True)
        return None
    print(
        f"== nightly: {versions} installed in {time.monotonic() - start:.0f} s",
        flush=True,
    )
    return python


QUICK = "--quick" in sys.argv[1:]


def _backend_asked() -> str | None:
    """`--backend jax` or `--backend tensorflow`: that backend's runs only."""
    argv = sys.argv[1:]
    if "--backend" not in argv:
        return None
    index = argv.index("--backend")
    value = argv[index + 1] if index + 1 < len(argv) else ""
    if value not in ("jax", "tensorflow"):
        sys.exit(f"--backend must be jax or tensorflow. Received: {value!r}")
    return value


BACKEND_ASKED = _backend_asked()
NIGHTLY = "--nightly" in sys.argv[1:]


# Left out of the quick tier besides `slow` tests: modules whose tests each
# start processes (examples, the demo, Keras-limit subprocesses, clusters)
# or replay hundreds of Keras cases (measured in the full run).
QUICK_IGNORED = (
    "tests/test_examples.py",
    "tests/test_cli.py",
    "tests/test_keras_limits.py",
    "tests/distribute",
    "tests/optimizers/test_keras_oracles.py",
    "tests/optimizers/test_gradient_accumulation_state.py",
    "tests/compression/test_optimizer_compression.py",
    "tests/layers/test_recompute_keras_hub.py",
    "tests/optimizers/test_ema_mixed_precision.py",
    "tests/optimizers/test_momentum_correction.py",
    "tests/optimizers/test_gradient_accumulation_distributed.py",
    "tests/batch_size/test_finder.py",
    "tests/normalization/test_window_statistics.py",
)


def _pytest_arguments() -> list[str]:
    """What the command line adds to every pytest run."""
    argv = sys.argv[1:]
    if "--backend" in argv:  # and its value
        index = argv.index("--backend")
        argv = argv[:index] + argv[index + 2 :]
    extra = [a for a in argv if a not in ("--quick", "--nightly")]
    if not QUICK:
        return extra
    ignored = [f"--ignore={path}" for path in QUICK_IGNORED]
    return ["-m", "not slow", *ignored, *extra]


def main() -> int:
    runs = [
        (
            "keras3",
            {"TF_USE_LEGACY_KERAS": "0", "KERAS_BACKEND": "tensorflow"},
            ["tests"],
        ),
        # Keras 3 on JAX: the `test_*_jax.py` modules (tests/conftest.py
        # collects only those when KERAS_BACKEND=jax), 4 CPU devices.
        (
            "jax",
            {"TF_USE_LEGACY_KERAS": "0", "KERAS_BACKEND": "jax"},
            ["tests"],
        ),
    ]
    if QUICK and BACKEND_ASKED is None:
        # The everyday tier stays under 5 minutes: Keras 3 on TensorFlow;
        # `--quick --backend jax` is JAX's (about a minute).
        runs = runs[:1]
    if not QUICK:
        runs.append(
            ("tf_keras", {"TF_USE_LEGACY_KERAS": "1"}, ["tests/legacy"])
        )
    if NIGHTLY:  # by hand only: the newest nightlies, nothing else
        runs = [
            (
                "nightly",
                {"TF_USE_LEGACY_KERAS": "0", "KERAS_BACKEND": "tensorflow"},
                NIGHTLY_TESTS,
            )
        ]
    elif not QUICK and os.environ.get("KERAS_MGPU_SKIP_OLDEST") != "1":
        runs.append(
            (
                "oldest",
                {"TF_USE_LEGACY_KERAS": "0", "KERAS_BACKEND": "tensorflow"},
                OLDEST_TESTS,
            )
        )
    if BACKEND_ASKED is not None:
        runs = [
            run for run in runs if (run[0] == "jax") == (BACKEND_ASKED == "jax")
        ]
    # The oldest floors' install is mostly download and disk: it runs in
    # the background from the start, beside the Keras 3 tests, and is
    # waited for only when its run comes (bounded by its own time-out).
    oldest = None
    if any(label == "oldest" for label, _, _ in runs):
        oldest = concurrent.futures.ThreadPoolExecutor(1).submit(
            _oldest_venv, editable=False
        )
    failed_runs = 0
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for label, env, paths in runs:
        python = sys.executable
        if label == "oldest":  # in an environment of its own
            python, message = oldest.result()
            print(message, flush=True)
            if python is not None:
                python, message = _oldest_venv(editable=True)
                print(message, flush=True)
        elif label == "nightly":
            python = _nightly_venv()
        if label in ("oldest", "nightly"):
            if python is None:
                failed_runs += 1
                total["failed"] += 1
                continue
        rc, c = _run(label, env, paths, python)
        # pytest exit 5 means "no tests collected": a failure for us.
        if rc != 0:
            failed_runs += 1
        bad = c["failures"] + c["errors"]
        total["failed"] += bad
        total["skipped"] += c["skipped"]
        total["passed"] += c["tests"] - bad - c["skipped"]
        if rc != 0 and bad == 0:
            total["failed"] += 1  # a run that failed without a failed test
    print(
        f"suite: {total['passed']} passed, {total['failed']} failed, "
        f"{total['skipped']} skipped",
        flush=True,
    )
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
