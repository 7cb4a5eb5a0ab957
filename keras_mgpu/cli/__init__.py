"""The `keras-mgpu` command: `demo`, `info` and `report`.

- `keras-mgpu demo` trains a small CNN on scikit-learn's digits under
  `MirroredStrategy` (the GPUs present, or logical CPU devices) with every
  keras_mgpu component on, prints a summary table and writes a PNG report;
  `--model-parallel` splits the CNN across the devices instead.
- `keras-mgpu info` prints versions, devices, GPUs (through NVML) and which
  strategies work here.
- `keras-mgpu report RUN.csv` draws the PNG report from a `CSVLogger` file.

With `KERAS_BACKEND=jax`, `demo` trains under `keras.distribution.DataParallel`
across the GPUs or CPU devices JAX finds (components that refuse JAX are
skipped and named) and `info` prints the JAX version, its devices and which
components run on JAX; neither imports TensorFlow.

TensorFlow is imported only once the options are parsed and checked, so
`--help` and bad options answer without it, and the demo can set up logical
devices before TensorFlow's runtime starts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from keras_mgpu.cli import demo, info, report
from keras_mgpu.cli._common import PROG, CommandError

__all__ = ["CommandError", "build_parser", "main"]

_COMMANDS = {"demo": demo, "info": info, "report": report}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-mgpu` (all three subcommands)."""
    from keras_mgpu import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "keras_mgpu: drop-in Keras components for training on many "
            "devices. Start with `keras-mgpu demo`."
        ),
    )
    parser.add_argument(
        "--version", action="version", version=f"{PROG} {__version__}"
    )
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show TensorFlow's own start-up logs and warnings",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in _COMMANDS.values():
        command = module.add_parser(sub, [verbose])
        command.set_defaults(command_parser=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `keras-mgpu` with `argv` (default: the command line).

    Returns the exit code: 0 on success, 1 when the command failed (with a
    one-line message on stderr), 2 for bad options (argparse's usage error).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            demo.check_args(args.command_parser, args)
        return _COMMANDS[args.command].run(args)
    except CommandError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
