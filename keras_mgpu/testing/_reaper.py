"""Clean up after `run_workers` when its caller dies without doing it.

Run as a script (`python _reaper.py WORKDIR`), never imported: it must start
in milliseconds and hold nothing but a pipe. It reads process-group ids from
stdin ("+PGID" when a worker starts, "-PGID" once the caller reaped it).
When stdin closes (the caller returned, or was killed by SIGTERM, SIGKILL,
or `os._exit` from pytest-timeout's thread), it SIGKILLs every group still
listed and deletes WORKDIR. Its own session keeps it out of the caller's
process group, so a signal to that group does not take it along first.
"""

import os
import shutil
import signal
import sys


def main() -> None:
    workdir = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    groups = set()
    for line in sys.stdin:
        line = line.strip()
        if line[:1] == "+":
            groups.add(int(line[1:]))
        elif line[:1] == "-":
            groups.discard(int(line[1:]))
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
