"""A rank's share of its machine's CPUs, where ranks share a machine and compute on its CPU (Linux).

Two ranks on one machine left to the scheduler meet on one core now and then: in six interleaved pairs of demo
launches on a quiet 2-core VM they ran 2,396-2,799 real tokens/s, and 2,654-2,990 with a core each (1.16x the
median; docs/benchmarks.md). So the coordinator gives each such rank a share
(`run.json` `cpu_shares`: rank -> [index, count], `coordinator/planning/colocate.cpu_shares`), and the rank takes
the index-th of `count` equal slices of the CPUs it may use (its cgroup's, as `sched_getaffinity` says), for every
thread it has. Where the machine has fewer CPUs than shares, or the OS has no affinity call (macOS), nothing is
pinned.
"""

from __future__ import annotations

import contextlib
import os


def share_of(allowed: list[int], index: int, count: int) -> tuple[int, ...] | None:
    """The index-th of `count` equal slices of `allowed` (sorted; the remainder left to nobody), or None when there
    are fewer CPUs than slices. Pure."""
    cpus = sorted(allowed)
    size = len(cpus) // count if count > 0 else 0
    if size == 0 or not 0 <= index < count:
        return None
    return tuple(cpus[index * size:(index + 1) * size])


def take_share(index: int, count: int) -> tuple[int, ...] | None:
    """Pin this process (all its threads, those MLX has started included) to its share; returns the CPUs, or None
    where nothing was pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    mine = share_of(list(os.sched_getaffinity(0)), index, count)
    if mine is None:
        return None
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, mine)
    return mine


def describe_share(index: int, count: int, cpus: tuple[int, ...] | None) -> str:
    """What a process says of its share (`take_share`'s answer `cpus`), the run's ranks and the benches alike."""
    return (f"share {index + 1} of {count} of this machine's CPUs: "
            + (f"pinned to CPU {', '.join(map(str, cpus))}" if cpus else "not pinned (too few CPUs)"))
