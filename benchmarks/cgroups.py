"""cgroup v1 helpers for benchmarks: pin a test-bed host (its sshd, and so every process it starts) to one core and
optionally cap its CPU time, as if it were a separate, slower machine.

    with HostCgroups("3fa9c1") as cg:
        cg.place("h1", sshd_pid, cpus="0")                      # h1: core 0, no cap
        cg.place("h2", sshd_pid, cpus="1", quota_us=50_000)     # h2: core 1, 50 ms per 100 ms period (half a core)
        ...
        cg.stats("h2")  # cpu.stat (nr_throttled, throttled_time ns) and cpuacct.usage (ns)

Per host and run, three cgroups named `mlxc-bench-<tag>-<host>` are made under /sys/fs/cgroup/{cpuset,cpu,cpuacct}
(and a fourth under /sys/fs/cgroup/memory with a `memory.limit_in_bytes` cap, when asked)
(cpuacct only where it is its own hierarchy, as on this machine; it just counts CPU time). `cpuset.cpus`/`cpuset.mems`
are set before any task joins (a cpuset without them refuses tasks); `cpu.cfs_period_us` is 100000,
`cpu.cfs_quota_us` the given quota or -1 (no cap), `cpu.shares` the given weight (default 1024). The pid is written
to each group's `cgroup.procs` (the whole thread group), then /proc/<pid>/cgroup is read back to prove it is there.
A process forked later (an SSH session, the ranks it starts) is born in its parent's cgroups; processes that
already exist elsewhere are not moved.

Removal (`close()`, also run at exit, idempotent): every process still in a group is moved back to the hierarchy's
root cgroup, then the directory is removed (v1 refuses to remove a cgroup with tasks; a task forked while we move
is retried a few times). `remove_stale()` removes leftover `mlxc-bench-*` groups of dead runs (no tasks).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "mlxc-bench-"
PERIOD_US = 100_000


class CgroupError(RuntimeError):
    """A cgroup could not be made, joined or removed; the message says which file and why."""


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc}") from exc


def _procs(group: Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def hierarchy_of(controller: str) -> Path | None:
    """The mount point of a v1 controller (None when it is not mounted on its own under /sys/fs/cgroup)."""
    path = CGROUP_ROOT / controller
    return path if (path / "tasks").exists() else None


def proc_cgroups(pid: int) -> dict[str, str]:
    """controller -> cgroup path of a process, from /proc/<pid>/cgroup (v1 lines `id:ctrl[,ctrl]:path`)."""
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def problems() -> list[str]:
    """Why cgroup v1 cpuset/cpu placement cannot work here (empty when it can)."""
    out = []
    if os.geteuid() != 0:
        out.append("must run as root to create cgroups")
    for controller in ("cpuset", "cpu"):
        if hierarchy_of(controller) is None:
            out.append(f"no cgroup v1 `{controller}` hierarchy at {CGROUP_ROOT / controller}")
    return out


@dataclass
class HostGroups:
    name: str
    pid: int
    cpus: str
    quota_us: int | None
    dirs: dict[str, Path] = field(default_factory=dict)  # controller -> cgroup dir


class HostCgroups:
    """Per-run cgroups for test-bed hosts; see the module docstring. Use as a context manager."""

    def __init__(self, tag: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", tag):
            raise CgroupError(f"bad cgroup tag {tag!r}")
        found = problems()
        if found:
            raise CgroupError("; ".join(found))
        self.tag = tag
        self.hosts: dict[str, HostGroups] = {}
        self._made: list[Path] = []  # every dir we created, in creation order
        self._closed = False
        atexit.register(self.close)

    def _mkdir(self, controller: str, name: str) -> Path:
        root = hierarchy_of(controller)
        assert root is not None
        path = root / f"{PREFIX}{self.tag}-{name}"
        try:
            path.mkdir()
        except OSError as exc:
            raise CgroupError(f"cannot create {path}: {exc}") from exc
        self._made.append(path)
        return path

    def create(self, name: str, *, cpus: str | None, quota_us: int | None = None, shares: int | None = None,
               mems: str | None = None, memory_bytes: int | None = None) -> HostGroups:
        """New (empty) groups for `name`: cpuset `cpus` (None: no cpuset group, the root's CPUs), CPU quota
        `quota_us` per 100 ms (None: uncapped), `cpu.shares` (None: the default 1024, the weight of each task of
        the root group), a memory group capped at `memory_bytes` (`memory.limit_in_bytes`; None: no memory
        group), and a cpuacct group where that hierarchy is separate. Raises CgroupError."""
        if self._closed:
            raise CgroupError("closed")
        if name in self.hosts:
            raise CgroupError(f"group {name!r} already exists")
        host = HostGroups(name, 0, cpus or "", quota_us)
        self.hosts[name] = host
        if cpus is not None:
            cpuset = self._mkdir("cpuset", name)
            host.dirs["cpuset"] = cpuset
            _write(cpuset / "cpuset.cpus", cpus)
            root_mems = (CGROUP_ROOT / "cpuset" / "cpuset.mems").read_text().strip()
            _write(cpuset / "cpuset.mems", mems if mems is not None else root_mems.split(",")[0].split("-")[0])
        cpu = self._mkdir("cpu", name)
        host.dirs["cpu"] = cpu
        _write(cpu / "cpu.cfs_period_us", str(PERIOD_US))
        _write(cpu / "cpu.cfs_quota_us", str(quota_us if quota_us is not None else -1))
        if shares is not None:
            _write(cpu / "cpu.shares", str(shares))
        if hierarchy_of("cpuacct") is not None and hierarchy_of("cpuacct") != hierarchy_of("cpu"):
            host.dirs["cpuacct"] = self._mkdir("cpuacct", name)
        if memory_bytes is not None:
            if hierarchy_of("memory") is None:
                raise CgroupError(f"no cgroup v1 `memory` hierarchy at {CGROUP_ROOT / 'memory'}")
            memory = self._mkdir("memory", name)
            host.dirs["memory"] = memory
            _write(memory / "memory.limit_in_bytes", str(memory_bytes))
        return host

    def attach(self, name: str, pid: int) -> None:
        """Move process `pid` (all its threads) into `name`'s groups and check /proc/<pid>/cgroup."""
        host = self.hosts[name]
        host.pid = pid
        for group in host.dirs.values():
            _write(group / "cgroup.procs", str(pid))
        where = proc_cgroups(pid)
        for controller, group in host.dirs.items():
            want = "/" + group.name
            if where.get(controller) != want:
                raise CgroupError(f"pid {pid} is in {controller}:{where.get(controller)}, expected {want}")

    def preexec(self, name: str) -> Callable[[], None]:
        """A `subprocess.Popen(preexec_fn=...)` that moves the child into `name`'s groups before it execs (so
        everything it starts is born there). Writing 0 to cgroup.procs means the writing process itself."""
        files = [str(group / "cgroup.procs") for group in self.hosts[name].dirs.values()]

        def join() -> None:
            for path in files:
                with open(path, "w") as fh:
                    fh.write("0")

        return join

    def place(self, name: str, pid: int, *, cpus: str | None, quota_us: int | None = None, shares: int | None = None,
              mems: str | None = None, memory_bytes: int | None = None) -> HostGroups:
        """`create` + `attach`: put process `pid` (a host's sshd) into new groups."""
        host = self.create(name, cpus=cpus, quota_us=quota_us, shares=shares, mems=mems, memory_bytes=memory_bytes)
        self.attach(name, pid)
        return host

    def verify(self, name: str, pid: int | None = None) -> dict[str, str]:
        """The cgroups of `pid` (default: the host's sshd) for our controllers; raises if any is not the host's."""
        host = self.hosts[name]
        where = proc_cgroups(pid or host.pid)
        got = {c: where.get(c, "?") for c in host.dirs}
        bad = {c: p for c, p in got.items() if p != "/" + host.dirs[c].name}
        if bad:
            raise CgroupError(f"pid {pid or host.pid} of {name} is not in its cgroups: {bad}")
        allowed = Path(f"/proc/{pid or host.pid}/status").read_text()
        m = re.search(r"^Cpus_allowed_list:\s*(\S+)", allowed, re.M)
        got["cpus_allowed"] = m[1] if m else "?"
        return got

    def stats(self, name: str) -> dict[str, int]:
        """Counters of a host's groups: nr_periods, nr_throttled, throttled_time (ns) from cpu.stat and
        usage_ns (cpuacct.usage) when there is a cpuacct group."""
        host = self.hosts[name]
        out: dict[str, int] = {}
        for line in (host.dirs["cpu"] / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            out[key] = int(value)
        if "cpuacct" in host.dirs:
            out["usage_ns"] = int((host.dirs["cpuacct"] / "cpuacct.usage").read_text())
        return out

    def members(self, name: str) -> list[int]:
        host = self.hosts[name]
        return _procs(host.dirs.get("cpuset") or host.dirs["cpu"])

    def close(self) -> None:
        """Move every task back to its hierarchy's root and remove our groups (idempotent). Raises CgroupError
        listing what could not be removed."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        left = [str(p) for p in reversed(self._made) if not _remove(p)]
        self._made.clear()
        if left:
            raise CgroupError(f"could not remove cgroups: {', '.join(left)}")

    def __enter__(self) -> HostCgroups:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _remove(group: Path, attempts: int = 50) -> bool:
    """Empty `group` into its hierarchy's root and rmdir it; True when it is gone."""
    root = group.parent
    for _ in range(attempts):
        if not group.exists():
            return True
        for pid in _procs(group):
            with contextlib.suppress(OSError):  # gone meanwhile, or a kernel thread: retried below
                (root / "cgroup.procs").write_text(str(pid))
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.02)
    return not group.exists()


def remove_stale() -> list[str]:
    """Remove `mlxc-bench-*` cgroups left by dead runs (those holding no task); returns the paths removed."""
    removed = []
    for controller in ("cpuset", "cpu", "cpuacct", "memory"):
        root = hierarchy_of(controller)
        if root is None:
            continue
        for group in sorted(root.glob(PREFIX + "*")):
            if group.is_dir() and not _procs(group) and _remove(group, attempts=1):
                removed.append(str(group))
    return removed
