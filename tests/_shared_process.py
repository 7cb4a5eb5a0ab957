"""Example scripts (or `python -m keras_mgpu` commands) run one after the
other, each in a fresh Python process, for tests/test_examples.py and
tests/test_cli.py's module fixtures: a module runs the scripts its selected
tests need once and the tests read the results.

Each script starts as a user starts it (`__main__`, its own `sys.argv` and
working directory, its stdout and stderr captured). One process per script:
forking one pre-imported process would save the ~5 s of CPU its imports
take, but importing Keras starts threads (jaxlib's jemalloc and two more),
and a fork with threads running may deadlock on a lock one of them held:
a test must not depend on who wins that race.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Result:
    """One script's run: exit code, stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str

    def check(self, name: str) -> str:
        """The stdout, after asserting the script exited with 0."""
        assert self.returncode == 0, (
            f"{name} exited with {self.returncode}\n--- stdout ---\n"
            f"{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"
        )
        return self.stdout


def run_shared(
    runs: dict[str, tuple[list, str]], folder, env: dict, timeout: float
) -> dict[str, Result]:
    """Runs each `name: (argv, cwd)` of `runs` in order, each in a fresh
    process (environment `env` on top of this one's; argv[0] a script path,
    or "-m" and a module), and returns each one's `Result`; a script still
    running when `timeout` seconds have passed since the first started
    is stopped (exit code -1), and those after it do not run (-1)."""
    del folder  # each run's output comes back through its pipes
    deadline = time.monotonic() + timeout
    results = {}
    for name, (argv, cwd) in runs.items():
        left = deadline - time.monotonic()
        if left <= 0:
            results[name] = Result(-1, "", f"not run: {timeout} s spent")
            continue
        command = (
            [sys.executable, *argv]
            if argv[0] == "-m"
            else [
                sys.executable,
                *argv,
            ]
        )
        try:
            process = subprocess.run(
                command,
                cwd=cwd,
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=left,
            )
            results[name] = Result(
                process.returncode, process.stdout, process.stderr
            )
        except subprocess.TimeoutExpired as exc:
            results[name] = Result(
                -1,
                _text(exc.stdout),
                f"timed out after {timeout} s\n{_text(exc.stderr)}",
            )
    return results


def _text(output) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
