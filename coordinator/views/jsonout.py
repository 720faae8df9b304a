"""What every verb's `--json` prints, as pydantic models: the one contract for users' scripts, and the source of
docs/json.md (generated: `python -m coordinator.views.jsonout > docs/json.md`; tests/unit/test_jsonout.py fails when
the file differs).

The typed records print themselves (`to_json` on models.PreflightReport, launch.RunSummary, ...); the models
here describe those documents, key by key, with `extra="forbid"`: a key a writer adds or renames without
changing its model here fails `validate_output` in the tests that run each verb for real.

The vocabulary (VOCABULARY below, also at the top of docs/json.md): a node is named by `node`; a duration in
seconds ends in `_s` (`_ms` for milliseconds); a rate ends in `_per_s` with its unit before it (`tokens_per_s`,
`bytes_per_s`, `gbit_per_s`); a size names its unit (`_bytes`). Points in time are Unix seconds (`t`,
`expires`). `facts --json` is the exception that proves the rule: it prints the parsed fact records as they are
(coordinator/facts/model.py), whose fields keep the units the node reports (`speed_gbps`, `speed_mbps`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from coordinator.facts.model import NodeFacts

Verdict = Literal["pass", "warn", "fail", "error", "skip"]
# A rank's verdict (coordinator.run.monitor.Verdict): the monitor's rules with the run's own thresholds.
RankVerdict = Literal["pending", "ok", "slow", "stalled", "hung", "dead"]
_RANK_RATE = ("the rank's rate: the median real tokens/s (padding excluded) of its last 20 steps, the same in "
              "every view (coordinator.run.replay)")
_RANK_VERDICT = "the rank's verdict: the monitor's rules with the run's own thresholds (playbook `faults:`)"
_PREDICTED = "calibration's prediction for the plan the run runs, in real tokens/s"
_RUN_RATE = "the run's rate: the median over its steps of all ranks' real tokens / step wall time"


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- preflight --------------------------------------------------------------------------------------------------


class CheckOut(_Out):
    id: str
    status: Verdict
    summary: str
    remedy: str
    evidence: dict[str, Any]


class PreflightNodeOut(_Out):
    node: str
    checks: list[CheckOut]


class LintOut(_Out):
    id: str
    status: Verdict
    summary: str
    remedy: str


class PreflightOut(_Out):
    """`preflight --json` (models.PreflightReport.to_json). `summary` counts the verdicts."""

    ok: bool
    summary: dict[str, int]
    nodes: list[PreflightNodeOut]
    lint: list[LintOut]


# --- calibrate --------------------------------------------------------------------------------------------------


class CurveOut(_Out):
    batch: int
    tokens_per_s: float = Field(description="measured by the bench: padded positions/s (every position of each "
                                            "row, padding included)")
    peak_memory_bytes: int


class CalibratedNodeOut(_Out):
    node: str
    tokens_per_s: float = Field(description="predicted at its planned batch, in real tokens/s (padding excluded)")
    batch_size: int
    share: float
    curve: list[CurveOut]


class PlanRowOut(_Out):
    node: str
    first_layer: int
    last_layer: int  # exclusive; a dp replica holds [0, layers)
    need_bytes: int  # predicted peak
    budget_bytes: int  # what the node can use (unified memory, GPU memory, or the cgroup limit below RAM)
    predicted_s: float | None  # a dp node's step; a pipeline stage's time per micro-batch (None: not measured)
    # A pipeline stage's predicted compute per step (forwards, backwards, update: the rest it waits); None for dp
    predicted_busy_s: float | None = None


class CandidateOut(_Out):
    label: str  # "dp on every node", "dp on a, b", "solo on a", "pipeline over a, b, c"
    strategy: Literal["dp", "pipeline", "fsdp"]
    nodes: list[str]
    fits: bool
    predicted_tokens_per_s: float | None
    note: str  # its numbers, or why it does not fit


class StrategyOut(_Out):
    """The strategy weighed (planning.strategy.StrategyChoice.to_json): the chosen plan, its table rows and
    every candidate. plan.json carries the same object under `strategy`."""

    requested: Literal["auto", "dp", "pipeline", "fsdp"]
    chosen: str
    strategy: Literal["dp", "pipeline", "fsdp"]
    nodes: list[str]
    predicted_tokens_per_s: float | None
    rows: list[PlanRowOut]
    micro_batches: int | None  # a pipeline's
    bubble: float | None  # (P - 1) / (M + P - 1)
    predicted_step_s: float | None = None  # a pipeline's simulated step (docs/pipeline.md#prediction)
    predicted_bubble: float | None = None  # its idle share over all stages
    activation_bytes: int | None = None  # one micro-batch's activation between neighbours, each way
    link_s: list[float | None] | None = None  # per link (stage i to i+1): one transfer's seconds; None: not measured
    schedule: Literal["1f1b"] | None
    layout: dict[str, Any]  # the worker's RunConfig.layout: {"kind": "dp"} or the pipeline's stages
    candidates: list[CandidateOut]
    reasons: list[str]  # one line per candidate, the chosen first


class CollectiveOut(_Out):
    """One exchange of the run's gradients between its ranks (planning.collective.CollectiveCost), measured by a
    timed all_sum between the nodes during calibration."""

    seconds: float = Field(description="one all_sum of the run's gradient bytes: the median of the timed ones, the "
                                       "slowest rank's")
    bytes: int = Field(description="the trainable gradients' bytes plus the loss (what one step all_sums)")
    ranks: int
    backend: str
    source: Literal["measured", "derived"]
    small_seconds: float | None = Field(description="a one-element all_sum: the exchange's latency term")
    samples: int
    nodes: list[str]
    cached: bool
    bandwidth_bytes_per_s: float | None = Field(description="the ring model's effective bandwidth read from the "
                                                            "two sizes (null: latency-bound)")
    latency_s: float | None = Field(description="the ring model's per-hop latency")


class RehearsalOut(_Out):
    """The run's first steps, timed before it starts, for ranks that share a machine (docs/calibration.md)."""

    steps: int
    tokens_per_s: float = Field(description="the prediction: median over the rehearsal's steps of all ranks' real "
                                "tokens / step time, moved to the tokens the run's steps carry (docs/calibration.md)")
    compute_tokens_per_s: float | None = Field(description="the same without the all_sum and the waiting")
    shared: str = Field(description="which nodes share which machine, in words")
    timed_tokens_per_s: float | None = Field(default=None, description="the rehearsal's own median rate, before it "
                                             "was moved to the run's tokens")
    step_tokens: list[float] | None = Field(default=None, description="[the rehearsal's, the run's] median real "
                                            "tokens a step; null where the run's were not counted (DPO)")


class PlanStepOut(_Out):
    """The predicted step in parts: step = the slowest node's compute + the gradient exchange; where ranks share a
    machine, the step a rehearsal of the run timed (`rehearsal`), the calibrated parts kept beside it."""

    predicted_s: float
    compute_s: float
    collective: CollectiveOut | None = Field(description="null: no exchange in the prediction (one rank, a fixed "
                                                         "split, a pipeline, or not measured)")
    collective_share: float = Field(description="the exchange's share of the predicted step, 0..1")
    rehearsal: RehearsalOut | None = Field(default=None, description="null: no rehearsal (no two ranks share a "
                                                                      "machine); else the prediction is its rate")


class CalibrateOut(_Out):
    """`calibrate --json` for a training playbook (calibrate.calibration_to_json; plan.json has the same rows).
    `strategy` where the playbook's `train.strategy` (auto, pipeline) was weighed."""

    nodes: list[CalibratedNodeOut]
    split: dict[str, float]
    predicted_tokens_per_s: float = Field(description=_PREDICTED + ", the gradient exchange included")
    step: PlanStepOut
    units: dict[str, str] = Field(description="the unit of each rate: a node's `tokens_per_s` is real tokens/s, "
                                              "its curve's is padded positions/s")
    strategy: StrategyOut | None = None


