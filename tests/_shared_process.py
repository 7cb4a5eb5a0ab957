"""Several example scripts (or `python -m keras_mgpu` commands) run one after
the other from ONE Python process that imported TensorFlow, Keras and
keras_mgpu once, for tests/test_examples.py and tests/test_cli.py.

Each script runs in a child forked from that process before TensorFlow's
runtime starts (importing TensorFlow does not start it): a fresh runtime of
its own (devices still to configure, its own collective-op keys: two
MirroredStrategy runs in one runtime collide on them), started as a user
starts it (`__main__`, its own `sys.argv` and working directory, its stdout
and stderr at the file-descriptor level, so that what its own child
processes print is captured too). Only the imports (Python, TensorFlow,
Keras: ~5 s of CPU per process on the 2-core CI machine) are shared.

Run as `python tests/_shared_process.py SPEC.json`; SPEC is a list of
`{"name", "argv", "cwd"}` (argv[0] a script path, or "-m" and a module) and
each one's exit code, stdout and stderr land in `<name>.json` beside SPEC.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    """Runs each `name: (argv, cwd)` of `runs` in order in one fresh process
    (environment `env` on top of this one's) and returns each one's
    `Result`; a script that never ran (the process died or timed out
    before it) gets exit code -1 and the process's own output."""
    folder = str(folder)
    spec = os.path.join(folder, "spec.json")
    with open(spec, "w") as f:
        items = [
            {"name": n, "argv": argv, "cwd": str(cwd)}
            for n, (argv, cwd) in runs.items()
        ]
        json.dump(items, f)
    try:
        process = subprocess.run(
            [sys.executable, os.path.abspath(__file__), spec],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        whole = (process.stdout, process.stderr)
    except subprocess.TimeoutExpired as exc:
        whole = (f"timed out after {timeout} s: {exc.stdout}", "")
    results = {}
    for name in runs:
        path = os.path.join(folder, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[name] = Result(**json.load(f))
        else:
            results[name] = Result(-1, *whole)
    return results


def _run_one(argv: list, cwd: str) -> int:
    import runpy

    previous = os.getcwd()
    os.chdir(cwd)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        os.chdir(previous)


def _main(spec_path: str) -> None:
    folder = os.path.dirname(spec_path)
    with open(spec_path) as f:
        spec = json.load(f)
    # The shared start-up; none of these starts TensorFlow's runtime.
    import keras  # noqa: F401
    import tensorflow  # noqa: F401

    import keras_mgpu  # noqa: F401

    for item in spec:
        out_path = os.path.join(folder, f"{item['name']}.stdout")
        err_path = os.path.join(folder, f"{item['name']}.stderr")
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: one script, then exit without cleanup
            code = 1
            try:
                with open(out_path, "w") as out, open(err_path, "w") as err:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    code = _run_one(item["argv"], item["cwd"])
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code & 0xFF)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        with open(out_path) as out, open(err_path) as err:
            result = {
                "returncode": code,
                "stdout": out.read(),
                "stderr": err.read(),
            }
        with open(os.path.join(folder, f"{item['name']}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    sys.path.insert(0, REPO_ROOT)
    _main(sys.argv[1])
