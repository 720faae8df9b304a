"""Status rows (facts + run state + quarantine in, rows out), the events fold, and the metrics built from
scripted records and a scripted Monitor. Facts come from the recorded profiles through the real parsers."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from coordinator.errors import ConfigError
from coordinator.models import Inventory, Node
from coordinator.run.job import QuietUI
from coordinator.run.metrics import (
    MetricsServer,
    MetricsUI,
    NodeStatus,
    RankStatus,
    RunStatus,
    build_metric_families,
    run_status_from_monitor,
)
from coordinator.run.monitor import Monitor, Observation, PlannedRank
from coordinator.run.quarantine import Entry, QuarantineStore, inventory_key, new_entry
from coordinator.views.status import RunEvents, build_node_status, build_rows, build_run_status, node_run
from coordinator.views.statusview import render_run_table
from coordinator.views.statuswatch import RunWatcher, load_quarantine, read_new_lines
from tests.factsutil import MBP, OLD, facts_from, linux_sections, load_profile, profile_sections, worker_answer

MAC = Node(name="mac", host="10.0.0.2")
LIN = Node(name="lin", host="10.0.0.3")
DOWN = Node(name="down", host="10.0.0.4")
NOW = 1_000_000.0


def mac_facts(profile: str = MBP, **replace: str) -> Any:
    return facts_from("mac", profile_sections(profile, worker=worker_answer(), replace=replace))


def lin_facts(**replace: str) -> Any:
    sections = profile_sections(linux_sections(), worker=worker_answer(), replace=replace)
    return facts_from("lin", sections)


def run(active: bool = True, **kw: Any) -> RunStatus:
    ranks = (RankStatus(0, "mac", "running", 7, 1234.5, 2.5, 1.5), RankStatus(1, "lin", "running", 6, 900.0, 2.6, 0.5))
    return RunStatus(**{"run_id": "r1", "active": active, "state": "running" if active else "succeeded",
                        "ranks": ranks, "iters": 60, "nodes": ("mac", "lin"), "incident_counts": {}, **kw})


# --- rows ------------------------------------------------------------------------------------------------------


def test_mac_row_from_a_recorded_profile() -> None:
    row = build_node_status(MAC, mac_facts(), None, node_run([run()], "mac"), None)
    assert row.reachable and row.error is None
    assert row.os == "macOS 26.5 (25F71)" and row.chip == "Apple M5 Max"
    assert row.memory_total_bytes == 128 * 1024**3
    assert row.memory_used_bytes is not None and 0 < row.memory_used_bytes < row.memory_total_bytes
    assert row.memory_pressure in ("normal", "warn", "critical") and row.memory_pressure_level in (1, 2, 4)
    assert row.gpu_utilization_pct is not None and 0 <= row.gpu_utilization_pct <= 100
    assert row.power and row.disk_free_bytes and row.disk_free_bytes > 0
    assert row.load is None  # the recording's sysctl has no vm.loadavg: unknown
    assert row.run is not None and (row.run.run_id, row.run.rank, row.run.step) == ("r1", 0, 7)
    assert row.run.tokens_per_s == 1234.5 and row.run.last_heartbeat_age_s == 1.5
    assert not row.quarantined and row.fact_errors == ()


def test_mac_load_comes_from_vm_loadavg_when_the_sysctl_has_it() -> None:
    sysctl = load_profile(MBP)["sysctl"].text + "vm.loadavg: { 3.25 2.50 1.75 }\n"
    assert build_node_status(MAC, mac_facts(sysctl=sysctl), None, None, None).load == (3.25, 2.5, 1.75)
    broken = build_node_status(MAC, mac_facts(sysctl=load_profile(MBP)["sysctl"].text + "vm.loadavg: soon\n"),
                               None, None, None)
    assert broken.load is None and any(e.startswith("loadavg:") for e in broken.fact_errors)


def test_linux_row_has_loadavg_and_no_pressure_or_gpu() -> None:
    facts = lin_facts()
    row = build_node_status(LIN, facts, None, None, Entry("lin", "hang at step 3", "r0", NOW, {}))
    assert row.reachable and row.os is not None and "Debian" in row.os
    assert row.load is not None and len(row.load) == 3 and row.cpu_count == 2
    assert row.memory_used_bytes is not None and row.memory_used_bytes > 0
    assert row.memory_pressure is None and row.gpu_utilization_pct is None
    assert row.quarantined and row.quarantine_reason == "hang at step 3"
    assert row.run is None


def test_linux_gpu_from_nvidia_smi() -> None:
    smi = "0, NVIDIA A100, GPU-1, 81920, 1024, 37, 535.183.01, 8.0\n"
    row = build_node_status(LIN, lin_facts(nvidia_smi=smi), None, None, None)
    assert row.gpu_utilization_pct == 37


def test_unreachable_node_is_a_row_with_its_error_and_still_its_run_and_quarantine() -> None:
    rows = build_rows([MAC, DOWN], {"mac": mac_facts()}, {"down": "connection refused"},
                      [run(nodes=("mac", "down"))], {"down": Entry("down", "unreachable", "r1", NOW, {})})
    assert [r.node for r in rows] == ["mac", "down"]
    down = rows[1]
    assert not down.reachable and down.error == "connection refused"
    assert down.os is None and down.memory_total_bytes is None and down.load is None
    assert down.quarantined and down.run is not None and down.run.rank is None  # named by the run, no rank
    doc = down.to_json()
    assert doc["reachable"] is False and doc["memory"]["used_bytes"] is None
    json.dumps([r.to_json() for r in rows])  # JSON-able


def test_node_run_prefers_the_newest_active_run() -> None:
    older_active = run(run_id="older")
    newest_done = run(active=False, run_id="newest")
    assert node_run([newest_done, older_active], "mac").run_id == "older"  # type: ignore[union-attr]
    assert node_run([newest_done], "mac").run_id == "newest"  # type: ignore[union-attr]
    assert node_run([newest_done], "elsewhere") is None


def test_older_macos_profile_builds_a_row() -> None:
    row = build_node_status(MAC, mac_facts(OLD), None, None, None)
    assert row.os is not None and row.os.startswith("macOS 14") and row.chip == "Apple M1 Max"


# --- events -> run ---------------------------------------------------------------------------------------------

META = {"run_id": "r1", "nodes": ["mac", "lin"], "ranks": [{"rank": 0, "node": "mac"}, {"rank": 1, "node": "lin"}]}


def test_events_fold_into_per_rank_progress_incidents_and_heartbeats() -> None:
    ev = RunEvents()
    ev.feed_lines([
        json.dumps({"t": NOW - 10, "node": "mac", "rank": 0, "event": "started"}),
        json.dumps({"t": NOW - 10, "node": "lin", "rank": 1, "event": "started", "resumed_from": 4}),
        json.dumps({"t": NOW - 5, "node": "mac", "rank": 0, "event": "step", "step": 5, "loss": 2.0, "tok_s": 300.0}),
        "not json",
        json.dumps({"t": NOW - 2, "node": "mac", "rank": 0, "event": "heartbeat", "step": 5}),
        json.dumps({"t": NOW - 1, "node": "lin", "rank": 1, "event": "error", "message": "boom"}),
        json.dumps({"event": "incident", "kind": "error", "node": "lin", "rank": 1, "step": 4, "action": "quarantine",
                    "evidence": {"message": "boom"}}),
        json.dumps({"event": "incident", "kind": "straggler", "node": "lin", "rank": 1, "step": 4, "action": "warn"}),
        json.dumps({"t": NOW, "node": "old-node", "rank": 1, "event": "step", "step": 99}),  # an earlier attempt
    ])
    status = build_run_status("r1", META, None, ev, NOW, iters=60)
    assert ev.bad_lines == 1
    mac, lin = status.ranks
    assert (mac.state, mac.step, mac.loss, mac.tokens_per_s, mac.last_heartbeat_age_s) == ("running", 5, 2.0, 300.0, 2.0)
    assert (lin.state, lin.step, lin.last_heartbeat_age_s) == ("failed", 4, 1.0)
    assert status.active and status.state == "running" and status.step == 4 and status.iters == 60
    assert status.incident_counts == {"error": 1, "straggler": 1}
    assert [i.kind for i in status.incidents] == ["error", "straggler"]
    done = build_run_status("r1", META, {"state": "failed"}, ev, NOW)
    assert not done.active and done.state == "failed" and done.step == 4
    # An ended run's step is its record's (summary.json: what the nodes prove), whatever reached events.jsonl.
    stopped = build_run_status("r1", META, {"state": "stopped", "steps": 174}, ev, NOW)
    assert stopped.step == 174 and stopped.to_json()["step"] == 174


def test_events_fold_reads_numbers_under_the_event_contract() -> None:
    """The same rule as the monitor (worker.events): a step of 3.0 is step 3, a step of "3" is none."""
    ev = RunEvents()
    ev.feed_lines([json.dumps({"t": NOW - 1.0, "node": "mac", "rank": 0.0, "event": "step", "step": 3.0, "loss": 2}),
                   json.dumps({"t": NOW - 1.0, "node": "lin", "rank": 1, "event": "step", "step": "3"})])
    mac, lin = build_run_status("r1", META, None, ev, NOW).ranks
    assert (mac.state, mac.step, mac.loss) == ("running", 3, 2.0)
    assert (lin.state, lin.step) == ("running", 0)


def test_a_rank_without_events_is_pending() -> None:
    status = build_run_status("r1", META, None, RunEvents(), NOW)
    assert [(r.state, r.step, r.last_heartbeat_age_s) for r in status.ranks] == [("pending", 0, None)] * 2


def test_read_new_lines_leaves_a_partial_line_for_next_time(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    assert read_new_lines(path, 0) == ([], 0)
    path.write_text('{"a": 1}\n{"b"')
    lines, offset = read_new_lines(path, 0)
    assert lines == ['{"a": 1}'] and offset == 9
    with path.open("a") as fh:
        fh.write(': 2}\n')
    assert read_new_lines(path, offset) == (['{"b": 2}'], 18)


def test_run_watcher_follows_events_incrementally_newest_run_first(tmp_path: Path) -> None:
    def make(run_id: str, mtime: float) -> Path:
        d = tmp_path / run_id
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({**META, "run_id": run_id}))
        os.utime(d / "meta.json", (mtime, mtime))
        return d

    old, new = make("old", NOW - 100), make("new", NOW)
    (old / "summary.json").write_text('{"state": "succeeded"}')
    (tmp_path / "not-a-run").mkdir()
    watcher = RunWatcher(tmp_path)
    assert [(r.run_id, r.active) for r in watcher.scan(NOW)] == [("new", True), ("old", False)]
    with (new / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"t": NOW, "node": "mac", "rank": 0, "event": "step", "step": 3}) + "\n")
    assert watcher.scan(NOW)[0].ranks[0].step == 3
    with (new / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"t": NOW, "node": "mac", "rank": 0, "event": "step", "step": 4}) + "\n")
    assert watcher.scan(NOW)[0].ranks[0].step == 4
    assert RunWatcher(tmp_path / "missing").scan(NOW) == []


# --- metrics ---------------------------------------------------------------------------------------------------


def exposition(nodes: list[NodeStatus], runs: list[RunStatus]) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}} for the families built from the records."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    class Fixed(Collector):
        def collect(self) -> Any:
            return build_metric_families(nodes, runs)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_node_metrics_leave_unknowns_out() -> None:
    rows = build_rows([MAC, LIN, DOWN], {"mac": mac_facts(), "lin": lin_facts()}, {"down": "refused"}, [],
                      {"lin": Entry("lin", "hang", None, NOW, {})})
    m = exposition(rows, [])
    assert m["mlxc_node_up"] == {(("node", "mac"),): 1.0, (("node", "lin"),): 1.0, (("node", "down"),): 0.0}
    assert m["mlxc_node_quarantined"][(("node", "lin"),)] == 1.0
    assert m["mlxc_node_quarantined"][(("node", "down"),)] == 0.0
    assert set(m["mlxc_node_memory_used_bytes"]) == {(("node", "mac"),), (("node", "lin"),)}
    assert set(m["mlxc_node_gpu_utilization_ratio"]) == {(("node", "mac"),)}  # lin has no GPU stats: absent
    assert 0 <= m["mlxc_node_gpu_utilization_ratio"][(("node", "mac"),)] <= 1
    assert set(m["mlxc_node_load1"]) == {(("node", "lin"),)}
    assert set(m["mlxc_node_memory_pressure_level"]) == {(("node", "mac"),)}


def test_run_metrics_from_a_scripted_monitor() -> None:
    mon = Monitor.create([PlannedRank(0, "a", 3, 300.0), PlannedRank(1, "b", 1, 100.0)], iters=10, now=0.0)
    for rank, node in ((0, "a"), (1, "b")):
        mon.observe(Observation("event", node, 0.5, rank, {"rank": rank, "event": "started", "pid": 1}))
    mon.observe(Observation("event", "a", 2.0, 0, {"rank": 0, "event": "step", "step": 2, "loss": 1.5, "tok_s": 310.0}))
    mon.observe(Observation("event", "b", 3.0, 1, {"rank": 1, "event": "step", "step": 1, "loss": 1.6, "tok_s": 90.0}))
    mon.observe(Observation("event", "b", 3.5, 5, {"rank": 5, "event": "step", "step": 9}))  # spoofed: an incident
    status = run_status_from_monitor("run-x", mon, now=5.0)
    assert status.active and status.step == 1 and status.incident_counts == {"spoofed": 1}
    m = exposition([], [status])
    key = (("node", "a"), ("rank", "0"), ("run_id", "run-x"))
    assert m["mlxc_rank_step"] == {key: 2.0, (("node", "b"), ("rank", "1"), ("run_id", "run-x")): 1.0}
    assert m["mlxc_rank_tokens_per_second"][key] == 310.0 and m["mlxc_rank_loss"][key] == 1.5
    assert m["mlxc_rank_last_heartbeat_age_seconds"][key] == 3.0
    assert m["mlxc_run_step"] == {(("run_id", "run-x"),): 1.0}
    assert m["mlxc_run_iters"] == {(("run_id", "run-x"),): 10.0}
    assert m["mlxc_run_active"] == {(("run_id", "run-x"),): 1.0}
    assert m["mlxc_run_incidents_total"] == {(("kind", "spoofed"), ("run_id", "run-x")): 1.0}
    for rank, node in ((0, "a"), (1, "b")):
        mon.observe(Observation("event", node, 6.0, rank, {"rank": rank, "event": "finished", "step": 10}))
    done = run_status_from_monitor("run-x", mon, now=7.0)
    assert exposition([], [done])["mlxc_run_active"] == {(("run_id", "run-x"),): 0.0}


def scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(server.url, timeout=5) as resp:
        body: bytes = resp.read()
        return body.decode()


def test_metrics_server_serves_a_private_registry_and_stops() -> None:
    from prometheus_client import REGISTRY

    with MetricsServer(0) as server, MetricsServer(0) as other:
        assert server.host == "127.0.0.1" and server.port > 0 and server.port != other.port
        server.update_nodes([NodeStatus("n1", "h", True, memory_used_bytes=5)])
        other.update_nodes([NodeStatus("n2", "h", False, error="x")])
        text = scrape(server)
        assert 'mlxc_node_up{node="n1"} 1.0' in text and "n2" not in text
        assert 'mlxc_node_memory_used_bytes{node="n1"} 5.0' in text
        assert 'mlxc_node_up{node="n2"} 0.0' in scrape(other)
        server.update_runs([run()])
        server.update_runs([run(run_id="r2")], replace=False)
        text = scrape(server)
        assert 'mlxc_run_step{run_id="r1"} 6.0' in text and 'run_id="r2"' in text
        server.update_runs([])
        assert "mlxc_run_step{" not in scrape(server)
        url = server.url
    assert REGISTRY.get_sample_value("mlxc_node_up", {"node": "n1"}) is None  # nothing global
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)
    server.close()  # idempotent


def test_metrics_server_port_in_use_is_a_config_error() -> None:
    with MetricsServer(0) as server, pytest.raises(ConfigError, match="cannot serve metrics"):
        MetricsServer(server.port)


class Recorder(QuietUI):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = False

    def message(self, text: str) -> None:
        self.calls.append(f"message {text}")

    def progress(self, monitor: Monitor, now: float) -> None:
        self.calls.append(f"progress {monitor.step()}")

    def close(self) -> None:
        self.closed = True


def test_metrics_ui_forwards_and_exports_the_run() -> None:
    inner = Recorder()
    mon = Monitor.create([PlannedRank(0, "a", 1, None)], iters=4, now=0.0)
    mon.observe(Observation("event", "a", 0.5, 0, {"rank": 0, "event": "started"}))
    mon.observe(Observation("event", "a", 1.0, 0, {"rank": 0, "event": "step", "step": 2, "tok_s": 50.0}))
    with MetricsServer(0) as server:
        ui = MetricsUI(inner, server)
        ui.message("run smoke-20250101-000000-abcd: preparing nodes")
        ui.progress(mon, time.monotonic())
        text = scrape(server)
        assert 'mlxc_rank_step{node="a",rank="0",run_id="smoke-20250101-000000-abcd"} 2.0' in text
        ui.close()
    assert inner.calls == ["message run smoke-20250101-000000-abcd: preparing nodes", "progress 2"]
    assert inner.closed


def test_the_recorded_sysctl_lacks_vm_loadavg() -> None:
    """The vm.loadavg cases append to the recording: it must not have the key already."""
    assert "vm.loadavg" not in load_profile(MBP)["sysctl"].text


def test_a_degraded_run_says_what_it_runs_without() -> None:
    left = [{"node": "ultra", "reason": "quarantined: crash at step 5 (run r0, 1h ago; expires in 23h)"}]
    running = build_run_status("r1", {**META, "left_out": left}, None, RunEvents(), NOW)
    assert running.left_out == (("ultra", left[0]["reason"]),)
    assert running.to_json()["degraded"] is True and running.to_json()["left_out"] == left
    done = build_run_status("r1", META, {"state": "succeeded", "degraded": True, "left_out": left}, RunEvents(), NOW)
    assert done.left_out == running.left_out
    whole = build_run_status("r1", {**META, "left_out": "garbage"}, None, RunEvents(), NOW)
    assert whole.left_out == () and whole.to_json()["degraded"] is False
    console = Console(width=200, record=True)
    console.print(render_run_table(running))
    assert "DEGRADED: ultra left out" in console.export_text()


def test_status_shows_only_this_inventorys_quarantine_and_notes_a_bad_file(tmp_path: Path) -> None:
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text("nodes: []\n")
    inv = Inventory((MAC, LIN), str(inv_path))
    store = QuarantineStore(tmp_path / "q.json")
    store.add(new_entry(LIN, inventory_key(str(inv_path)), "hang at step 3", run_id="r0", incident={}, host_key=None,
                        now=time.time(), quarantine_for=3600))
    store.add(new_entry(MAC, "/another/inventory.yaml", "crash", run_id="r9", incident={}, host_key=None,
                        now=time.time(), quarantine_for=3600))
    found, note = load_quarantine(store, inv)
    assert list(found) == ["lin"] and found["lin"].reason == "hang at step 3" and note is None
    store.path.write_text('{"version": 2, "entries": "lin"}')
    found, note = load_quarantine(store, inv)
    assert found == {} and note is not None and note.startswith(f"{store.path}: quarantine state has the wrong shape")


def test_a_relaunch_is_judged_by_its_new_meta(tmp_path: Path) -> None:
    """meta.json rewritten by a relaunch (attempt 1, the survivor): status judges that attempt's lines alone."""
    run = tmp_path / "r1"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps(META))
    lines = [{"t": NOW - 9, "node": "mac", "rank": 0, "event": "started", "attempt": 0},
             {"t": NOW - 9, "node": "lin", "rank": 1, "event": "started", "attempt": 0},
             {"t": NOW - 8, "node": "mac", "rank": 0, "event": "step", "step": 1, "tok_s": 100.0, "attempt": 0},
             {"event": "incident", "attempt": 0, "kind": "crash", "node": "lin", "rank": 1, "step": 1, "t": 3.0}]
    (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    watcher = RunWatcher(tmp_path)
    [first] = watcher.scan(now=NOW)
    assert [(r.node, r.verdict, r.tokens_per_s) for r in first.ranks] == [("mac", "ok", 100.0), ("lin", "dead", None)]
    (run / "meta.json").write_text(json.dumps({**META, "attempt": 1, "nodes": ["mac"],
                                               "ranks": [{"rank": 0, "node": "mac"}]}))
    with (run / "events.jsonl").open("a") as fh:
        for x in ({"t": NOW - 4, "node": "mac", "rank": 0, "event": "started", "attempt": 1, "resumed_from": 1},
                  {"t": NOW - 3, "node": "mac", "rank": 0, "event": "step", "step": 2, "tok_s": 400.0, "attempt": 1}):
            fh.write(json.dumps(x) + "\n")
    [again] = watcher.scan(now=NOW)
    assert [(r.node, r.verdict, r.tokens_per_s) for r in again.ranks] == [("mac", "ok", 400.0)]


@pytest.mark.parametrize(("playbook", "verdict"), [("heartbeat_timeout: 30\n", "ok"), (None, "hung")])
def test_an_older_runs_thresholds_come_from_its_playbook(tmp_path: Path, playbook: str | None, verdict: str) -> None:
    """A meta.json without `faults` (an older coordinator's): the run's playbook copy says how long a silence is."""
    run = tmp_path / "r1"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps(META))
    if playbook is not None:
        (run / "playbook.yaml").write_text(playbook)
    (run / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (
        {"t": NOW - 20, "node": n, "rank": r, "event": "started"} for r, n in ((0, "mac"), (1, "lin")))))
    [status] = RunWatcher(tmp_path).scan(now=NOW)
    assert [r.verdict for r in status.ranks] == [verdict, verdict]