class MapCalibratedNodeOut(_Out):
    node: str
    examples_per_s: float
    rows: int
    shard: list[int]  # [start, end)
    share: float


class MapCalibrateOut(_Out):
    """`calibrate --json` for a map playbook (mapjob.calibrate_map)."""

    rows: int
    nodes: list[MapCalibratedNodeOut]
    split: dict[str, float]


# --- launch / attach: summary.json ------------------------------------------------------------------------------


class IncidentOut(_Out):
    kind: str
    node: str
    rank: int | None
    step: int | None
    detected_after_s: float | None
    evidence: Any
    action: str
    t: float


class LeftOutOut(_Out):
    node: str
    reason: str


class RecoveryOut(_Out):
    """A relaunch (job.py): the attempt it started, the culprits left out, where the failed attempt stood."""

    attempt: int
    culprits: list[str]
    failed_step: int
    nodes: list[str]
    # Absent when the run ended before the relaunch resumed (a refused resume) or before it ended:
    resumed_from: int | None = None  # the step the relaunch resumed from (0: from scratch)
    first_step_after_s: float | None = None  # from the fault's detection to the relaunch's first step


class SetAsideOut(_Out):
    node: str
    path: str
    reason: str


class ResumedFromOut(_Out):
    step: int
    checkpoint: str | None
    node: str | None
    from_scratch: bool
    set_aside: list[SetAsideOut]


class _SummaryOut(_Out):
    format: int
    run_id: str
    state: str
    split: dict[str, float]
    incidents: list[IncidentOut]
    run_dir: str
    message: str
    quarantined: list[str]
    degraded: bool
    left_out: list[LeftOutOut]


class RankSummaryOut(_Out):
    node: str
    rank: int
    batch_size: int | None
    state: str
    step: int
    loss: float | None
    tokens_per_s: float | None = Field(description=_RANK_RATE)
    verdict: RankVerdict | None = Field(description=_RANK_VERDICT)
    calibrated_tokens_per_s: float | None = Field(description="calibration's rate for its batch, real tokens/s")
    peak_memory_bytes: int | None
    planned_memory_bytes: int | None = Field(default=None, description=(
        "the plan's predicted peak for this node: a pipeline stage's need (None: a dp rank)"))
    checkpoint: str | None
    run_dir: str | None


class RunSummaryOut(_SummaryOut):
    """`launch --json` and `attach --json` of a training run: its summary.json (launch.RunSummary)."""

    nodes: list[RankSummaryOut]
    strategy: Literal["dp", "pipeline", "fsdp"] = "dp"  # the layout the ranks ran
    steps: int
    iters: int | None
    checkpoint: str | None
    tokens_per_s: float | None = Field(description=_RUN_RATE)
    predicted_tokens_per_s: float | None = Field(description=_PREDICTED)
    compute_tokens_per_s: float | None = Field(description=(
        "real tokens/s without the gradient all_sum: the median over steps of the ranks' tokens per second of "
        "compute (until each enters the collective)"))
    predicted_compute_tokens_per_s: float | None = Field(default=None, description=(
        "the prediction without the gradient exchange (the slowest node's calibrated compute), where the "
        "prediction holds a measured all_sum (docs/calibration.md); null where it has none: one rank, a fixed "
        "split, or an exchange not measured"))
    rehearsed_steps: int | None = Field(default=None, description=(
        "the steps of the rehearsal whose rate is the prediction (ranks that share a machine: the run's first steps "
        "timed before it, docs/calibration.md); null: the prediction is calibration's"))
    attempts: int
    recoveries: list[RecoveryOut]
    resumed_from: ResumedFromOut | None
    stages: StageViewOut | None = None  # the final attempt's stages and memory against the plan


class MapNodeSummaryOut(_Out):
    node: str
    state: str
    rows: int
    rows_done: int
    ranges: list[list[int]]
    examples_per_s_calibrated: float | None
    rows_per_s: float | None
    finished_after_s: float | None
    error: str | None


class ReassignmentOut(_Out):
    from_: str = Field(alias="from")  # the node whose rows moved
    rows: int
    to: dict[str, list[list[int]]]


