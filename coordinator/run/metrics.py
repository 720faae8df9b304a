"""What `coordinator status`, `coordinator monitor` and the Prometheus exporter show, and the exporter itself.

The status records (`NodeStatus`, `RunStatus`, `RankStatus`) are plain frozen values built by pure functions
(`coordinator.views.status.build_*`, `run_status_from_monitor` here); the exporter turns the latest records
into Prometheus metrics on each scrape.

Exporter: `MetricsServer(port, host="127.0.0.1")` serves `/metrics` from a PRIVATE `CollectorRegistry` (no
global state: two servers in one process never mix) in a daemon thread, and `close()` stops it. Updates
replace a snapshot under a lock, so a scrape always sees one consistent picture (never a half-cleared gauge).
`MetricsUI(inner, server)` is a `coordinator.run.job.JobUI` that forwards everything to `inner` and feeds the
exporter from the launch loop's `Monitor`.

Metric names follow Prometheus conventions (base units, `_ratio` for 0..1, `_total` for counters):

    mlxc_node_up{node}                                1 when the node answered the probe
    mlxc_node_memory_used_bytes{node}                 mlxc_node_memory_total_bytes{node}
    mlxc_node_memory_pressure_level{node}             macOS level: 1 normal, 2 warn, 4 critical
    mlxc_node_load1{node}                             1-minute load average
    mlxc_node_gpu_utilization_ratio{node}             0..1
    mlxc_node_disk_free_bytes{node}
    mlxc_node_quarantined{node}                       1 when quarantined
    mlxc_run_active{run_id}                           1 while the run has no summary
    mlxc_run_step{run_id}                             the step every rank has reached
    mlxc_run_iters{run_id}
    mlxc_rank_step{run_id,rank,node}
    mlxc_rank_tokens_per_second{run_id,rank,node}
    mlxc_rank_loss{run_id,rank,node}
    mlxc_rank_last_heartbeat_age_seconds{run_id,rank,node}
    mlxc_run_incidents_total{run_id,kind}

A value that is unknown (no GPU statistics, a node that did not answer) is left out, never exported as 0.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.errors import ConfigError
from coordinator.models import DEFAULT_METRICS_HOST, PreflightReport
from coordinator.planning.plan import NodeCalibration, Plan
from coordinator.planning.shards import MapRow
from coordinator.run.job import JobUI
from coordinator.run.monitor import Monitor
from coordinator.run.replay import judge_monitor
from coordinator.run.stages import RankStage, StageView

# --- status records (pure values) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankStatus:
    """One rank of a run as last reported. `last_heartbeat_age_s` is seconds since its newest event;
    `tokens_per_s` and `verdict` are the run's one judgement of the rank (coordinator.run.replay: real tokens/s)."""

    rank: int
    node: str
    state: str  # pending | running | finished | failed
    step: int = 0
    tokens_per_s: float | None = None
    loss: float | None = None
    last_heartbeat_age_s: float | None = None
    verdict: str = "pending"  # coordinator.run.monitor.Verdict

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "state": self.state, "step": self.step,
                "tokens_per_s": _round(self.tokens_per_s, 1), "loss": _round(self.loss, 5),
                "last_heartbeat_age_s": _round(self.last_heartbeat_age_s, 1), "verdict": self.verdict}


@dataclass(frozen=True)
class IncidentNote:
    """An incident as shown to operators (the full evidence stays in events.jsonl / summary.json)."""

    kind: str
    node: str
    rank: int | None
    step: int | None
    action: str
    summary: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "node": self.node, "rank": self.rank, "step": self.step, "action": self.action,
                "summary": self.summary}


