"""Run a benchmark case in a Python process of its own and read the JSON
line it prints last (memory peaks are per process: each case needs a fresh
one). Shared by the benchmark scripts; not a benchmark itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_child(
    script: str,
    arguments: list[str],
    *,
    env: dict | None = None,
    timeout: float = 600,
) -> dict:
    """`python script *arguments` with `env` added to this environment:
    the last line of its output that starts with "{", parsed, or
    `{"error": ...}` (the end of its standard error) when it failed or
    printed none."""
    try:
        out = subprocess.run(
            [sys.executable, os.path.abspath(script), *arguments],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, **(env or {})},
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": out.stderr[-2000:] or "no output"}
    return json.loads(lines[-1])


def options(args: object, names: tuple[str, ...]) -> list[str]:
    """`--name value` for each of `names` read from `args` (argparse's
    namespace; underscores become dashes)."""
    argv: list[str] = []
    for name in names:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv
