"""What machine a benchmark ran on, for its report: one helper for every benchmark, so their tables agree.

    from benchmarks.machine import machine_info
    info = machine_info(("mlx", "asyncssh"), extra={"openssh": ...})

Linux-first (the benchmarks run on the test bed's Linux host): the CPU model comes from /proc/cpuinfo, falling back
to `platform.processor()` elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def dist_version(dist: str, missing: str = "not installed") -> str:
    """The installed version of distribution `dist`, or `missing`."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return missing


def cpu_model(unknown: str | None = None) -> str:
    """The CPU's model name (/proc/cpuinfo); else `unknown`, or `platform.processor()` (or "?") when not given."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return unknown if unknown is not None else (platform.processor() or "?")


def machine_info(packages: Sequence[str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """CPUs, memory, kernel and python, then each of `packages`' versions, then `extra` (in order), then the load
    average at the time of the call (the machine is shared: a busy one explains slow numbers)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info = {
        "cpus": f"{os.cpu_count()} x {cpu_model()}",
        "memory": f"{mem / 2**30:.1f} GiB",
        "kernel": platform.release(),
        "python": f"{platform.python_version()} ({sys.executable})",
    }
    info.update({name: dist_version(name) for name in packages})
    info.update(extra or {})
    info["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return info