@dataclass(frozen=True)
class RunStatus:
    """A run: `active` while it has no summary.json (or while the launch loop watches it)."""

    run_id: str
    active: bool
    state: str  # running | succeeded | failed | stopped | unknown
    ranks: tuple[RankStatus, ...] = ()
    iters: int | None = None
    nodes: tuple[str, ...] = ()
    incident_counts: Mapping[str, int] = field(default_factory=dict)
    incidents: tuple[IncidentNote, ...] = ()  # the newest few
    left_out: tuple[tuple[str, str], ...] = ()  # (node, reason): inventory nodes the run started without
    tokens_per_s: float | None = None  # the run's rate (real tokens/s: Monitor.run_tokens_per_s)
    predicted_tokens_per_s: float | None = None  # calibration's, for the plan the attempt runs
    recorded_steps: int | None = None  # an ended run's summary.json `steps` (what the nodes prove)
    # Each rank's stage, layers, busy and wait shares, the bubble and the memory against the plan (run.stages)
    stages: StageView = field(default_factory=StageView)

    @property
    def step(self) -> int:
        """The step every rank has reached (a synchronous job moves together); once the run ended, its record's."""
        if self.recorded_steps is not None:
            return self.recorded_steps
        return min((r.step for r in self.ranks), default=0)

    def rank_of(self, node: str) -> RankStatus | None:
        return next((r for r in self.ranks if r.node == node), None)

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "active": self.active, "state": self.state, "step": self.step,
                "iters": self.iters, "nodes": list(self.nodes), "ranks": [r.to_json() for r in self.ranks],
                "incident_counts": dict(self.incident_counts), "incidents": [i.to_json() for i in self.incidents],
                "degraded": bool(self.left_out), "left_out": [{"node": n, "reason": r} for n, r in self.left_out],
                "tokens_per_s": _round(self.tokens_per_s, 1),
                "predicted_tokens_per_s": _round(self.predicted_tokens_per_s, 1), "stages": self.stages.to_json()}


@dataclass(frozen=True)
class NodeRun:
    """The run a node takes part in (its newest), as shown on the node's status row."""

    run_id: str
    active: bool
    state: str
    rank: int | None
    step: int | None
    tokens_per_s: float | None
    last_heartbeat_age_s: float | None
    verdict: str | None = None  # the rank's (RankStatus.verdict)
    predicted_tokens_per_s: float | None = None  # the run's prediction (RunStatus), finished runs' included
    stage: RankStage | None = None  # the rank's row of the run's stage view (RunStatus.stages)

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "active": self.active, "state": self.state, "rank": self.rank,
                "step": self.step, "tokens_per_s": _round(self.tokens_per_s, 1),
                "last_heartbeat_age_s": _round(self.last_heartbeat_age_s, 1), "verdict": self.verdict,
                "predicted_tokens_per_s": _round(self.predicted_tokens_per_s, 1),
                "stage": self.stage.to_json() if self.stage is not None else None}


