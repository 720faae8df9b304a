"""Typed values shared across the coordinator: nodes, check results, reports.

Everything here is a frozen dataclass or a StrEnum; nothing here does I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

LOCAL_HOST = "127.0.0.1"
"""Loopback: the host of a `connection: local` node that names none (the literal host mlx.launch runs without SSH),
and what the coordinator's own listeners bind unless told otherwise."""

# The Prometheus endpoints bind loopback unless told otherwise (metrics.py; `--metrics-host` of launch/monitor).
DEFAULT_METRICS_HOST = LOCAL_HOST

# Defaults that verbs' options show in `--help`: here, so a verb's module can name them without importing the
# module that uses them (and all it imports: `--help` answers in well under 0.5 s, tests/unit/test_cli_startup.py).
DEFAULT_RUN_DIR = "runs"  # where run directories are written and looked for (`--run-dir`)
DEFAULT_STATUS_PROBE_TIMEOUT = 60.0  # `status` / `monitor` / `dashboard` probe of each node, seconds
DEFAULT_DASHBOARD_HOST = LOCAL_HOST
DEFAULT_DASHBOARD_PORT = 8050
DEFAULT_DASHBOARD_PROBE_INTERVAL = 10.0  # the dashboard's fleet page probes the nodes this often, seconds


class Connection(StrEnum):
    SSH = "ssh"
    LOCAL = "local"


@dataclass(frozen=True)
class Node:
    """One machine of the fleet, with inventory defaults already merged in."""

    name: str
    host: str
    connection: Connection = Connection.SSH
    user: str | None = None
    port: int | None = None
    python: str = "python3"
    workdir: str = "~/mlx-work"
    identity: str | None = None
    known_hosts: str | None = None
    ips: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    source: str | None = None  # "file:line" the node was defined at, for messages
    gpus: int | None = None  # the inventory's `gpus:`: use at most this many of its NVIDIA GPUs (None: all)
    # A rank node (coordinator.planning.gpuranks): one GPU of the inventory node `machine`, named `<machine>/gpu<i>`,
    # with CUDA_VISIBLE_DEVICES in its env. None for an inventory node (one rank on the whole machine).
    machine: str | None = None
    gpu: int | None = None  # that GPU's nvidia-smi index

    @property
    def machine_name(self) -> str:
        """The inventory node this node runs on: itself, or a rank node's machine (ssh_config, hostfile `ssh`)."""
        return self.machine or self.name

    @property
    def ssh_target(self) -> str:
        """`user@host` as mlx.launch's hostfile wants it."""
        return f"{self.user}@{self.host}" if self.user else self.host

    @property
    def data_ip(self) -> str:
        """The address peers use for this node's data plane: its first `ips` entry, else its ssh host."""
        return self.ips[0] if self.ips else self.host

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)


@dataclass(frozen=True)
class Inventory:
    nodes: tuple[Node, ...]
    path: str | None = None

    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def limit(self, names: list[str] | None) -> Inventory:
        """Keep only `names` (in inventory order); None keeps every node. Unknown names, and an empty list (a
        `--limit` that named nobody must never widen to the whole fleet), are a ConfigError."""
        from coordinator.errors import ConfigError

        if names is None:
            return self
        if not names:
            raise ConfigError(f"--limit names no node; known: {', '.join(self.names())}")
        known = set(self.names())
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ConfigError(f"--limit names unknown node(s): {', '.join(unknown)}; known: {', '.join(self.names())}")
        wanted = set(names)
        return Inventory(tuple(n for n in self.nodes if n.name in wanted), self.path)


def parse_limit(text: str | None) -> list[str] | None:
    """`--limit a,b` -> ["a", "b"]; None (no flag) -> None, the whole fleet. An empty value, a lone comma, blanks
    or an empty name between commas are a ConfigError: a `--limit "$NODES"` whose variable came out empty must
    not act on every node."""
    from coordinator.errors import ConfigError

    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    if not any(names):
        raise ConfigError(f"--limit {text!r} names no node: give comma-separated node names (--limit n1,n2), "
                          "or leave --limit out for the whole fleet")
    if not all(names):
        raise ConfigError(f"--limit {text!r} has an empty name between commas: give comma-separated node names "
                          "(--limit n1,n2)")
    return names


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    ERROR = "error"
    SKIP = "skip"


