"""The node probe: ONE round trip per node gathers every raw output the checks need.

`build_probe` makes a POSIX shell script (run as `sh -c SCRIPT`) that runs the OS commands, each fenced by a
random per-run nonce so that nothing a node prints can forge a section boundary, and finally runs the node's
configured python on `worker/probe.py`, whose source travels on stdin (the node needs nothing of ours
installed). `parse_probe_output` splits the answer back into sections. Both are pure.

The command list is documented in docs/probe.md; macOS facts come only from these commands (never from
Python's `platform`), so a recorded node profile (`coordinator facts --record`) can answer them again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
import shlex
from dataclasses import dataclass
from importlib import resources
from typing import Any

from coordinator.facts.linux import NVIDIA_SMI_FIELDS

# (section, argv) for every Mac; the section names are the file names of a recorded profile.
MACOS_COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sw_vers", ("sw_vers",)),
    ("sysctl", ("sysctl", "hw", "machdep.cpu.brand_string", "kern.memorystatus_vm_pressure_level")),
    (
        "system_profiler",
        ("system_profiler", "SPHardwareDataType", "SPDisplaysDataType", "SPThunderboltDataType", "-json"),
    ),
    ("networksetup", ("networksetup", "-listallhardwareports")),
    ("ifconfig", ("ifconfig",)),
    ("rdma_ctl", ("rdma_ctl", "status")),
    ("ibv_devices", ("ibv_devices",)),
    ("ibv_devinfo", ("ibv_devinfo",)),
    ("vm_stat", ("vm_stat",)),
    ("memory_pressure", ("memory_pressure",)),
    ("pmset", ("pmset", "-g")),
    ("pmset_batt", ("pmset", "-g", "batt")),
    ("ioreg", ("ioreg", "-r", "-d", "1", "-w", "0", "-c", "IOAccelerator")),
)

# One line per interface of /sys/class/net: what kind of link it is, for `nettest` (the Linux counterpart of
# networksetup + system_profiler). Shell builtins only (read, cd, test, printf: no process per file), and errors
# silenced: an unreadable file is an empty field (e.g. `speed` raises EINVAL on a down or virtual interface),
# which the parser reads as "not known". `cd -P` gives the real path (devices/virtual/net/... for veth, bridges).
SYS_CLASS_NET = r"""exec 2>/dev/null
for d in /sys/class/net/*; do
  [ -r "$d/type" ] || continue
  t=; s=; o=; dt=; dr=; p=; l=; dv=0; w=0
  read -r t < "$d/type"
  read -r s < "$d/speed"
  read -r o < "$d/operstate"
  [ -e "$d/device" ] && dv=1
  [ -d "$d/wireless" ] && w=1
  cd -P "$d" && p=$PWD
  while IFS== read -r k v; do [ "$k" = DEVTYPE ] && dt=$v; done < "$d/uevent"
  [ -r "$d/device/uevent" ] && while IFS== read -r k v; do [ "$k" = DRIVER ] && dr=$v; done < "$d/device/uevent"
  for x in "$d"/lower_*; do [ -e "$x" ] && l=$l${l:+,}${x##*/lower_}; done
  printf '%s type=%s speed=%s operstate=%s device=%s wireless=%s devtype=%s driver=%s lower=%s path=%s\n' \
    "${d##*/}" "$t" "$s" "$o" "$dv" "$w" "$dt" "$dr" "$l" "$p"