@dataclass(frozen=True)
class NodeStatus:
    """One status row. An unreachable node has `reachable=False`, `error` set and every fact None."""

    node: str
    host: str
    reachable: bool
    error: str | None = None
    os: str | None = None  # "macOS 26.5 (25F71)", "Debian GNU/Linux 12 (bookworm)"
    chip: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_pressure: str | None = None  # normal | warn | critical (macOS); None when the OS does not say
    memory_pressure_level: int | None = None
    load: tuple[float, float, float] | None = None  # 1, 5, 15 minute load averages
    cpu_count: int | None = None
    gpu_utilization_pct: float | None = None
    power: str | None = None  # "never sleeps", "sleeps after 10 min, on battery 80%", ...
    disk_free_bytes: int | None = None
    disk_path: str | None = None
    run: NodeRun | None = None
    quarantined: bool = False
    quarantine_reason: str | None = None
    fact_errors: tuple[str, ...] = ()  # sections that could not be parsed ("sysctl: ...")

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node, "host": self.host, "reachable": self.reachable, "error": self.error, "os": self.os,
            "chip": self.chip,
            "memory": {"total_bytes": self.memory_total_bytes, "used_bytes": self.memory_used_bytes,
                       "pressure": self.memory_pressure, "pressure_level": self.memory_pressure_level},
            "load": list(self.load) if self.load is not None else None, "cpu_count": self.cpu_count,
            "gpu_utilization_pct": self.gpu_utilization_pct, "power": self.power,
            "disk": {"path": self.disk_path, "free_bytes": self.disk_free_bytes},
            "run": self.run.to_json() if self.run is not None else None,
            "quarantine": {"quarantined": self.quarantined, "reason": self.quarantine_reason},
            "fact_errors": list(self.fact_errors),
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def run_status_from_monitor(run_id: str, mon: Monitor, now: float, *, recent: int = 5,
                            predicted: float | None = None) -> RunStatus:
    """The launch loop's live `Monitor` as a `RunStatus`. `now` is on the monitor's clock (monotonic), as
    `JobUI.progress(monitor, now)` receives it."""
    outcome = mon.outcome()
    judged = judge_monitor(mon, now=now if outcome is None else None, predicted=predicted)
    ranks = tuple(
        RankStatus(rank=j.rank, node=j.node, state=j.state, step=j.step, tokens_per_s=j.tokens_per_s,
                   loss=j.loss, last_heartbeat_age_s=None if j.last_t is None else max(0.0, now - j.last_t),
                   verdict=str(j.verdict))
        for j in judged.ranks)
    counts = Counter(str(i.kind) for i in mon.incidents)
    notes = tuple(IncidentNote(str(i.kind), i.node, i.rank, i.step, str(i.action), str(i.evidence)[:200])
                  for i in mon.incidents[-recent:])
    return RunStatus(run_id=run_id, active=outcome is None, state=str(outcome or "running"), ranks=ranks,
                     iters=mon.iters, nodes=tuple(dict.fromkeys(v.node for v in mon.ranks.values())),
                     incident_counts=dict(counts), incidents=notes, tokens_per_s=judged.tokens_per_s,
                     predicted_tokens_per_s=judged.predicted_tokens_per_s, stages=judged.stages)


# --- the Prometheus side (pure: records in, metric families out) -----------------------------------------------