class MapSummaryOut(_SummaryOut):
    """`launch --json` of a map run: its summary.json (mapjob.MapSummary)."""

    kind: Literal["map"]
    nodes: list[MapNodeSummaryOut]
    rows: int
    rows_done: int
    steps: int  # = rows_done, for readers of a training summary
    output: str | None
    manifest: str | None
    finish_spread: float | None  # (latest - earliest) / latest finish time: a fraction, no unit
    reassignments: list[ReassignmentOut]


# --- status -----------------------------------------------------------------------------------------------------


class MemoryOut(_Out):
    total_bytes: int | None
    used_bytes: int | None
    pressure: str | None
    pressure_level: int | None


class DiskOut(_Out):
    path: str | None
    free_bytes: int | None


class RankStageOut(_Out):
    """One rank of the stage view (coordinator.run.stages): its stage and layers (None outside a pipeline), the
    medians of its newest 20 steps and its memory against the plan."""

    rank: int
    node: str
    stage: int | None
    first_layer: int | None
    last_layer: int | None  # exclusive
    step_time_s: float | None
    busy_s: float | None = Field(description="its own computation per step: forwards, backwards, the update")
    wait_s: float | None = Field(description="blocked on its neighbours per step: transfers, the closing all_sum")
    busy_share: float | None = Field(description="busy_s / step_time_s (median over its newest steps)")
    wait_share: float | None = Field(description="wait_s / step_time_s: this stage's bubble")
    predicted_busy_s: float | None = Field(description="the plan's compute per step (else its stage time per "
                                                       "micro-batch x micro-batches)")
    peak_memory_bytes: int | None = Field(description="the highest peak memory the rank reported")
    predicted_memory_bytes: int | None = Field(description="the plan's predicted peak for its node")
    budget_bytes: int | None = Field(description="its node's memory budget in the plan")


class StageViewOut(_Out):
    """A run's stages and memory against its plan (coordinator.run.stages.StageView), the same in every view."""

    kind: Literal["dp", "pipeline", "fsdp"]
    micro_batches: int | None
    schedule: str | None
    bubble: float | None = Field(description="measured: the stages' mean wait share of a step")
    predicted_bubble: float | None = Field(description="the plan's (P - 1) / (M + P - 1)")
    bottleneck: int | None = Field(description="the rank whose stage is busiest per step (paces the pipeline)")
    ranks: list[RankStageOut]


class NodeRunOut(_Out):
    run_id: str
    active: bool
    state: str
    rank: int | None
    step: int | None
    tokens_per_s: float | None = Field(description=_RANK_RATE)
    last_heartbeat_age_s: float | None
    verdict: RankVerdict | None = Field(description=_RANK_VERDICT)
    predicted_tokens_per_s: float | None = Field(description="the run's: " + _PREDICTED)
    stage: RankStageOut | None  # its rank's row of the run's stage view


class QuarantineFlagOut(_Out):
    quarantined: bool
    reason: str | None


class StatusNodeOut(_Out):
    node: str
    host: str
    reachable: bool
    error: str | None
    os: str | None
    chip: str | None
    memory: MemoryOut
    load: list[float] | None  # 1, 5, 15 minute load averages
    cpu_count: int | None
    gpu_utilization_pct: float | None
    power: str | None
    disk: DiskOut
    run: NodeRunOut | None
    quarantine: QuarantineFlagOut
    fact_errors: list[str]


class RankStatusOut(_Out):
    rank: int
    node: str
    state: str
    step: int
    tokens_per_s: float | None = Field(description=_RANK_RATE)
    loss: float | None
    last_heartbeat_age_s: float | None
    verdict: RankVerdict = Field(description=_RANK_VERDICT)


class IncidentNoteOut(_Out):
    kind: str
    node: str
    rank: int | None
    step: int | None
    action: str
    summary: str