# Order used to sort and to pick the "worst" of several findings.
STATUS_SEVERITY: dict[Status, int] = {
    Status.FAIL: 4,
    Status.ERROR: 3,
    Status.WARN: 2,
    Status.PASS: 1,
    Status.SKIP: 0,
}


def worst(statuses: list[Status]) -> Status:
    if not statuses:
        return Status.PASS
    return max(statuses, key=lambda s: STATUS_SEVERITY[s])


CHECK_IDS: tuple[str, ...] = ("ssh", "os", "rdma", "thunderbolt", "software", "model", "env", "resources")


@dataclass(frozen=True)
class CheckResult:
    """The verdict of one check on one node. `evidence` is JSON-serialisable."""

    id: str
    node: str
    status: Status
    summary: str
    remedy: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": str(self.status),
            "summary": self.summary,
            "remedy": self.remedy,
            "evidence": self.evidence,
        }


@dataclass(frozen=True)
class LintResult:
    id: str
    status: Status
    summary: str
    remedy: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "status": str(self.status), "summary": self.summary, "remedy": self.remedy}


@dataclass(frozen=True)
class PreflightReport:
    nodes: tuple[tuple[str, tuple[CheckResult, ...]], ...]
    lint: tuple[LintResult, ...]

    def all_statuses(self) -> list[Status]:
        return [c.status for _, checks in self.nodes for c in checks] + [lint.status for lint in self.lint]

    def counts(self) -> dict[str, int]:
        counts = {str(s): 0 for s in (Status.PASS, Status.WARN, Status.FAIL, Status.ERROR, Status.SKIP)}
        for status in self.all_statuses():
            counts[str(status)] += 1
        return counts

    def ok(self, *, strict: bool = False) -> bool:
        """No fail and no error; with `strict`, no warning either."""
        bad = {Status.FAIL, Status.ERROR} | ({Status.WARN} if strict else set())
        return not any(s in bad for s in self.all_statuses())

    def to_json(self, *, strict: bool = False) -> dict[str, Any]:
        return {
            "ok": self.ok(strict=strict),
            "summary": self.counts(),
            "nodes": [{"node": name, "checks": [c.to_json() for c in checks]} for name, checks in self.nodes],
            "lint": [lint.to_json() for lint in self.lint],
        }


# --- what the transport answers (records only: the I/O that makes them is coordinator.fleet.transport) ------------


@dataclass(frozen=True)
class RemoteResult:
    """What one command did on one node. `exit_status` is None when the process was killed by a signal."""

    node: str
    argv: tuple[str, ...]
    exit_status: int | None
    stdout: str
    stderr: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


@dataclass(frozen=True)
class ConnectInfo:
    node: str
    connect_s: float  # TCP + handshake + auth
    rtt_ms: float  # one exec round trip over the established connection
    host_key: str | None  # "ssh-ed25519 SHA256:..." fingerprint; None for local
    host_key_recorded: bool = False  # the key was unknown and --accept-new-host-keys recorded it


K = TypeVar("K", bound=Hashable)


def majority(values: Mapping[str, K]) -> tuple[K | None, list[str]]:
    """The value held by strictly more nodes than any other, and the nodes that differ from it.

    With a tie (e.g. two nodes that disagree) there is no majority: (None, every node not in the largest
    group... i.e. all disagreeing nodes), so both are suspect.
    """
    if not values:
        return None, []
    counts = Counter(values.values()).most_common()
    if len(counts) == 1:
        return counts[0][0], []
    if counts[0][1] > counts[1][1]:
        winner = counts[0][0]
        return winner, [name for name, v in values.items() if v != winner]
    return None, list(values)
