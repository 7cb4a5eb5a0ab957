"""Entry point of the child processes started by `tests/_processes.py`."""

import importlib
import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    module_name, function_name = spec["target"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(spec["index"], *spec["args"])
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)
    if _task_type() == "evaluator":
        # An evaluator is no collective member (no peer waits on it), and
        # its result is written: skip the interpreter's teardown. Once in
        # CI (oneDNN off, loaded host) an evaluator died there with SIGSEGV
        # and no Python frame; PYTHONFAULTHANDLER is on to show where if a
        # crash happens before this point.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _task_type() -> str | None:
    config = os.environ.get("TF_CONFIG")
    return json.loads(config).get("task", {}).get("type") if config else None


if __name__ == "__main__":
    main()