class RunStatusOut(_Out):
    run_id: str
    active: bool
    state: str
    step: int
    iters: int | None
    nodes: list[str]
    ranks: list[RankStatusOut]
    incident_counts: dict[str, int]
    incidents: list[IncidentNoteOut]
    degraded: bool
    left_out: list[LeftOutOut]
    tokens_per_s: float | None = Field(description=_RUN_RATE)
    predicted_tokens_per_s: float | None = Field(description=_PREDICTED)
    stages: StageViewOut


class StatusOut(_Out):
    """`status --json` (coordinator.views.status.StatusReport): every node's row and the active runs."""

    nodes: list[StatusNodeOut]
    runs: list[RunStatusOut]
    warnings: list[str]


# --- nettest ----------------------------------------------------------------------------------------------------


class LinkEndOut(_Out):
    node: str
    ip: str
    kind: str
    speed_gbit_per_s: float | None
    interface: str | None
    port: str | None
    driver: str | None
    note: str


class LinkOut(_Out):
    kind: str
    speed_gbit_per_s: float | None
    ends: list[LinkEndOut]


class MeasurementOut(_Out):
    rtt_ms: float
    rtt_min_ms: float
    rtt_max_ms: float
    a_to_b_bytes_per_s: float
    b_to_a_bytes_per_s: float
    a_to_b_gbit_per_s: float
    b_to_a_gbit_per_s: float
    duration_s: float


class PairOut(_Out):
    a: str
    b: str
    a_ip: str
    b_ip: str
    link: LinkOut
    status: Verdict
    summary: str
    measurement: MeasurementOut | None
    error: str | None


class GpuBusOut(_Out):
    """NCCL all-reduce between the GPUs of one node (nettest.GpuBusResult); bandwidths in bytes/second."""

    node: str
    devices: list[str]
    status: Verdict
    summary: str
    busbw_bytes_per_s: float | None
    algbw_bytes_per_s: float | None
    bytes: int | None
    error: str | None


class NettestOut(_Out):
    """`nettest --json` (nettest.NettestReport)."""

    ok: bool
    summary: dict[str, int]
    duration_s: float
    pairs: list[PairOut]
    gpus: list[GpuBusOut]
    node_errors: dict[str, str]


# --- quarantine list --------------------------------------------------------------------------------------------


class QuarantineEntryOut(_Out):
    node: str
    inventory: str | None  # None: an old-format entry (any inventory)
    host: str | None
    host_key: str | None
    reason: str
    run_id: str | None
    t: float
    age_s: float
    expires: float | None
    expires_in_s: float | None
    legacy: bool


class QuarantineListOut(_Out):
    """`quarantine list --json` (quarantine.Entry.to_json)."""

    entries: list[QuarantineEntryOut]


# --- sync -------------------------------------------------------------------------------------------------------


class SyncNodeOut(_Out):
    node: str
    copy_: list[str] = Field(alias="copy")  # the files it receives
    files: int
    bytes: int
    resumed_bytes: int
    delete: list[str]  # extras and useless partials, deleted before the copy
    delete_files: int
    delete_bytes: int
    disk_problem: str | None


class SyncDoubtfulOut(_Out):
    """A deletion refused without `--delete-extras` (docs/sync.md#doubtful-deletions)."""

    node: str
    dir: str  # the synced dir's label: model, data, reference
    files: int  # files it would delete there
    bytes: int
    held_files: int  # files the node holds there
    held_bytes: int
    source_files: int  # files the source holds there


class SyncPlanOut(_Out):
    source: str
    files: int
    bytes: int
    stream_bytes: int
    chain: list[str]
    nodes: list[SyncNodeOut]
    problems: list[str]
    doubtful: list[SyncDoubtfulOut]


class SyncOut(_Out):
    """`sync --json` (coordinator.fleet.syncrun.SyncReport)."""

    ok: bool
    check: bool
    plan: SyncPlanOut | None
    errors: dict[str, str]
    verified: dict[str, bool]
    differences: dict[str, list[str]]
    sent_bytes: int
    elapsed_s: float
    transfer_s: float
    refused: dict[str, list[str]]
    fallback: dict[str, str]
    refusal: str | None  # the doubtful deletions were not confirmed: nothing changed (exit 2)
    recovered: dict[str, str]  # node -> an error on the way that its verified-identical end outlived


