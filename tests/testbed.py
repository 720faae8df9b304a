"""A test bed of SSH "hosts" made of Linux network namespaces, for integration tests of the real CLI over real SSH.

Each host is:

- a network namespace `<prefix><run>-<index>` (e.g. `mx3fa9c1-2`) joined by a veth pair (`<prefix><run>v<index>`
  in the root namespace, `eth0` inside) to a bridge `<prefix><run>br` that has the `.1` address of a private /24
  picked per run (10.A.B.0/24, checked against every address and route already present, under a lock shared by
  concurrent runs). The root namespace, where the tests and the coordinator run, reaches every host and every
  host reaches every other. Hosts get NO default route: nothing they send can leave our bridge.
- an `sshd -D` started by `ip netns exec NS unshare -m --propagation private`, with `/srv` bind-mounted from the
  host's own directory (so `/srv/model` differs per host) while the rest of the filesystem, including the
  repository's `.venv` that the nodes use as their python, is shared. Host key (ed25519, per host and run),
  sshd_config, pid file and `-E` log live in the host's temp directory.

PATH and SetEnv (checked on Debian 12, OpenSSH 9.2, bash 5.2):

- sshd applies `SetEnv` after its own defaults, so `SetEnv PATH=...` does replace the PATH of root's sessions
  (with `UsePAM no` nothing else touches it). OpenSSH honours only the FIRST `SetEnv` line, so every variable goes
  on one line.
- But root's shell is bash, and Debian's bash sources `~/.bashrc` even for a non-interactive `bash -c CMD` when it
  is started by sshd (SSH_SOURCE_BASHRC). This machine's `/root/.bashrc` prepends pyenv/cargo directories to
  PATH (and spends ~0.15 s in `pyenv init`), which pushed the shims off the front and made `python3` pyenv's.
  The fix: inside each host's private mount namespace, root's `~/.bashrc` and `~/.profile` are bind-mounted over
  by an empty file of the host's, and `/etc/profile` (which login shells read and which resets PATH on Debian)
  by one that sets the same PATH as SetEnv. So `cmd`, `sh -c`, `bash -c`, `bash -lc` and `sh -lc` all see the
  shims first, as on a Mac, where `sw_vers` & co. are found by login and non-login shells alike. Each host's
  copies are `<host dir>/dot-empty` and `<host dir>/etc-profile` (a test may edit them, e.g. to make a noisy rc).

Fake Macs: `make_mac_shims` turns a recorded profile (`tests/fixtures/profiles/<name>/<section>.out` plus an
optional `<section>.rc`) into shim executables in a directory that is put first on the host's PATH. Hosts of one
bed with the same profile share that directory (read-only).

link_down: the host's bridge port goes down while the root namespace keeps a permanent ARP entry for it, so from
the root namespace (the coordinator) a connection silently times out; other hosts get "No route to host" after
their ~3 s of ARP retries.

Cleanup: `TestBed.close()` (also registered with atexit, idempotent, safe after a partial setup) kills every
process in the run's namespaces and deletes namespaces, veths and the bridge. A run writes
`/run/mx-testbed/<run>.json` naming its owner process; `cleanup_stale()` removes the leftovers of runs whose owner
is dead (or, without a state file, whose namespaces hold no process).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import yaml

REPO = Path(__file__).resolve().parents[1]
PROFILES_DIR = REPO / "tests" / "fixtures" / "profiles"
VENV_PYTHON = str(REPO / ".venv" / "bin" / "python")
PREFIX = "mx"
STATE_DIR = Path("/run/mx-testbed")
NETNS_DIR = Path("/run/netns")
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SSH_PORT = 22
COMMAND_TIMEOUT = 30.0  # any helper subprocess
SSHD_READY_TIMEOUT = 10.0  # sshd must accept connections on its port within this
MAX_HOSTS = 253  # .2 .. .254 of the /24
REQUIRED_TOOLS = ("ip", "sshd", "ssh", "ssh-keygen", "unshare", "nsenter", "mount")

_RUN_ID = re.compile(r"[0-9a-f]{4,8}")  # hex: never contains the "v"/"br" separators
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TestBedError(RuntimeError):
    """Anything the test bed could not set up or tear down; the message says what and why."""

    __test__ = False  # not a pytest test class


@dataclass
class Host:
    """One SSH host of the bed. `pid` is the listening sshd's, None while it is stopped."""

    name: str
    ns: str
    ip: str
    srv: Path  # the host's /srv, seen from the root namespace
    shims: Path | None
    pid: int | None
    host_key_pub: str  # "ssh-ed25519 AAAA..." without comment
    dir: Path  # sshd_config, host key, logs
    veth: str  # root-namespace end of the host's veth pair (a bridge port)
    index: int
    env: dict[str, str] = field(default_factory=dict)  # extra SetEnv variables

    @property
    def log(self) -> Path:
        """sshd's log (`-E`, LogLevel VERBOSE)."""
        return self.dir / "sshd.log"

    @property
    def config(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def host_key(self) -> Path:
        return self.dir / "ssh_host_ed25519_key"


# --------------------------------------------------------------------------------------------------- helpers


def _run(
    argv: Sequence[str], *, input: str | None = None, timeout: float = COMMAND_TIMEOUT, check: bool = True
) -> subprocess.CompletedProcess[str]:
    try:
        cp = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TestBedError(f"timed out after {timeout}s: {shlex.join(argv)}") from exc
    if check and cp.returncode != 0:
        detail = (cp.stderr or cp.stdout).strip()
        raise TestBedError(f"`{shlex.join(argv)}` exited {cp.returncode}: {detail}")
    return cp


def _ip_batch(lines: Sequence[str], *, netns: str | None = None, force: bool = False) -> None:
    """Several `ip` commands in one process (each `ip` start costs a few ms; 64 hosts make hundreds)."""
    argv = ["ip"] + (["-n", netns] if netns else []) + (["-force"] if force else []) + ["-batch", "-"]
    _run(argv, input="\n".join(lines) + "\n", check=not force)


def _ssh_keygen(path: Path, comment: str) -> str:
    """A new ed25519 key pair at `path`/`path`.pub; returns the public key without its comment."""
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    kind, blob = path.with_name(path.name + ".pub").read_text().split()[:2]
    return f"{kind} {blob}"


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, None if there is no such process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def _alive(pid: int, start: int | None = None) -> bool:
    """The process exists, is not a zombie and (if given) started at `start` (so a recycled pid is not it)."""
    st = _proc_state(pid)
    return st is not None and st[0] not in ("Z", "X") and (start is None or st[1] == start)


def _netns_pids(namespaces: Sequence[str]) -> dict[str, list[int]]:
    """Live processes in each named namespace (what `ip netns pids` does, in one /proc scan for all of them)."""
    keys: dict[tuple[int, int], str] = {}
    for ns in namespaces:
        with contextlib.suppress(OSError):
            st = os.stat(NETNS_DIR / ns)
            keys[(st.st_dev, st.st_ino)] = ns
    out: dict[str, list[int]] = {ns: [] for ns in namespaces}
    if not keys:
        return out
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        owner = keys.get((st.st_dev, st.st_ino))
        if owner is not None and _alive(int(entry)):
            out[owner].append(int(entry))
    return out


def _kill_and_wait(pids: Sequence[int], *, timeout: float = 5.0) -> list[int]:
    """SIGKILL `pids` and wait until they are gone (or zombies: pid 1 of a container may never reap them).
    Returns the pids still alive at the deadline."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.005)
        left = [p for p in left if _alive(p)]
    return left


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network already on this namespace: interface addresses and routes of all tables."""
    nets: list[ipaddress.IPv4Network] = []
    for link in json.loads(_run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default":
            nets.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
    return nets


def _pick_subnet(run_id: str) -> ipaddress.IPv4Network:
    """A 10.A.B.0/24 derived from the run id that overlaps nothing present. Call with the state lock held."""
    used = _used_networks()
    seed = int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:4], "big")
    for attempt in range(4096):
        n = (seed + attempt * 7919) % (156 * 256)  # 10.100.0.0 .. 10.255.255.0
        net = ipaddress.IPv4Network(f"10.{100 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise TestBedError("no free 10.x.y.0/24 for the test bed")


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    """Serialises subnet choice and bridge creation between concurrent runs (and cleanup_stale)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def requirements_problems() -> list[str]:
    """Why the test bed cannot run here (empty when it can)."""
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append(f"must run as root (euid is {os.geteuid()}): network namespaces and sshd need it")
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t, path=BASE_PATH + ":" + os.environ.get("PATH", "")) is None]
    if missing:
        problems.append(
            f"missing commands: {', '.join(missing)} (apt-get install openssh-server openssh-client iproute2 util-linux procps)"
        )
    if not Path("/srv").is_dir():
        problems.append("/srv does not exist (each host bind-mounts its own directory there)")
    return problems


# ----------------------------------------------------------------------------------------------- mac shims

# command -> {argument string ("$*"), or None for any arguments: profile section}
MAC_COMMANDS: dict[str, dict[str | None, str]] = {
    "uname": {None: "uname"},
    "sw_vers": {None: "sw_vers"},
    "sysctl": {None: "sysctl"},
    "system_profiler": {None: "system_profiler"},
    "networksetup": {"-listallhardwareports": "networksetup"},
    "ifconfig": {None: "ifconfig"},
    "rdma_ctl": {"status": "rdma_ctl"},
    "ibv_devices": {None: "ibv_devices"},
    "ibv_devinfo": {None: "ibv_devinfo"},
    "vm_stat": {None: "vm_stat"},
    "memory_pressure": {None: "memory_pressure"},
    "pmset": {"-g": "pmset", "-g batt": "pmset_batt"},
    "df": {None: "df"},
    "ioreg": {None: "ioreg"},
}
# Shims that change a Mac's settings: any arguments but the recorded ones are appended, tab-separated, one call a
# line, to `$MX_SHIM_CALLS/<file>` (default /srv: each host's own) and succeed, so a test reads what was run.
RECORDING_COMMANDS = {"networksetup": "networksetup.calls"}
_SW_VERS_KEYS = ("ProductName", "ProductVersion", "BuildVersion")
SHIM_DATA = ".recorded"  # the shims' copy of the profile, inside the shims directory


def resolve_profile(profile: str | Path) -> Path:
    """A profile name (a directory of tests/fixtures/profiles) or a path to a profile directory."""
    path = profile if isinstance(profile, Path) or "/" in profile else PROFILES_DIR / profile
    path = Path(path)
    if not path.is_dir():
        raise TestBedError(f"no such profile directory: {path}")
    return path


def make_mac_shims(profile_dir: Path, shims_dir: Path) -> list[str]:
    """Write shim executables into `shims_dir` that answer like the Mac recorded in `profile_dir`.

    A section file `<section>.out` is replayed byte for byte, to stdout if the section's exit code
    (`<section>.rc`, default 0) is 0, else to stderr followed by that exit code. A section with no file means the
    command does not exist on that Mac: no shim is made (a Linux command of the same name later on PATH may then
    answer). `uname`, `sysctl`, `system_profiler`, `df` and the other single-section commands answer their section
    for any arguments; `rdma_ctl` answers only `status`, `pmset` only `-g` (section `pmset`) and `-g batt`
    (`pmset_batt`), and other arguments exit 64 with a message. `sw_vers -productName|-productVersion|
    -buildVersion` print the matching value. `networksetup` answers `-listallhardwareports` and records any other
    call (RECORDING_COMMANDS: tab-separated argv, one line per call, in `$MX_SHIM_CALLS`, default the host's
    /srv). Returns the names of the commands made, sorted.
    """
    profile_dir = Path(profile_dir)
    data = shims_dir / SHIM_DATA
    data.mkdir(parents=True, exist_ok=True)
    sections: dict[str, int] = {}
    for out in sorted(profile_dir.glob("*.out")):
        rc_file = out.with_suffix(".rc")
        sections[out.stem] = int(rc_file.read_text().strip()) if rc_file.exists() else 0
        shutil.copyfile(out, data / out.name)
    made: list[str] = []
    for command, answers in MAC_COMMANDS.items():
        present = {args: s for args, s in answers.items() if s in sections}
        if not present:
            continue
        lines = [
            "#!/bin/sh",
            f"# testbed shim: `{command}` answers from the recorded profile {profile_dir.name}",
            f"d={shlex.quote(str(data))}",
            'case "$*" in',
        ]
        if command == "sw_vers" and sections.get("sw_vers") == 0:
            for key in _SW_VERS_KEYS:
                flag = "-" + key[0].lower() + key[1:]
                lines.append(f"  {flag}) exec /bin/sed -n 's/^{key}:[[:space:]]*//p' \"$d\"/sw_vers.out ;;")
        for args, section in present.items():
            rc = sections[section]
            pattern = "*" if args is None else shlex.quote(args)
            if rc == 0:
                lines.append(f'  {pattern}) exec /bin/cat "$d"/{section}.out ;;')
            else:
                lines.append(f'  {pattern}) /bin/cat "$d"/{section}.out >&2; exit {rc} ;;')
        if command in RECORDING_COMMANDS:
            log = '"${MX_SHIM_CALLS:-/srv}"/' + RECORDING_COMMANDS[command]
            lines.append(f"""  *) {{ for a in "$@"; do printf '%s\\t' "$a"; done; echo; }} >> {log}; exit 0 ;;""")
        elif None not in present:
            lines.append(f'  *) echo "{command}: testbed shim has no recording for: {command} $*" >&2; exit 64 ;;')
        lines.append("esac")
        shim = shims_dir / command
        shim.write_text("\n".join(lines) + "\n")
        shim.chmod(0o755)
        made.append(command)
    return sorted(made)


def _setenv_line(env: Mapping[str, str]) -> str:
    """One sshd_config `SetEnv` line (sshd ignores every SetEnv line after the first)."""
    words = []
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name) or "\n" in value or "\0" in value:
            raise TestBedError(f"cannot pass {name}={value!r} through SetEnv")
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        words.append(f'"{name}={escaped}"')
    return "SetEnv " + " ".join(words)


# ------------------------------------------------------------------------------------------------ assets

_ASSETS: dict[tuple[str, int, int, int], Path] = {}
_ASSETS_LOCK = threading.Lock()


def provisioned_assets(data_from: Path, *, layers: int = 2, hidden: int = 32, seed: int = 0) -> Path:
    """A directory holding `data` and `model` exactly as a launch's `assets:` provisioning places them on a node
    (`assets.data_from: data_from`, `assets.tiny_model: {layers, hidden, seed}`), made once per process by the
    coordinator's own provisioning script (coordinator/fleet/assets.py) and removed at exit. `TestBed.seed_assets`
    copies it into hosts' /srv: a test about something else then skips building the tiny model on every node of
    every fresh bed (a python with numpy, mlx and mlx-lm per node: ~2 CPU-seconds each); launch finds them
    present, as on a bed where an earlier run placed them."""
    from coordinator.fleet.assets import _PROVISION

    key = (str(Path(data_from).resolve()), layers, hidden, seed)
    with _ASSETS_LOCK:
        if key in _ASSETS:
            return _ASSETS[key]
        root = Path(f"/tmp/mx-testbed-assets-{os.getpid()}-{len(_ASSETS)}")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        atexit.register(shutil.rmtree, root, True)
        src = Path(data_from)
        files = {p.relative_to(src).as_posix(): p.read_text(encoding="utf-8")
                 for p in sorted(src.rglob("*")) if p.is_file()}  # as coordinator.fleet.assets.read_data_files
        spec = {"data": {"path": str(root / "data"), "files": files},
                "tiny": {"path": str(root / "model"), "data": str(root / "data"), "layers": layers, "hidden": hidden,
                         "seed": seed}}
        done = subprocess.run([sys.executable, "-c", _PROVISION], input=json.dumps(spec), capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
        if done.returncode != 0 or json.loads(done.stdout.strip().splitlines()[-1]) != {"data": "created",
                                                                                          "model": "created"}:
            raise TestBedError(f"provisioning the assets failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
        _ASSETS[key] = root
        return root


# ------------------------------------------------------------------------------------------------- the bed


class TestBed:
    """N SSH hosts in network namespaces; see the module docstring. Use as a context manager or call close()."""

    __test__ = False  # not a pytest test class

    def __init__(self, *, tmp: Path, run_id: str | None = None, prefix: str = PREFIX) -> None:
        problems = requirements_problems()
        if problems:
            raise TestBedError("; ".join(problems))
        self.run_id = run_id or secrets.token_hex(3)
        if not _RUN_ID.fullmatch(self.run_id) or not re.fullmatch(r"[a-z]{1,4}", prefix):
            raise TestBedError(f"bad run id {self.run_id!r} / prefix {prefix!r}")
        self.prefix = prefix
        self.tag = prefix + self.run_id  # every kernel object of this run starts with it
        if len(f"{self.tag}v{MAX_HOSTS}") > 15:
            raise TestBedError(f"run id {self.run_id!r} too long for 15-character interface names")
        self.bridge = f"{self.tag}br"
        self.tmp = Path(tmp)
        self.hosts: list[Host] = []
        self.subnet: ipaddress.IPv4Network | None = None
        self._lock = threading.Lock()
        self._next_index = 1
        self._names: set[str] = set()
        self._unknown: set[str] = set()  # hosts left out of known_hosts
        self._namespaces: list[str] = []  # every namespace/veth we may have created, for close()
        self._veths: list[str] = []
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._shims: dict[Path, Path] = {}
        self._shims_lock = threading.Lock()
        self._closed = False
        self._owner = False  # True once the run id is ours: close() must never remove another run's objects
        self._state_file = STATE_DIR / f"{self.tag}.json"
        atexit.register(self.close)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        with _state_lock():
            if any(n.startswith(f"{self.tag}-") for n in _list_netns()) or self._state_file.exists():
                raise TestBedError(f"run id {self.run_id!r} is already in use")
            self.subnet = _pick_subnet(self.run_id)
            state = {
                "owner_pid": os.getpid(),
                "owner_start": (_proc_state(os.getpid()) or ("", 0))[1],
                "subnet": str(self.subnet),
                "tmp": str(self.tmp),
            }
            self._state_file.write_text(json.dumps(state))
            self._owner = True
            _ip_batch([
                f"link add {self.bridge} type bridge",
                f"link set {self.bridge} addrgenmode none",  # no IPv6 link-local chatter
                f"addr add {self.gateway}/24 dev {self.bridge}",
                f"link set {self.bridge} up",
            ])  # fmt: skip
        self.client_key = self.tmp / "client_key"
        self.known_hosts = self.tmp / "known_hosts"
        self.authorized_keys = self.tmp / "authorized_keys"
        pub = _ssh_keygen(self.client_key, f"testbed-{self.tag}-client")
        self.authorized_keys.write_text(pub + "\n")
        self.known_hosts.write_text("")

    @property
    def gateway(self) -> str:
        """The bridge's (root namespace's) address on the bed's subnet."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    # ------------------------------------------------------------------------------------------- hosts

    def add_host(
        self,
        name: str,
        *,
        mac_profile: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        start_sshd: bool = True,
        known: bool = True,
    ) -> Host:
        """A new host named `name`. `mac_profile` (a profile name or directory) makes it answer like that Mac
        through shims first on PATH; `env` adds SetEnv variables; `known=False` keeps its key out of
        known_hosts; `start_sshd=False` leaves sshd stopped (start_sshd() later)."""
        index = self._reserve(name)
        return self._create(name, index, mac_profile=mac_profile, env=env, start=start_sshd, known=known)

    def add_hosts(
        self,
        names: Sequence[str] | int,
        *,
        mac_profile: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        start_sshd: bool = True,
        known: bool = True,
        workers: int = 8,
    ) -> list[Host]:
        """Several hosts at once, created in parallel; an int n means names h1..hn. Addresses follow `names`."""
        if isinstance(names, int):
            names = [f"h{i}" for i in range(len(self.hosts) + 1, len(self.hosts) + names + 1)]
        indexes = [self._reserve(n) for n in names]
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = [
                pool.submit(self._create, n, i, mac_profile=mac_profile, env=env, start=start_sshd, known=known)
                for n, i in zip(names, indexes, strict=True)
            ]
            return [f.result() for f in futures]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def _reserve(self, name: str) -> int:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise TestBedError(f"bad host name {name!r}")
        with self._lock:
            if self._closed:
                raise TestBedError("test bed is closed")
            if name in self._names:
                raise TestBedError(f"host {name!r} already exists")
            if self._next_index > MAX_HOSTS:
                raise TestBedError(f"at most {MAX_HOSTS} hosts per test bed")
            index = self._next_index
            self._next_index += 1
            self._names.add(name)
            self._namespaces.append(f"{self.tag}-{index}")  # before creating: close() must find partial hosts
            self._veths.append(f"{self.tag}v{index}")
            return index

    def _create(
        self,
        name: str,
        index: int,
        *,
        mac_profile: str | Path | None,
        env: Mapping[str, str] | None,
        start: bool,
        known: bool,
    ) -> Host:
        assert self.subnet is not None
        ns, veth, ip = f"{self.tag}-{index}", f"{self.tag}v{index}", str(self.subnet.network_address + index + 1)
        hdir = self.tmp / name
        srv = hdir / "srv"
        srv.mkdir(parents=True, exist_ok=True)
        profile = resolve_profile(mac_profile) if mac_profile is not None else None
        _setenv_line(env or {})  # refuse bad variables before creating anything
        _ip_batch([
            f"netns add {ns}",
            f"link add {veth} type veth peer name eth0 netns {ns}",
            f"link set {veth} addrgenmode none",
            f"link set {veth} master {self.bridge}",
            f"link set {veth} up",
        ])  # fmt: skip
        _ip_batch([
            "link set lo up",
            "link set eth0 addrgenmode none",
            f"addr add {ip}/24 dev eth0",
            "link set eth0 up",
        ], netns=ns)  # fmt: skip
        key = hdir / "ssh_host_ed25519_key"
        host_key_pub = _ssh_keygen(key, f"testbed-{self.tag}-{name}")
        shims: Path | None = None
        if profile is not None:
            shims = self._shims_for(profile)
        host = Host(
            name=name, ns=ns, ip=ip, srv=srv, shims=shims, pid=None, host_key_pub=host_key_pub, dir=hdir,
            veth=veth, index=index, env=dict(env or {}),
        )  # fmt: skip
        self._write_sshd_config(host)
        with self._lock:
            self.hosts.append(host)
            self.hosts.sort(key=lambda h: h.index)
            if not known:
                self._unknown.add(name)
            else:
                with open(self.known_hosts, "a") as f:
                    f.write(f"{host.ip} {host.host_key_pub}\n")
        if start:
            self.start_sshd(host)
        return host

    def _write_sshd_config(self, host: Host) -> None:
        """sshd_config, plus the startup files that replace root's inside the host (see `_overlays`)."""
        env = {"PATH": f"{host.shims}:{BASE_PATH}" if host.shims else BASE_PATH, **host.env}
        (host.dir / "dot-empty").write_text(f"# testbed host {host.name}: replaces root's ~/.bashrc and ~/.profile\n")
        (host.dir / "etc-profile").write_text(
            f"# testbed host {host.name}: replaces /etc/profile; login shells keep the host's PATH\n"
            f"PATH={shlex.quote(env['PATH'])}\nexport PATH\n"
        )
        host.config.write_text(
            "\n".join([
                f"# testbed host {host.name} ({host.ns})",
                f"ListenAddress {host.ip}:{SSH_PORT}",
                "AddressFamily inet",
                f"HostKey {host.host_key}",
                f"PidFile {host.dir / 'sshd.pid'}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                f"AuthorizedKeysFile {self.authorized_keys}",
                "UsePAM no",
                "StrictModes no",
                "UseDNS no",
                "PrintMotd no",
                "PrintLastLog no",
                "LogLevel VERBOSE",
                "Subsystem sftp internal-sftp",
                _setenv_line(env),
            ]) + "\n"
        )  # fmt: skip

    def _shims_for(self, profile: Path) -> Path:
        """The bed's shims directory for `profile`, made on first use: hosts with the same profile share it
        (read-only; to vary one host, give it a profile directory of its own)."""
        key = profile.resolve()
        with self._shims_lock:
            if key not in self._shims:
                shims = self.tmp / "shims" / f"{len(self._shims) + 1}-{key.name}"
                make_mac_shims(key, shims)
                self._shims[key] = shims
            return self._shims[key]

    # -------------------------------------------------------------------------------------------- sshd

    def _ns_prefix(self, host: Host) -> list[str]:
        """argv prefix: the host's network namespace plus a fresh private mount namespace with the host's own
        /srv and shell startup files bind-mounted (see `_overlays`); append the command's argv."""
        pairs = [str(p) for source, target in self._overlays(host) for p in (source, target)]
        # `ip netns exec` remounts /sys, which drops the cgroup mounts: the v1 memory hierarchy is mounted again
        # (the same hierarchy, not a new one), so a host sees its own cgroup memory limit as a real machine does.
        # Best effort: a machine without it simply shows no limit.
        script = ('while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 126; shift 2; done; shift; '
                  '[ -d /sys/fs/cgroup/memory ] || { mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup && '
                  'mkdir /sys/fs/cgroup/memory && mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory; } '
                  '>/dev/null 2>&1; exec "$@"')
        return [
            "ip", "netns", "exec", host.ns, "unshare", "-m", "--propagation", "private",
            "sh", "-c", script, "sh", *pairs, "--",
        ]  # fmt: skip

    def _overlays(self, host: Host) -> list[tuple[Path, Path]]:
        """(host's file, path it replaces inside the host): /srv, and the startup files that would otherwise
        change PATH (root's ~/.bashrc and ~/.profile, and /etc/profile for login shells)."""
        pairs = [(host.srv, Path("/srv"))]
        home = _root_home()
        for name in (".bashrc", ".profile"):
            if home is not None and (home / name).is_file():
                pairs.append((host.dir / "dot-empty", home / name))
        if Path("/etc/profile").is_file():
            pairs.append((host.dir / "etc-profile", Path("/etc/profile")))
        return pairs

    def start_sshd(self, host: Host) -> int:
        """Start the host's sshd and wait until its port accepts connections. Returns its pid."""
        if host.pid is not None and _alive(host.pid):
            raise TestBedError(f"sshd of {host.name} already runs (pid {host.pid})")
        sshd = shutil.which("sshd", path=BASE_PATH) or "sshd"
        argv = [*self._ns_prefix(host), sshd, "-D", "-f", str(host.config), "-E", str(host.log)]
        with open(host.dir / "sshd.stderr", "ab") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env={"PATH": BASE_PATH})
        with self._lock:
            self._procs[host.name] = proc
        host.pid = proc.pid  # ip netns exec, unshare and sh all exec: this is sshd's pid
        deadline = time.monotonic() + SSHD_READY_TIMEOUT
        while True:
            if proc.poll() is not None:
                host.pid = None
                raise TestBedError(f"sshd of {host.name} exited {proc.returncode}: {self._sshd_errors(host)}")
            try:
                with socket.create_connection((host.ip, SSH_PORT), timeout=0.5):
                    return proc.pid
            except OSError:
                if time.monotonic() > deadline:
                    self.stop_sshd(host)
                    raise TestBedError(
                        f"sshd of {host.name} not listening on {host.ip}:{SSH_PORT} after {SSHD_READY_TIMEOUT}s: "
                        f"{self._sshd_errors(host)}"
                    ) from None
                time.sleep(0.005)

    @staticmethod
    def _sshd_errors(host: Host) -> str:
        text = ""
        for p in (host.dir / "sshd.stderr", host.log):
            with contextlib.suppress(OSError):
                text += p.read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-8:]) or "(no output)"

    def stop_sshd(self, host: Host, *, sessions: bool = False) -> None:
        """Stop the listening sshd: new connections are refused. Open sessions survive (like `systemctl stop
        ssh`) unless `sessions=True`, which kills every process of the host (as if it crashed)."""
        with self._lock:
            proc = self._procs.pop(host.name, None)
        if proc is not None:
            _kill_and_wait([proc.pid])
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        host.pid = None
        if sessions:
            _kill_and_wait(_netns_pids([host.ns])[host.ns])

    def regenerate_host_key(self, host: Host) -> str:
        """Give the host a new host key (known_hosts keeps the old one, so strict checking fails). Restarts a
        running sshd. Returns the new public key."""
        running = host.pid is not None
        if running:
            self.stop_sshd(host)
        host.host_key_pub = _ssh_keygen(host.host_key, f"testbed-{self.tag}-{host.name}-new")
        if running:
            self.start_sshd(host)
        return host.host_key_pub

    def link_down(self, host: Host) -> None:
        """Pull the host's cable: its bridge port goes down and the root namespace keeps its ARP entry, so
        connections to it time out (no quick 'no route to host') and it reaches nobody."""
        link = json.loads(_run(["ip", "-n", host.ns, "-j", "link", "show", "eth0"]).stdout)[0]
        _ip_batch([
            f"neigh replace {host.ip} lladdr {link['address']} dev {self.bridge} nud permanent",
            f"link set {host.veth} down",
        ])  # fmt: skip

    def link_up(self, host: Host) -> None:
        _ip_batch([f"link set {host.veth} up", f"neigh del {host.ip} dev {self.bridge}"], force=True)

    def seed_assets(self, hosts: Sequence[Host], assets: Path) -> None:
        """Copy `provisioned_assets(...)`'s `data` and `model` to /srv/data and /srv/model of each host (copies,
        not links: a test may change one host's files)."""
        for h in hosts:
            for name in ("data", "model"):
                shutil.copytree(assets / name, h.srv / name)

    # ------------------------------------------------------------------------------------------- using

    def exec(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        input: str | None = None,
        timeout: float = COMMAND_TIMEOUT,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv as root inside the host (its network namespace and a mount namespace with its /srv),
        without SSH. Works whether or not sshd runs."""
        return _run([*self._ns_prefix(host), *argv], input=input, timeout=timeout, check=check)

    def ssh_argv(self, host: Host, command: str, *, connect_timeout: float = 3.0) -> list[str]:
        """The OpenSSH client's argv for running `command` on the host with the bed's key and strict checking."""
        return [
            "ssh", "-F", "/dev/null", "-i", str(self.client_key), "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout:g}",
            "-p", str(SSH_PORT), f"root@{host.ip}", command,
        ]  # fmt: skip

    def ssh(
        self, host: Host, command: str, *, timeout: float = COMMAND_TIMEOUT, connect_timeout: float = 3.0
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` (a shell command line) on the host through the OpenSSH client; never raises on exit code."""
        return _run(self.ssh_argv(host, command, connect_timeout=connect_timeout), timeout=timeout, check=False)

    def write_inventory(
        self,
        path: Path,
        hosts: Sequence[Host] | None = None,
        *,
        python: str = VENV_PYTHON,
        workdir: str = "/srv/work",
        extra_nodes: Sequence[Mapping[str, object]] | None = None,
    ) -> Path:
        """A coordinator inventory (YAML) for `hosts` (default: all), plus `extra_nodes` verbatim."""
        doc = {
            "defaults": {
                "user": "root",
                "port": SSH_PORT,
                "python": python,
                "workdir": workdir,
                "identity": str(self.client_key),
                "known_hosts": str(self.known_hosts),
            },
            "nodes": [{"name": h.name, "host": h.ip, "ips": [h.ip]} for h in (self.hosts if hosts is None else hosts)]
            + [dict(n) for n in extra_nodes or ()],
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    # ------------------------------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill every process in the run's namespaces, delete namespaces, veths and bridge, drop the state file.
        Idempotent. Raises TestBedError if something of the run is still there afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs.values())
            self._procs.clear()
        atexit.unregister(self.close)
        for h in self.hosts:
            h.pid = None
        if not self._owner:
            return
        problems = _remove_run(self.tag, self._namespaces, self._veths, procs)
        if problems:
            raise TestBedError(f"test bed {self.tag} left behind: {'; '.join(problems)}")

    def __enter__(self) -> TestBed:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _root_home() -> Path | None:
    try:
        return Path(pwd.getpwuid(0).pw_dir)
    except KeyError:
        return None


def _list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except OSError:
        return []


def _links(kind: str) -> list[str]:
    return [link["ifname"] for link in json.loads(_run(["ip", "-j", "link", "show", "type", kind]).stdout or "[]")]


def _remove_run(
    tag: str, namespaces: Sequence[str], veths: Sequence[str], procs: Sequence[subprocess.Popen[bytes]] = ()
) -> list[str]:
    """Remove everything of run `tag`; returns what is still there afterwards (empty when clean)."""
    namespaces = sorted(set(namespaces) | {n for n in _list_netns() if n.startswith(f"{tag}-")})
    pids = [p.pid for p in procs] + [pid for ps in _netns_pids(namespaces).values() for pid in ps]
    stuck = _kill_and_wait(sorted(set(pids)))
    for proc in procs:  # reap our own children
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    existing_veths = set(_links("veth"))
    lines = [f"link del {v}" for v in veths if v in existing_veths]
    lines += [f"link del {v}" for v in existing_veths if re.fullmatch(rf"{re.escape(tag)}v\d+", v) and v not in veths]
    lines += [f"netns del {n}" for n in namespaces if (NETNS_DIR / n).exists()]
    if f"{tag}br" in _links("bridge"):
        lines.append(f"link del {tag}br")
    if lines:
        _ip_batch(lines, force=True)
    (STATE_DIR / f"{tag}.json").unlink(missing_ok=True)
    problems = [f"pid {p} did not die" for p in stuck]
    problems += [f"namespace {n}" for n in _list_netns() if n.startswith(f"{tag}-")]
    problems += [f"link {n}" for n in _links("veth") + _links("bridge") if re.fullmatch(rf"{re.escape(tag)}(v\d+|br)", n)]
    return problems


# ------------------------------------------------------------------------------------------ stale runs


@dataclass(frozen=True)
class RunInfo:
    """A run of the test bed found on this machine."""

    tag: str
    namespaces: tuple[str, ...]
    owner_pid: int | None  # from its state file; None without one
    alive: bool


def list_runs(prefix: str = PREFIX) -> list[RunInfo]:
    """Every run with a namespace, bridge, veth or state file on this machine."""
    pattern = re.compile(rf"({re.escape(prefix)}[0-9a-f]{{4,8}})(?:-\d+|v\d+|br|\.json)")
    tags: dict[str, list[str]] = {}
    names = _list_netns() + _links("bridge") + _links("veth")
    with contextlib.suppress(OSError):
        names += os.listdir(STATE_DIR)
    for n in names:
        m = pattern.fullmatch(n)
        if m:
            tags.setdefault(m[1], [])
            if n.startswith(m[1] + "-"):
                tags[m[1]].append(n)
    runs = []
    for tag, namespaces in sorted(tags.items()):
        owner: int | None = None
        try:
            state = json.loads((STATE_DIR / f"{tag}.json").read_text())
            owner = int(state["owner_pid"])
            alive = _alive(owner, int(state["owner_start"]))
        except (OSError, ValueError, KeyError, TypeError):
            # no (readable) state file: alive while any of its namespaces holds a process (its sshd)
            alive = any(_netns_pids(namespaces).values())
        runs.append(RunInfo(tag, tuple(sorted(namespaces)), owner, alive))
    return runs


def remove_run(tag: str) -> list[str]:
    """Remove run `tag` (e.g. "mx3fa9c1") whoever owns it; returns what could not be removed."""
    with _state_lock():
        return _remove_run(tag, [n for n in _list_netns() if n.startswith(f"{tag}-")], [])


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove the leftovers of dead runs (owner process gone, or no state file and no process in their
    namespaces). Live runs of other processes are left alone. Returns the tags removed."""
    removed = []
    with _state_lock():
        for run in list_runs(prefix):
            if not run.alive:
                problems = _remove_run(run.tag, run.namespaces, [])
                if problems:
                    print(f"testbed: stale run {run.tag} left behind: {'; '.join(problems)}", file=sys.stderr)
                removed.append(run.tag)
    return removed