def build_metric_families(nodes: Sequence[NodeStatus], runs: Sequence[RunStatus]) -> list[Metric]:
    """Every metric for the given records. Unknown values are left out (an absent sample, not a 0)."""
    def gauge(name: str, doc: str, labels: Sequence[str]) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=list(labels))

    up = gauge("mlxc_node_up", "1 when the node answered the status probe.", ["node"])
    mem_used = gauge("mlxc_node_memory_used_bytes", "Memory in use.", ["node"])
    mem_total = gauge("mlxc_node_memory_total_bytes", "Physical memory.", ["node"])
    pressure = gauge("mlxc_node_memory_pressure_level",
                     "macOS memory pressure level (1 normal, 2 warn, 4 critical).", ["node"])
    load1 = gauge("mlxc_node_load1", "1-minute load average.", ["node"])
    gpu = gauge("mlxc_node_gpu_utilization_ratio", "GPU utilisation, 0..1.", ["node"])
    disk = gauge("mlxc_node_disk_free_bytes", "Free bytes on the workdir's filesystem.", ["node"])
    quarantined = gauge("mlxc_node_quarantined", "1 when the node is quarantined.", ["node"])
    for n in nodes:
        up.add_metric([n.node], 1.0 if n.reachable else 0.0)
        quarantined.add_metric([n.node], 1.0 if n.quarantined else 0.0)
        for family, value in ((mem_used, n.memory_used_bytes), (mem_total, n.memory_total_bytes),
                              (pressure, n.memory_pressure_level), (load1, n.load[0] if n.load else None),
                              (gpu, None if n.gpu_utilization_pct is None else n.gpu_utilization_pct / 100.0),
                              (disk, n.disk_free_bytes)):
            if value is not None:
                family.add_metric([n.node], float(value))

    active = gauge("mlxc_run_active", "1 while the run is in progress.", ["run_id"])
    run_step = gauge("mlxc_run_step", "The step every rank of the run has reached.", ["run_id"])
    run_iters = gauge("mlxc_run_iters", "The run's planned steps.", ["run_id"])
    rank_labels = ["run_id", "rank", "node"]
    rank_step = gauge("mlxc_rank_step", "The rank's last reported step.", rank_labels)
    rank_tok = gauge("mlxc_rank_tokens_per_second",
                     "The rank's rate: the median real tokens/s of its last steps (coordinator.run.replay).",
                     rank_labels)
    rank_loss = gauge("mlxc_rank_loss", "The rank's last reported training loss.", rank_labels)
    rank_beat = gauge("mlxc_rank_last_heartbeat_age_seconds", "Seconds since the rank's newest event.", rank_labels)
    incidents = CounterMetricFamily("mlxc_run_incidents", "Incidents detected in the run, by kind.",
                                    labels=["run_id", "kind"])
    # A pipeline's stages, from the run's one stage view (coordinator.run.stages), as status and the dashboard show.
    stage_labels = ["run_id", "rank", "node", "stage"]
    stage_busy = gauge("mlxc_stage_busy_share", "The stage's own computation, a share of its step time.", stage_labels)
    stage_wait = gauge("mlxc_stage_wait_share", "The stage's wait on its neighbours, a share of its step time.",
                       stage_labels)
    stage_busy_s = gauge("mlxc_stage_busy_seconds", "The stage's computation per step (median of its last steps).",
                         stage_labels)
    stage_plan_s = gauge("mlxc_stage_predicted_busy_seconds", "The plan's computation per step for the stage.",
                         stage_labels)
    stage_peak = gauge("mlxc_stage_peak_memory_bytes", "The stage's peak memory.", stage_labels)
    stage_need = gauge("mlxc_stage_predicted_memory_bytes", "The plan's peak memory for the stage.", stage_labels)
    bubble = gauge("mlxc_run_bubble_ratio", "A pipeline's measured bubble: the stages' mean wait share.", ["run_id"])
    plan_bubble = gauge("mlxc_run_predicted_bubble_ratio", "The plan's bubble, (P-1)/(M+P-1).", ["run_id"])
    bottleneck = gauge("mlxc_run_bottleneck_stage", "The stage that paces the pipeline.", ["run_id"])
    for run in runs:
        active.add_metric([run.run_id], 1.0 if run.active else 0.0)
        run_step.add_metric([run.run_id], float(run.step))
        if run.iters is not None:
            run_iters.add_metric([run.run_id], float(run.iters))
        for r in run.ranks:
            labels = [run.run_id, str(r.rank), r.node]
            rank_step.add_metric(labels, float(r.step))
            for family, value in ((rank_tok, r.tokens_per_s), (rank_loss, r.loss), (rank_beat, r.last_heartbeat_age_s)):
                if value is not None:
                    family.add_metric(labels, float(value))
        for kind, count in sorted(run.incident_counts.items()):
            incidents.add_metric([run.run_id, kind], float(count))
        view = run.stages
        if not view.pipeline:
            continue
        for family, value in ((bubble, view.bubble), (plan_bubble, view.predicted_bubble),
                              (bottleneck, view.bottleneck)):
            if value is not None:
                family.add_metric([run.run_id], float(value))
        for st in view.ranks:
            if st.stage is None:
                continue
            labels = [run.run_id, str(st.rank), st.node, str(st.stage)]
            for family, value in ((stage_busy, st.busy_share), (stage_wait, st.wait_share), (stage_busy_s, st.busy_s),
                                  (stage_plan_s, st.predicted_busy_s), (stage_peak, st.peak_memory_bytes),
                                  (stage_need, st.predicted_memory_bytes)):
                if value is not None:
                    family.add_metric(labels, float(value))
    return [up, mem_used, mem_total, pressure, load1, gpu, disk, quarantined, active, run_step, run_iters, rank_step,
            rank_tok, rank_loss, rank_beat, incidents, stage_busy, stage_wait, stage_busy_s, stage_plan_s, stage_peak,
            stage_need, bubble, plan_bubble, bottleneck]