# --- setup ------------------------------------------------------------------------------------------------------


class PinsOut(_Out):
    mlx: str
    mlx_lm: str
    source: str


class NodeSetupOut(_Out):
    node: str
    status: Literal["ok", "changed", "failed"]
    actions: list[str]
    message: str
    platform: str | None


class SetupOut(_Out):
    """`setup --json` (nodesetup.SetupReport)."""

    pins: PinsOut
    check: bool
    nodes: list[NodeSetupOut]
    summary: dict[str, int]


class AddressOut(_Out):
    interface: str
    address: str
    peer: str
    peer_address: str


class NodeNetSetupOut(_Out):
    node: str
    status: Literal["ok", "changed", "failed"]
    commands: list[str]
    addresses: list[AddressOut]
    message: str


class NetSetupOut(_Out):
    """`setup --network --json` (netsetup.NetworkReport)."""

    applied: bool
    nodes: list[NodeNetSetupOut]
    summary: dict[str, int]


# --- hostfile ---------------------------------------------------------------------------------------------------


class HostOut(_Out):
    ssh: str
    ips: list[str]
    rdma: list[str | list[str] | None] | None = None


class HostfileOut(_Out):
    """`hostfile` (always JSON): mlx.launch's hostfile format (hostfile.Hostfile), not ours: `ssh` names a host."""

    backend: str
    envs: list[str]
    hosts: list[HostOut]


# --- facts ------------------------------------------------------------------------------------------------------


class UnreachableOut(_Out):
    node: str
    unreachable: str


class FactsOut(_Out):
    """`facts --json`: each node's parsed facts (facts.model.NodeFacts; `raw`/`raw_rc` only with --raw), or why
    it gave none."""

    nodes: list[NodeFacts | UnreachableOut]


# --- the registry, validation and docs/json.md ------------------------------------------------------------------


@dataclass(frozen=True)
class VerbOutput:
    command: str  # as a user types it
    models: tuple[type[BaseModel], ...]  # one of these describes the output


class ExportOut(_Out):
    """`export RUN_ID --json` (coordinator.run.export.ExportResult)."""

    run_id: str
    out: str = Field(description="the local dir written: a model dir (full) or an adapter dir (LoRA)")
    node: str = Field(description="the node that assembled it (the run's first node)")
    kind: Literal["sharded", "whole"] = Field(description="sharded: a pipeline's or fsdp's checkpoint, assembled "
                                              "from its shards; whole: a dp run's")
    step: int = Field(description="the step of the newest complete checkpoint")
    method: str = Field(description="fine_tune_type: full, lora or dora")
    files: list[str]
    gathered_from: list[str] = Field(description="the nodes whose shards were copied to the assembler")


VERBS: dict[str, VerbOutput] = {
    "facts": VerbOutput("coordinator facts -i INV --json", (FactsOut,)),
    "preflight": VerbOutput("coordinator preflight -i INV -p PB --json", (PreflightOut,)),
    "calibrate": VerbOutput("coordinator calibrate -i INV -p PB --json", (CalibrateOut, MapCalibrateOut)),
    "hostfile": VerbOutput("coordinator hostfile -i INV -p PB", (HostfileOut,)),
    "launch": VerbOutput("coordinator launch -i INV -p PB --json  (and attach RUN_ID --json)",
                         (RunSummaryOut, MapSummaryOut)),
    "status": VerbOutput("coordinator status -i INV --json", (StatusOut,)),
    "nettest": VerbOutput("coordinator nettest -i INV --json", (NettestOut,)),
    "quarantine list": VerbOutput("coordinator quarantine list --json", (QuarantineListOut,)),
    "sync": VerbOutput("coordinator sync -i INV -p PB --json", (SyncOut,)),
    "setup": VerbOutput("coordinator setup -i INV --json", (SetupOut,)),
    "setup --network": VerbOutput("coordinator setup -i INV --network --json", (NetSetupOut,)),
    "export": VerbOutput("coordinator export RUN_ID --json", (ExportOut,)),
}

