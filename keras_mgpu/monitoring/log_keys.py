"""The log-key scheme of the monitors, in one place.

Every key is `<group>/<worker><name>`:

- `group`: `mem` (`MemoryMonitor`), `gpu` (`GPULoadMonitor` through NVML)
  or `cpu` (`GPULoadMonitor` without NVML or GPUs).
- `worker`: empty on a single worker; `w<rank>_` when the cluster has
  several workers (or when asked), so logs of several workers can be merged
  (the rank: the chief first, then the workers); `evaluator_` on an
  `evaluator` task, which is no collective member and logs alone.
- `name`: `<device>_<figure>[_<statistic>]_<unit>`, e.g. `gpu0_peak_mb`,
  `gpu1_util_mean_pct`, `host_rss_mb`; figures about all devices have no
  device part (`util_spread_pct`).

Keys hold only `[a-z0-9_/]`, so CSVLogger headers and TensorBoard tags
need no quoting, and TensorBoard groups them by `group`. A run's keys are
fixed at `on_train_begin` and identical at every epoch (CSVLogger writes
its header from the first epoch): a figure a device does not report in an
epoch is NaN, never missing.
"""

from __future__ import annotations

import re

from keras_mgpu.distribute import worker_info

_KEY = re.compile(r"^[a-z]+/[a-z0-9_]+$")


def worker_prefix(enabled: bool | None, strategy=None) -> str:
    """`w<rank>_` (the chief is w0, then the workers), `evaluator_` on an
    evaluator task of a cluster, or "" on a single worker.

    `enabled=None` adds it only when the cluster has several workers.
    """
    info = worker_info(strategy)
    if enabled is None:
        enabled = info["num_workers"] > 1
    if not enabled:
        return ""
    if info["rank"] is None:
        # Not a collective member (an `evaluator`): its own name, never a
        # member's row.
        return re.sub(r"[^a-z0-9]", "", str(info["task_type"]).lower()) + "_"
    # The rank, not the task index: chief:0 and worker:0 are two tasks.
    return f"w{info['rank']}_"


def make_key(group: str, name: str, prefix: str = "") -> str:
    """Build and check one log key."""
    key = f"{group}/{prefix}{name}"
    if not _KEY.match(key):  # a bug in a caller, never user input
        raise ValueError(f"Invalid monitor log key {key!r}")
    return key