class _StatusCollector(Collector):
    """Serves the newest snapshot; replaced whole under a lock so a scrape never sees a half update."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: tuple[NodeStatus, ...] = ()
        self._runs: dict[str, RunStatus] = {}

    def set_nodes(self, nodes: Iterable[NodeStatus]) -> None:
        with self._lock:
            self._nodes = tuple(nodes)

    def set_runs(self, runs: Iterable[RunStatus], *, replace: bool) -> None:
        with self._lock:
            fresh = {r.run_id: r for r in runs}
            self._runs = fresh if replace else {**self._runs, **fresh}

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            nodes, runs = self._nodes, tuple(self._runs.values())
        yield from build_metric_families(nodes, runs)


class MetricsServer:
    """A Prometheus endpoint at http://HOST:PORT/metrics serving a private registry, stoppable with `close()`.

    Binds 127.0.0.1 by default: the metrics name nodes and runs, so exposing them is an explicit choice
    (`--metrics-host 0.0.0.0`). `port=0` picks a free port (see `.port`). Raises `ConfigError` when the
    address cannot be bound (port in use, bad host)."""

    def __init__(self, port: int, host: str = DEFAULT_METRICS_HOST) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _StatusCollector()
        self.registry.register(self._collector)
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        self._server: WSGIServer | None = server
        self._thread = thread
        self.host = host
        self.port: int = int(server.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def update_nodes(self, nodes: Iterable[NodeStatus]) -> None:
        """Replace every node's metrics with these rows (a node left out disappears from the endpoint)."""
        self._collector.set_nodes(nodes)

    def update_runs(self, runs: Iterable[RunStatus], *, replace: bool = True) -> None:
        """Replace (or, with replace=False, add to) the runs shown."""
        self._collector.set_runs(runs, replace=replace)

    def update_run(self, monitor: Monitor, *, run_id: str, now: float, predicted: float | None = None) -> None:
        """Show the launch loop's live monitor as run `run_id` (other runs shown stay)."""
        self.update_runs([run_status_from_monitor(run_id, monitor, now, predicted=predicted)], replace=False)

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsUI:
    """A `JobUI` that forwards every call to `inner` and exports the run's progress on each `progress` call.

    The run id is not part of the `JobUI` protocol: it is taken from `run_id` when given, else from the
    "run <id>: ..." messages the job prints before each attempt, else "current"."""

    def __init__(self, inner: JobUI, server: MetricsServer, *, run_id: str | None = None) -> None:
        self.inner = inner
        self.server = server
        self.run_id = run_id
        self.predicted: float | None = None  # the plan's (`calibration`)

    def message(self, text: str) -> None:
        if self.run_id is None and text.startswith("run ") and ":" in text:
            self.run_id = text[4:].split(":", 1)[0].strip() or None
        self.inner.message(text)

    def preflight(self, report: PreflightReport) -> None:
        self.inner.preflight(report)

    def calibration(self, plan: Plan, calibrations: Mapping[str, NodeCalibration]) -> None:
        self.predicted = plan.predicted_tokens_per_s or None
        self.inner.calibration(plan, calibrations)

    def progress(self, monitor: Monitor, now: float) -> None:
        self.server.update_run(monitor, run_id=self.run_id or "current", now=now, predicted=self.predicted)
        self.inner.progress(monitor, now)

    def map_progress(self, rows: Sequence[MapRow], now: float) -> None:
        self.inner.map_progress(rows, now)

    def degraded(self, warning: str, nodes: Sequence[str]) -> None:
        self.inner.degraded(warning, nodes)

    def close(self) -> None:
        """Close the inner UI (when it has `close`); the server is the caller's to close."""
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()


__all__ = ["DEFAULT_METRICS_HOST", "IncidentNote", "MetricsServer", "MetricsUI", "NodeRun", "NodeStatus",
           "RankStatus", "RunStatus", "build_metric_families", "run_status_from_monitor"]
