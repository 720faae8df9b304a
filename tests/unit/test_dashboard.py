"""The dashboard's fold, verdicts and server, on the files of a real demo run (tests/fixtures/rundirs/: `make demo`'s
run dir, recorded) and on events appended to a copy of it, as a live run appends them. The server runs in-process
on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from coordinator.errors import ConfigError
from coordinator.run.rundir import parse_meta, parse_summary
from coordinator.views.dashboard.model import RunFold, run_row, run_view, step_time_stats
from coordinator.views.dashboard.server import (
    CACHED_RUNS,
    RECENT_RUNS,
    DashboardServer,
    DashboardState,
    TrackedRun,
    compute_evictions,
    is_loopback,
    open_run,
)

DEMO = Path(__file__).parent.parent / "fixtures" / "rundirs" / "smoke-20261125-015050-658d"


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_demo_run_folds_into_its_curves_ranks_and_checkpoints() -> None:
    meta = parse_meta(json.loads((DEMO / "meta.json").read_text()))
    fold = RunFold.from_meta(meta.run_id, meta)
    delta = fold.feed(records(DEMO / "events.jsonl"))
    assert [s for s, _ in fold.loss] == list(range(1, 31)) and [p[0] for p in delta["loss"]] == list(range(1, 31))
    assert [s for s, _ in fold.val_loss] == [10, 20, 30]
    assert [c["step"] for c in fold.checkpoints] == list(range(1, 31))  # one per step, though both ranks report
    assert fold.iters == 30 and fold.step == 30 and fold.incidents == [] and fold.recoveries == []
    view = run_view(fold, meta=meta, summary=parse_summary(json.loads((DEMO / "summary.json").read_text())), iters=None,
                    now=2e9)
    assert view["state"] == "succeeded" and not view["active"] and view["iters"] == 30
    assert view["split"] == {"local-a": 0.5, "local-b": 0.5}
    # Calibration's one prediction (plan.json's, in summary.json), never a sum of the ranks' calibrated rates.
    assert view["predicted_tokens_per_s"] == 7969.5 and view["rate_unit"] == "real tokens/s"
    assert [(r["node"], r["state"], r["verdict"], r["step"]) for r in view["ranks"]] == [
        ("local-a", "finished", "ok", 30), ("local-b", "finished", "ok", 30)]
    stats = view["ranks"][0]["step_time_s"]
    assert stats["min"] <= stats["median"] <= stats["max"]  # the first step (compile) is the max


def test_a_fold_fed_in_batches_equals_one_fed_at_once() -> None:
    recs = records(DEMO / "events.jsonl")
    whole, parts = RunFold("r"), RunFold("r")
    whole.feed(recs)
    pushed: list[list[Any]] = []
    for i in range(0, len(recs), 7):
        pushed += parts.feed(recs[i:i + 7])["loss"]
    assert parts.loss == whole.loss and parts.checkpoints == whole.checkpoints
    assert pushed == [[s, round(v, 5)] for s, v in whole.loss]


def test_incidents_and_a_relaunch_are_marked_at_their_step() -> None:
    fold = RunFold.from_meta("r", parse_meta({"run_id": "r", "ranks": [{"rank": 0, "node": "a"}, {"rank": 1, "node": "b"}]}))
    for rank, node in ((0, "a"), (1, "b")):
        fold.feed([{"event": "started", "rank": rank, "node": node, "t": 1.0, "iters": 50}])
    delta = fold.feed([{"event": "incident", "kind": "crash", "node": "b", "rank": 1, "step": 12, "action": "quarantine",
                        "t": 5.0, "evidence": {"exit": -9}},
                       {"event": "started", "rank": 0, "node": "a", "t": 9.0, "resumed_from": 10}])
    assert [(i["kind"], i["step"]) for i in delta["incidents"]] == [("crash", 12)]
    assert [r["step"] for r in delta["recoveries"]] == [10]
    ranks = run_view(fold, meta=None, summary=None, iters=None, now=6.0)["ranks"]
    assert [(r["node"], r["verdict"]) for r in ranks] == [("a", "ok"), ("b", "dead")]  # the monitor's word
    assert [r["verdict"] for r in run_view(RunFold("r"), meta=None, summary=None, iters=None, now=6.0)["ranks"]] == []


def test_a_replay_does_not_call_a_rank_hung_for_the_time_since_the_run_ended() -> None:
    meta = parse_meta(json.loads((DEMO / "meta.json").read_text()))
    fold = RunFold.from_meta(meta.run_id, meta)
    fold.feed(records(DEMO / "events.jsonl")[:40])  # mid-run: no `finished`
    summary = parse_summary({"state": "stopped"})
    assert [r["verdict"] for r in run_view(fold, meta=meta, summary=summary, iters=None, now=2e9)["ranks"]] == [
        "ok", "ok"]
    live = run_view(fold, meta=meta, summary=None, iters=None, now=2e9)["ranks"]
    assert [r["verdict"] for r in live] == ["hung", "hung"]  # a live run silent for years: the monitor's hang


def test_step_time_stats() -> None:
    assert step_time_stats([]) is None
    assert step_time_stats([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "example.org"))


# --- the server, in-process ------------------------------------------------------------------------------------


TOKEN = "t0k"


async def http_head(port: int, path: str, *, method: str = "GET", headers: dict[str, str] | None = None,
                    host: str = "127.0.0.1", token: str | None = TOKEN) -> tuple[int, str, bytes]:
    """(status, the response's head, body); `token` in the query (None: none)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if token is not None:
        path += ("&" if "?" in path else "?") + f"token={token}"
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode("latin-1"), body


async def http(port: int, path: str, *, method: str = "GET", headers: dict[str, str] | None = None,
               host: str = "127.0.0.1", token: str | None = TOKEN) -> tuple[int, bytes]:
    status, _, body = await http_head(port, path, method=method, headers=headers, host=host, token=token)
    return status, body


def live_copy(tmp_path: Path, lines: int) -> Path:
    """The demo run as it looked after its first `lines` events: no summary.json yet (running)."""
    run = tmp_path / "runs" / DEMO.name
    run.mkdir(parents=True)
    shutil.copy(DEMO / "meta.json", run / "meta.json")
    (run / "events.jsonl").write_text("".join((DEMO / "events.jsonl").read_text().splitlines(True)[:lines]))
    return run


def test_endpoints_serve_the_demo_run_and_the_pages(tmp_path: Path) -> None:
    shutil.copytree(DEMO, tmp_path / "runs" / DEMO.name)

    async def main() -> None:
        async with DashboardServer(DashboardState(tmp_path / "runs"), port=0, token="t0k") as server:
            status, body = await http(server.port, f"/api/run/{DEMO.name}")
            doc = json.loads(body)
            assert status == 200 and doc["state"] == "succeeded" and len(doc["loss"]) == 30
            status, body = await http(server.port, "/api/runs")
            assert status == 200 and [r["run_id"] for r in json.loads(body)["runs"]] == [DEMO.name]
            for page in ("/", "/runs", f"/run/{DEMO.name}"):
                status, body = await http(server.port, page)
                assert status == 200 and b"/static/app.js" in body
            status, body = await http(server.port, "/static/uPlot.iife.min.js")
            assert status == 200 and b"uPlot" in body
            assert (await http(server.port, "/static/../../cli.py"))[0] == 404
            assert (await http(server.port, "/api/run/..%2F..%2Fetc"))[0] == 404
            assert (await http(server.port, "/api/run/missing"))[0] == 404
            assert (await http(server.port, "/api/fleet", method="DELETE"))[0] == 405
            assert server.url == f"http://127.0.0.1:{server.port}/?token=t0k"
            # DNS rebinding: another name for 127.0.0.1 reads nothing without the token
            assert (await http(server.port, "/api/runs", host="evil.example", token=None))[0] == 403
            assert (await http(server.port, "/api/runs", host="evil.example"))[0] == 200

    asyncio.run(main())


def test_stop_needs_the_token_and_calls_the_stop_path(tmp_path: Path) -> None:
    run = live_copy(tmp_path, 40)
    stopped: list[Path] = []

    async def stop(run_dir: Path) -> None:
        stopped.append(run_dir)

    async def main() -> None:
        async with DashboardServer(DashboardState(tmp_path / "runs"), port=0, token="t0k", stop=stop) as server:
            assert (await http(server.port, f"/api/run/{run.name}/stop", method="POST", token=None))[0] == 403
            assert (await http(server.port, f"/api/run/{run.name}/stop", method="POST", token="bad"))[0] == 403
            # The page's cookie is not enough to stop: a page of another port of this host would send it too.
            cookie = {"Cookie": f"{server.cookie}=t0k"}
            assert (await http(server.port, f"/api/run/{run.name}/stop", method="POST", token=None,
                               headers=cookie))[0] == 403
            status, _ = await http(server.port, f"/api/run/{run.name}/stop", method="POST",
                                   headers={"X-Dashboard-Token": "t0k"}, token=None)
            assert status == 202
            for _ in range(100):
                if stopped:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(main())
    assert stopped == [run]


def test_every_request_needs_the_token_on_loopback_too_and_the_printed_url_sets_its_cookie(tmp_path: Path) -> None:
    """Any local user can reach 127.0.0.1: without the token nothing is served, a page, a stream or a run's
    document (which would make the server open and keep what it names). The printed URL's page sets the token's
    cookie (HttpOnly, SameSite=Strict, one name per port), which the browser's own page loads then carry."""
    shutil.copytree(DEMO, tmp_path / "runs" / DEMO.name)

    async def main() -> None:
        async with DashboardServer(DashboardState(tmp_path / "runs"), port=0, token=TOKEN) as server:
            for path in ("/", "/runs", f"/run/{DEMO.name}", "/static/app.js", "/api/runs", "/api/fleet",
                         f"/api/run/{DEMO.name}", f"/api/stream?run={DEMO.name}"):
                for host in ("127.0.0.1", "localhost", "[::1]"):
                    status, body = await http(server.port, path, host=host, token=None)
                    assert status == 403 and b"needs its token" in body, (path, host, body)
                assert (await http(server.port, path, token="wrong"))[0] == 403
            assert not server.state.watchers
            status, head, _ = await http_head(server.port, "/")
            assert status == 200
            assert f"Set-Cookie: dashboard-token-{server.port}=t0k; Path=/; HttpOnly; SameSite=Strict" in head
            cookie = {"Cookie": f"other=1; dashboard-token-{server.port}=t0k"}
            for path in ("/runs", f"/run/{DEMO.name}", "/static/app.js", "/api/runs"):
                assert (await http(server.port, path, headers=cookie, token=None))[0] == 200, path
            assert (await http(server.port, "/api/runs", headers={"X-Dashboard-Token": TOKEN}, token=None))[0] == 200
            # another dashboard's cookie (another port) is not this one's
            other = {"Cookie": f"dashboard-token-{server.port + 1}=t0k"}
            assert (await http(server.port, "/api/runs", headers=other, token=None))[0] == 403

    asyncio.run(main())


def test_an_appended_event_is_pushed_to_the_stream(tmp_path: Path) -> None:
    run = live_copy(tmp_path, 60)
    later = (DEMO / "events.jsonl").read_text().splitlines(True)[60:90]

    async def main() -> dict[str, Any]:
        async with DashboardServer(DashboardState(tmp_path / "runs"), port=0, token=TOKEN) as server:
            status, body = await http(server.port, f"/api/run/{run.name}")
            snapshot = json.loads(body)
            assert status == 200 and snapshot["active"]
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /api/stream?token=t0k HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await reader.readuntil(b"event: hello\n")
            with (run / "events.jsonl").open("a") as fh:
                fh.write("".join(later))
            while True:
                line = (await reader.readline()).decode()
                if line.startswith("event: run"):
                    data = json.loads((await reader.readline()).decode()[len("data: "):])
                    writer.close()
                    assert data["delta_from"] == snapshot["offset"]
                    return data

    data = asyncio.run(main())
    expected = [json.loads(x) for x in later]
    assert [p[0] for p in data["delta"]["loss"]] == sorted({e["step"] for e in expected if e["event"] == "step"}
                                                          - {e["step"] for e in records(run / "events.jsonl")[:60]
                                                             if e["event"] == "step"})
    assert data["view"]["active"] and data["view"]["ranks"][0]["verdict"] in ("ok", "hung")


def make_runs(root: Path, count: int) -> list[str]:
    """`count` running runs (meta.json, no summary), oldest first (their meta.json a second apart)."""
    ids = []
    for i in range(count):
        run = root / f"r-{i:04d}"
        run.mkdir(parents=True)
        (run / "meta.json").write_text(json.dumps({"run_id": run.name, "nodes": ["n0"],
                                                   "ranks": [{"rank": 0, "node": "n0", "batch_size": 4}]}))
        (run / "events.jsonl").write_text("")
        os.utime(run / "meta.json", (1_000_000 + i, 1_000_000 + i))
        ids.append(run.name)
    return ids


def test_what_the_dashboard_watches_is_bounded_whatever_the_pages_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run page of a big run root asked for over HTTP, one after the other: the server keeps the newest
    RECENT_RUNS, the run an open stream views, and an LRU of CACHED_RUNS others; a tick polls the first two only,
    so its cost does not grow with the pages ever asked for; the runs page lists the newest; a run evicted is
    opened again on demand."""
    ids = make_runs(tmp_path / "runs", RECENT_RUNS + CACHED_RUNS + 60)
    polls: list[str] = []
    real_poll = TrackedRun.poll

    def counted(run: TrackedRun) -> dict[str, Any] | None:
        polls.append(run.path.name)
        return real_poll(run)

    async def main() -> None:
        async with DashboardServer(DashboardState(tmp_path / "runs"), port=0, token=TOKEN) as server:
            state = server.state
            viewed = ids[0]  # the oldest run, viewed in a browser all along
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(f"GET /api/stream?run={viewed}&token={TOKEN} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            await reader.readuntil(b"event: hello\n")
            assert state.watchers == {viewed: 1}
            for run_id in ids:
                status, body = await http(server.port, f"/api/run/{run_id}")
                assert status == 200 and json.loads(body)["run_id"] == run_id
                assert len(state.runs) <= RECENT_RUNS + CACHED_RUNS + 1
            newest = ids[-RECENT_RUNS:]
            assert state.recent == newest[::-1]
            assert set(state.runs) == {viewed, *newest, *ids[-RECENT_RUNS - CACHED_RUNS:-RECENT_RUNS]}
            polls.clear()
            monkeypatch.setattr(TrackedRun, "poll", counted)
            state.tick(0.0)
            assert sorted(polls) == sorted([viewed, *newest]), "a tick polls the viewed and the newest runs only"
            monkeypatch.setattr(TrackedRun, "poll", real_poll)
            status, body = await http(server.port, "/api/runs")
            assert [r["run_id"] for r in json.loads(body)["runs"]] == newest[::-1]
            writer.close()  # the browser leaves: the oldest run is no longer kept
            for _ in range(200):
                if not state.watchers:
                    break
                await asyncio.sleep(0.01)
            assert not state.watchers and viewed not in state.runs
            status, body = await http(server.port, f"/api/run/{viewed}")
            assert status == 200 and json.loads(body)["run_id"] == viewed and viewed in state.runs

    asyncio.run(main())


def test_a_new_run_is_picked_up_though_its_meta_json_comes_after_its_dir(tmp_path: Path) -> None:
    """The root is listed again only when its mtime changes (a new dir), but a launch writes meta.json after it
    made the dir: a young dir without one keeps the next listings coming until it has one."""
    [old] = make_runs(tmp_path, 1)
    state = DashboardState(tmp_path)
    state.list_runs(force=True)
    assert state.recent == [old]

    def list_now() -> None:
        state._listed_at = float("-inf")  # past LIST_EVERY_S (no clock in a unit test)
        state.list_runs()

    (tmp_path / "new").mkdir()
    list_now()
    assert state.recent == [old]
    (tmp_path / "new" / "meta.json").write_text(json.dumps({"run_id": "new", "nodes": ["n0"],
                                                           "ranks": [{"rank": 0, "node": "n0", "batch_size": 4}]}))
    list_now()  # the root's mtime did not change: the listing comes because "new" was unsettled
    assert state.recent == ["new", old]


def test_compute_evictions() -> None:
    order = ["a", "b", "c", "d", "e"]  # least recently used first
    assert compute_evictions(order, {"a"}, 2) == ["b", "c"]
    assert compute_evictions(order, set(), 5) == []
    assert compute_evictions(order, set(order), 0) == []
    assert compute_evictions(order, {"e"}, 0) == ["a", "b", "c", "d"]


def test_a_busy_port_is_a_config_error(tmp_path: Path) -> None:
    async def main() -> None:
        async with DashboardServer(DashboardState(tmp_path), port=0) as first:
            with pytest.raises(ConfigError, match="cannot serve the dashboard"):
                await DashboardServer(DashboardState(tmp_path), port=first.port).start()

    asyncio.run(main())


def test_open_run_needs_meta(tmp_path: Path) -> None:
    assert open_run(tmp_path) is None


@pytest.mark.parametrize("meta", [{"format": 99, "run_id": "r", "ranks": []},  # newer than this coordinator reads
                                  {"run_id": "r", "ranks": [{"node": "a"}]}])  # a rank without its number
def test_open_run_leaves_out_a_meta_it_cannot_read(tmp_path: Path, meta: dict[str, Any]) -> None:
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert open_run(tmp_path) is None


def test_open_run_reads_meta_through_the_contract(tmp_path: Path) -> None:
    live = live_copy(tmp_path, 0)
    run = open_run(live)
    assert run is not None and run.meta is not None and run.meta.run_id == DEMO.name
    assert [(r.rank, r.node) for r in run.fold.ranks.values()] == [(0, "local-a"), (1, "local-b")]


def test_a_coordinator_record_and_a_mistyped_field_do_not_move_a_rank() -> None:
    fold = RunFold.from_meta("r", parse_meta({"run_id": "r", "ranks": [{"rank": 0, "node": "a"}]}))
    fold.feed([{"event": "started", "rank": 0, "node": "a", "t": 1.0, "iters": 50},
               {"event": "supervisor", "rank": 0, "node": "a", "t": 50.0},  # the coordinator's, not the rank's
               {"event": "step", "rank": 0, "node": "a", "t": 2.0, "step": 3.0, "loss": "nan?", "tok_s": 100}])
    rank = fold.ranks[0]
    assert rank.last_t == 2.0 and rank.step == 3 and rank.loss is None and rank.tokens_per_s == 100.0
    assert fold.loss == []  # no loss point for a step whose loss is not a number


def test_left_out_comes_from_the_summary_once_it_has_one_else_from_meta() -> None:
    meta = parse_meta({"run_id": "r", "ranks": [], "left_out": [{"node": "c", "reason": "preflight failed"}]})
    fold = RunFold.from_meta("r", meta)
    live = run_view(fold, meta=meta, summary=None, iters=None, now=1.0)
    assert live["degraded"] and live["left_out"] == [{"node": "c", "reason": "preflight failed"}]
    older = run_view(fold, meta=meta, summary=parse_summary({"run_id": "r", "state": "failed"}), iters=None, now=1.0)
    assert older["left_out"] == [{"node": "c", "reason": "preflight failed"}] and older["state"] == "failed"
    ended = run_view(fold, meta=meta, summary=parse_summary({"format": 3, "run_id": "r", "state": "succeeded",
                                                              "left_out": [], "message": "done"}), iters=None, now=1.0)
    assert not ended["degraded"] and ended["left_out"] == [] and ended["message"] == "done"


def test_an_ended_runs_step_is_its_summarys() -> None:
    meta = parse_meta({"run_id": "r", "ranks": [{"rank": 0, "node": "a"}]})
    fold = RunFold.from_meta("r", meta)
    fold.feed([{"event": "step", "rank": 0, "node": "a", "t": 2.0, "step": 3}])
    assert run_view(fold, meta=meta, summary=None, iters=None, now=3.0)["step"] == 3
    stopped = parse_summary({"format": 3, "run_id": "r", "state": "stopped", "steps": 174})
    assert run_view(fold, meta=meta, summary=stopped, iters=None, now=3.0)["step"] == 174
    assert run_row(fold, summary=stopped, meta=meta, iters=None, now=3.0)["step"] == 174


def test_preflight_verdicts_take_each_nodes_worst_finding() -> None:
    from coordinator.models import CheckResult, PreflightReport, Status
    from coordinator.views.dashboard.fleet import preflight_verdicts

    def node(name: str, *statuses: Status) -> tuple[str, tuple[CheckResult, ...]]:
        return name, tuple(CheckResult(f"c{i}", name, s, "") for i, s in enumerate(statuses))

    report = PreflightReport(nodes=(node("a", Status.PASS, Status.SKIP), node("b", Status.PASS, Status.WARN),
                                    node("c", Status.WARN, Status.ERROR), node("d", Status.FAIL)), lint=())
    assert preflight_verdicts(report) == {"a": "pass", "b": "warn", "c": "fail", "d": "fail"}


def test_a_relaunch_is_judged_by_its_new_meta(tmp_path: Path) -> None:
    """A relaunch rewrites meta.json (attempt 1, the survivors): the run page's ranks are that attempt's, judged by
    its own lines, while the curves keep every attempt's points."""
    run = live_copy(tmp_path, 80)
    tracked = open_run(run)
    assert tracked is not None
    tracked.poll()
    t = max(x["t"] for x in records(run / "events.jsonl") if "t" in x)
    with (run / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"event": "incident", "attempt": 0, "kind": "crash", "node": "local-b", "rank": 1,
                             "step": 5, "action": "quarantine", "t": 1.0}) + "\n")
    tracked.poll()
    before = tracked.view(t + 1, full=False)["ranks"]
    assert [(r["node"], r["verdict"]) for r in before] == [("local-a", "ok"), ("local-b", "dead")]
    meta = json.loads((run / "meta.json").read_text())
    meta |= {"attempt": 1, "nodes": ["local-a"], "ranks": [{"rank": 0, "node": "local-a", "batch_size": 8}]}
    (run / "meta.json").write_text(json.dumps(meta))
    os.utime(run / "meta.json", (t + 5, t + 5))
    last = max(x["step"] for x in records(run / "events.jsonl") if x.get("event") == "step")
    with (run / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"node": "local-a", "rank": 0, "t": t + 6, "event": "started", "attempt": 1,
                             "resumed_from": last}) + "\n")
        for step in (last + 1, last + 2, last + 3):
            fh.write(json.dumps({"node": "local-a", "rank": 0, "t": t + 6 + step, "event": "step", "step": step,
                                 "loss": 5.0, "tok_s": 500.0, "attempt": 1}) + "\n")
    tracked.poll()
    after = tracked.view(t + 14, full=True)
    assert [(r["node"], r["verdict"], r["tokens_per_s"]) for r in after["ranks"]] == [("local-a", "ok", 500.0)]
    assert [s for s, _ in after["loss"]] == list(range(1, last + 4))  # every attempt's points