_FACTS = TypeAdapter(NodeFacts)


def _facts_drift(doc: Any) -> list[str]:
    """NodeFacts is a dataclass, which pydantic validates without forbidding unknown keys: a fact row must also
    come back unchanged from a validate/dump round trip (a key it does not know would be dropped)."""
    problems = []
    for i, row in enumerate(doc.get("nodes", []) if isinstance(doc, dict) else []):
        if isinstance(row, dict) and "unreachable" not in row:
            back = _FACTS.dump_python(_FACTS.validate_python(row), mode="json")
            if "raw" not in row:
                back.pop("raw", None)
                back.pop("raw_rc", None)
            for key in sorted(set(row) ^ set(back)):
                problems.append(f"nodes[{i}].{key}: not a NodeFacts field" if key in row else
                                f"nodes[{i}].{key}: missing")
    return problems


def validate_output(verb: str, doc: Any) -> BaseModel:
    """The model of `verb`'s JSON that `doc` (a decoded output) satisfies; ValueError naming every key that does
    not fit otherwise (for each of the verb's models)."""
    errors = []
    for model in VERBS[verb].models:
        try:
            parsed = model.model_validate(doc)
        except ValidationError as exc:
            errors.append(f"{model.__name__}: {exc}")
            continue
        drift = _facts_drift(doc) if model is FactsOut else []
        if not drift:
            return parsed
        errors.append(f"{model.__name__}: " + "; ".join(drift))
    raise ValueError(f"`{verb} --json` does not match docs/json.md:\n" + "\n".join(errors))


def render_docs() -> str:
    """docs/json.md, generated from VERBS."""
    out = [
        "# JSON output of every verb",
        "",
        "<!-- Generated by `python -m coordinator.views.jsonout > docs/json.md` from coordinator/views/jsonout.py: do not edit."
        " -->",
        "",
        "Every verb's `--json` prints one JSON document on stdout (progress goes to stderr). One vocabulary:",
        "",
        "- a node is named by the key `node`, everywhere;",
        "- a duration in seconds ends in `_s` (`duration_s`, `age_s`, `detected_after_s`), in milliseconds in `_ms`;",
        "- a rate ends in `_per_s`, its unit before it (`tokens_per_s`, `a_to_b_bytes_per_s`, `speed_gbit_per_s`);",
        "- a size names its unit (`peak_memory_bytes`, `sent_bytes`, `free_bytes`);",
        "- a point in time is Unix seconds (`t`, `expires`); a check's verdict is `pass|warn|fail|error|skip`, a",
        "  rank's `pending|ok|slow|stalled|hung|dead` (the monitor's rules with the run's own thresholds);",
        "- a rank's or a run's `tokens_per_s` counts real tokens (padding excluded), the same value in every view;",
        "  calibration's curve counts padded positions (plan.json and `calibrate --json` say so in `units`).",
        "",
        "`facts --json` prints the parsed fact records as they are (`coordinator/facts/model.py`), whose fields keep",
        "the unit the node reports (`speed_gbps`, `speed_mbps`). `hostfile` prints mlx.launch's own format.",
        "",
        "Run files (`runs/<id>/summary.json`, `plan.json`) are written in the same vocabulary (format 3, see",
        "docs/architecture.md); `launch --json` prints summary.json.",
        "",
        "Each schema below is JSON Schema (draft 2020-12) as pydantic generates it. A key not listed is a bug:",
        "the tests run every verb for real and validate its output against these models, unknown keys refused",
        "(tests/integration/test_json_output.py and the integration tests of launch, attach and setup).",
    ]
    for verb, spec in VERBS.items():
        out += ["", f"## {verb}", "", f"`{spec.command}`", ""]
        for model in spec.models:
            doc = (model.__doc__ or "").strip().split("\n\n")[0]
            out += [f"### {model.__name__}", "", " ".join(doc.split()), "", "```json",
                    json.dumps(model.model_json_schema(by_alias=True), indent=2), "```", ""]
        while out[-1] == "":
            out.pop()
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_docs())
