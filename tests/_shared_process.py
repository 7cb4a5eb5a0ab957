"""Example scripts (or `python -m keras_mgpu` commands) run one after the
other in one fresh Python process, for tests/test_examples.py and
tests/test_cli.py's module fixtures: a module runs the scripts its selected
tests need once and the tests read the results.

Each script starts as a user starts it, short of a process of its own: as
`__main__` (runpy), with its own `sys.argv`, working directory and a fresh
copy of the environment given, its stdout and stderr captured at file
descriptors 1 and 2 (native messages included); Keras's session is cleared
between scripts. What the scripts share is what a process starts once:
the imports (TensorFlow and Keras cost ~6 CPU-s a process, the scripts
themselves a few each) and TensorFlow's runtime, whose logical devices
each script asks for alike (2 CPU devices: TensorFlow accepts the same
configuration again once started) and which reads `env` (oneDNN) when it
starts. A script that measures allocator peaks runs first (the
allocator's figures drift with what ran before in a process).

The process is started fresh, not forked from a pre-imported one: importing
Keras starts threads (jaxlib's jemalloc and two more), and a fork with
threads running may deadlock on a lock one of them held.
"""

from __future__ import annotations

import json
import os
import signal
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
    """Runs each `name: (argv, cwd)` of `runs` in order in one fresh
    process (environment `env` on top of this one's; argv[0] a script
    path, or "-m" and a module), its files in `folder`, and returns each
    one's `Result`. When `timeout` seconds have passed since the process
    started, it is killed: the script then running gets exit code -1, and
    those after it did not run (-1)."""
    folder = str(folder)
    spec = os.path.join(folder, "runs.json")
    names = list(runs)
    with open(spec, "w") as f:
        json.dump([[n, list(runs[n][0]), str(runs[n][1])] for n in names], f)
    with open(os.path.join(folder, "process.log"), "w+") as log:
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), spec, str(os.getpid())],
            cwd=folder,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own group: on a time-out, whatever a script started goes
            # with it.
            start_new_session=True,
        )
        try:
            process.wait(timeout=timeout)
            ended = f"the process exited with {process.returncode}"
        except subprocess.TimeoutExpired:
            ended = f"timed out after {timeout} s"
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.seek(0)
        ended += "\n" + log.read()[-3000:]
    results = {}
    for name in names:
        stdout, stderr = (
            _read(os.path.join(folder, f"{name}.{stream}"))
            for stream in ("stdout", "stderr")
        )
        code = _read(os.path.join(folder, f"{name}.rc"))
        if code:
            results[name] = Result(int(code), stdout, stderr)
        elif stdout is not None:  # started, never ended
            results[name] = Result(-1, stdout, f"{ended}\n{stderr}")
        else:
            results[name] = Result(-1, "", f"not run: {ended}")
    return results


def _read(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        return f.read()


# ----------------------------------------------------------------------
# The shared process: `python _shared_process.py runs.json`
# ----------------------------------------------------------------------
def _serve(spec: str) -> None:
    folder = os.path.dirname(spec)
    with open(spec) as f:
        runs = json.load(f)
    environ = dict(os.environ)
    for name, argv, cwd in runs:
        paths = [
            os.path.join(folder, f"{name}.{stream}")
            for stream in ("stdout", "stderr")
        ]
        sys.stdout.flush()
        sys.stderr.flush()
        with open(paths[0], "w") as out, open(paths[1], "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = _run_one(argv, cwd)
            sys.stdout.flush()
            sys.stderr.flush()
        # Written last: a script without its .rc file never ended.
        with open(os.path.join(folder, f"{name}.rc.tmp"), "w") as f:
            f.write(str(code))
        os.replace(
            os.path.join(folder, f"{name}.rc.tmp"),
            os.path.join(folder, f"{name}.rc"),
        )
        os.environ.clear()
        os.environ.update(environ)
        if "keras" in sys.modules:
            sys.modules["keras"].backend.clear_session()
        _fresh_collective_keys()


def _fresh_collective_keys() -> None:
    """A key range of its own for the next script's MirroredStrategy.

    TensorFlow's runtime remembers the collective groups and instances a
    strategy's all-reduces used, by key; every new MirroredStrategy
    numbers its keys from its class's `_collective_key_base`, so a second
    script's all-reduces would join the first one's groups ("Shape
    mismatch in the collective instance"). TensorFlow's own tests move the
    base on between strategies (`strategy_combinations`, `+= 100000`):
    the scripts still run the default cross-device ops a user gets."""
    if "tensorflow" not in sys.modules:
        return
    from tensorflow.python.distribute import mirrored_strategy

    for strategy in (
        mirrored_strategy.MirroredStrategy,
        mirrored_strategy.MirroredStrategyV1,
    ):
        strategy._collective_key_base += 100000


def _run_one(argv: list, cwd: str) -> int:
    """Runs one script or module as `__main__`; its exit code."""
    import runpy
    import traceback

    saved = sys.argv, list(sys.path), os.getcwd()
    try:
        os.chdir(cwd)
        if argv[0] == "-m":
            sys.argv = argv[1:]  # runpy puts the module's path first
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.chdir(saved[2])


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the test process that started it dies
    (Linux `prctl(PR_SET_PDEATHSIG)`), so none is left running."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before prctl
        os._exit(1)


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[2]))
    # Not tests/ (this file's folder) on the path: a script sees the path
    # its own start would give it.
    del sys.path[0]
    _serve(sys.argv[1])
