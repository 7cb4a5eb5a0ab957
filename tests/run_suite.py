"""Run the whole test suite: the Keras 3 flavour, then the tf_keras flavour.

The Keras flavour is fixed per process, so the tf_keras tests
(`tests/legacy`) run in a pytest process of their own with
`TF_USE_LEGACY_KERAS=1`. Each run spreads its test files over two
pytest-xdist processes (`--dist loadfile`: a module's tests, and the
multi-worker cluster its module fixture starts, stay in one process):
the tests are mostly single-threaded Python, so on two cores two processes
take about two thirds of the time (Keras 3 tests: 29 min serial, 19 min).
Extra arguments are passed to both pytest runs (`-n 0` runs everything in
one process; KERAS_MGPU_TEST_WORKERS sets the number of processes).
Prints one closing line with the totals and exits non-zero if either run
failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
WORKERS = os.environ.get("KERAS_MGPU_TEST_WORKERS", "2")


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


def _run(label: str, extra_env: dict[str, str], paths: list[str]) -> tuple:
    junit = os.path.join(tempfile.mkdtemp(), f"{label}.xml")
    env = {**os.environ, **extra_env}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *paths,
        "-n",
        WORKERS,
        "--dist",
        "loadfile",
        f"--junitxml={junit}",
        *sys.argv[1:],
    ]
    print(f"== {label}: {' '.join(cmd)}", flush=True)
    rc = subprocess.call(cmd, cwd=REPO_ROOT, env=env)
    return rc, _counts(junit)


def main() -> int:
    runs = [
        ("keras3", {"TF_USE_LEGACY_KERAS": "0"}, ["tests"]),
        ("tf_keras", {"TF_USE_LEGACY_KERAS": "1"}, ["tests/legacy"]),
    ]
    failed_runs = 0
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for label, env, paths in runs:
        rc, c = _run(label, env, paths)
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
