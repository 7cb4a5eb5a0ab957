"""Entry point of the child processes started by `tests/_processes.py`."""

import importlib
import json
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    module_name, function_name = spec["target"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(spec["index"], *spec["args"])
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