done
exit 0"""

# The memory limit of the probe's own cgroup and of each ancestor (a rank started over SSH inherits the session's
# cgroup): one `v1|v2 PATH VALUE` line per level, v1 from the memory controller's `memory.limit_in_bytes`, v2 from
# the unified hierarchy's `memory.max` (a hybrid host's `0::` line has no memory.max there: nothing printed).
# Shell builtins only; a level that cannot be read prints nothing, and the section always exits 0 (no line: no
# limit known). `parse_cgroup_memory` takes the lowest.
CGROUP_MEMORY = r"""exec 2>/dev/null
while IFS=: read -r id ctl p; do
  case ",$ctl," in
    *,memory,*) v=v1 r=/sys/fs/cgroup/memory f=memory.limit_in_bytes ;;
    ,,) [ "$id" = 0 ] || continue; v=v2 r=/sys/fs/cgroup f=memory.max ;;
    *) continue ;;
  esac
  while :; do
    x=; read -r x < "$r$p/$f" && printf '%s %s %s\n' "$v" "${p:-/}" "$x"
    { [ -z "$p" ] || [ "$p" = / ]; } && break
    p=${p%/*}
  done
done < /proc/self/cgroup
:"""

LINUX_COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("os_release", ("cat", "/etc/os-release")),
    ("cpuinfo", ("grep", "-m1", "-i", "^model name", "/proc/cpuinfo")),
    ("meminfo", ("cat", "/proc/meminfo")),
    ("nproc", ("nproc",)),
    ("loadavg", ("cat", "/proc/loadavg")),
    ("ip_addr", ("ip", "-o", "-4", "addr", "show")),
    ("infiniband", ("ls", "-1", "/sys/class/infiniband")),
    ("sys_class_net", ("sh", "-c", SYS_CLASS_NET)),
    ("cgroup_memory", ("sh", "-c", CGROUP_MEMORY)),
)

# One row per NVIDIA GPU (coordinator.facts.linux.NVIDIA_SMI_FIELDS, parse_nvidia_smi). Run only where nvidia-smi
# exists: a node without it simply has no GPU facts. `compute_cap` needs driver 510+; mlx's CUDA backend needs a
# CUDA 12 driver (525+) anyway, so an older driver failing this query is a node mlx cannot use on the GPU.
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS), "--format=csv,noheader,nounits")

# Sections whose absence is normal on a node (a command that only exists on some machines).
# `sys_class_net` only informs nettest's link kinds: without it a link is `unknown`, which no check fails on.
# `cgroup_memory` always exits 0; optional so that a recording made before it existed still builds.
OPTIONAL_SECTIONS = frozenset({"nvidia_smi", "infiniband", "cpuinfo", "sys_class_net", "cgroup_memory"})


@dataclass(frozen=True)
class Section:
    name: str
    text: str
    rc: int

    @property
    def ok(self) -> bool:
        return self.rc == 0


@dataclass(frozen=True)
class Probe:
    """A ready-to-run probe: `argv` to execute on the node with `stdin` as its standard input."""

    argv: tuple[str, ...]
    stdin: str
    nonce: str


# How the node's python runs the worker's source that arrives on stdin: `python -c BOOTSTRAP KEY JSON`.
# Not `python -`: CPython reads a script from a pipe through its line-by-line file tokenizer (~10 ms more
# than compiling one string). And not compiled on every run either: compiling the ~900-line source costs
# ~8 ms, plus the garbage it leaves, on every node at every preflight. The compiled code is kept in the node
# user's cache under KEY (a digest of the source, so a new coordinator version never runs stale code) and the
# interpreter's exact version (bytecode is only valid for the version that wrote it). A cache that is missing,
# corrupt or unwritable only means compiling, never a failure. The source always travels (one round trip: the
# coordinator cannot know beforehand whether a node has it). The worker sees sys.argv[1:] == [JSON].
BOOTSTRAP = """\
import marshal, os, sys
source = sys.stdin.buffer.read()
base = os.environ.get("XDG_CACHE_HOME", "")
if not os.path.isabs(base):
    base = os.path.expanduser("~/.cache")
path = os.path.join(base, "mlx-coordinator", "probe-%s-%s-%x.bin"
                    % (sys.argv.pop(1), sys.implementation.cache_tag, sys.hexversion))
try:
    with open(path, "rb") as f:
        code = marshal.loads(f.read())
    if not hasattr(code, "co_code"):
        raise ValueError("not a code object")
except (OSError, ValueError, EOFError, TypeError):
    code = compile(source, "probe.py", "exec")
    tmp = "%s.%d" % (path, os.getpid())
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(marshal.dumps(code))
        os.replace(tmp, path)
    except OSError:
        pass
exec(code)
"""


@functools.lru_cache(maxsize=4)
def source_key(source: str) -> str:
    """The bytecode cache key of a probe source (see BOOTSTRAP)."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:20]


def python_args(source: str) -> tuple[str, ...]:
    """What follows the node's python to run `source` (sent on stdin); the JSON argument comes after."""
    return ("-c", BOOTSTRAP, source_key(source))


def shell_path(path: str) -> str:
    """Quote a node path for sh, keeping a leading `~/` meaning the node user's home."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def pythonpath_prepend(dir_sh: str) -> str:
    """sh code putting `dir_sh` (already shell syntax: quoted, or `"$1"`) FIRST on PYTHONPATH and keeping what the
    environment has after it (the inventory's `env`, else the node's own), as every worker process must see it:
    the rank script (launchfiles.build_rank_script) and `build_worker_argv` (calibration) share it, so the bench
    imports what training imports."""
    return f"PYTHONPATH={dir_sh}${{PYTHONPATH:+:$PYTHONPATH}}; export PYTHONPATH"


def worker_source() -> str:
    return resources.files("worker").joinpath("probe.py").read_text(encoding="utf-8")


def _command(argv: tuple[str, ...]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def build_probe(
    *,
    python: str,
    workdir: str,
    worker_args: dict[str, Any],
    nonce: str | None = None,
    source: str | None = None,
) -> Probe:
    """The probe for one node. `worker_args` is passed to worker/probe.py as one JSON argument."""
    n = nonce or secrets.token_hex(8)
    text = source if source is not None else worker_source()
    lines = [
        f"N={n}",
        # Every command reads /dev/null: stdin carries the worker's source and must reach python intact.
        'sec() { s=$1; shift; printf "%s BEGIN %s\\n" "$N" "$s"; "$@" </dev/null 2>&1; rc=$?; '
        'printf "\\n%s END %s %s\\n" "$N" "$s" "$rc"; }',
        "probe() {",
        "sec uname uname -srm",
        'case "$(uname -s 2>/dev/null)" in',
        "Darwin*)",  # a recorded profile may answer every uname call with its full line
        *(f"  sec {name} {_command(argv)}" for name, argv in MACOS_COMMANDS),
        "  ;;",
        "*)",
        *(f"  sec {name} {_command(argv)}" for name, argv in LINUX_COMMANDS),
        f"  if command -v nvidia-smi >/dev/null 2>&1; then sec nvidia_smi {_command(NVIDIA_SMI)}; fi",
        "  ;;",
        "esac",
        # df of the workdir, or of its nearest existing parent (the workdir may not exist yet).
        f"d={shell_path(workdir)}",
        'while [ ! -d "$d" ]; do d=$(dirname "$d"); done',
        'sec df df -k "$d"',
        "sec env env",
        f"PY={shell_path(python)}",
        'printf "%s BEGIN worker\\n" "$N"',
        'if command -v "$PY" >/dev/null 2>&1; then "$PY" ' + _command(python_args(text)) + " "
        + shlex.quote(json.dumps(worker_args, sort_keys=True))
        + '; rc=$?; else echo "python interpreter not found: $PY"; rc=127; fi',
        'printf "\\n%s END worker %s\\n" "$N" "$rc"',
        "}",
        # The whole answer is collected and written at once: written as it comes, every printf and command is
        # a pipe write that sshd sends as an SSH packet of its own (~50 per node), and each costs the
        # coordinator a decrypt and a delivery in Python. The trailing `.` keeps trailing newlines. (A function,
        # so that the `case` is not parsed inside `$(...)`: macOS's /bin/sh is bash 3.2, which cannot.)
        "A=$(probe; echo .)",
        'printf "%s" "${A%.}"',
    ]
    script = "\n".join(lines) + "\n"
    return Probe(argv=("sh", "-c", script), stdin=text, nonce=n)


def parse_probe_output(stdout: str, nonce: str) -> dict[str, Section]:
    """Split the probe's stdout into sections. Text outside any section is ignored (login banners)."""
    pattern = re.compile(
        rf"{re.escape(nonce)} BEGIN (?P<name>[a-z_]+)\n(?P<text>.*?)\n{re.escape(nonce)} END (?P=name) (?P<rc>\d+)\n",
        re.DOTALL,
    )
    sections: dict[str, Section] = {}
    for match in pattern.finditer(stdout):
        sections[match["name"]] = Section(match["name"], match["text"], int(match["rc"]))
    return sections
