"""The run and node locks, stop requests and signal bookkeeping (coordinator/run/supervision.py), and the follower's
`--skip` (worker/follow.py) that lets a reopened follower channel go on where the closed one stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest

from coordinator.models import Connection, Node
from coordinator.run.rundir import PlanRecord
from coordinator.run.supervision import (
    FileLock,
    Holder,
    RunBusy,
    Supervision,
    acquire_nodes,
    acquire_run,
    exit_code_for,
    holder_of,
    node_lock_key,
    parse_holder,
    request_stop,
)
from worker.follow import Tail, parse_skip, read_events

EMPTY_PLAN = PlanRecord(split={}, batch={}, global_batch=0, mode="equal", predicted_tokens_per_s=None,
                        backend="ring", attempt=1)


def holder(pid: int = 4242, run_id: str = "r1") -> Holder:
    return Holder(pid, "box", "launch", run_id, 0.0)


def test_a_held_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    first = FileLock.try_acquire(path, holder(os.getpid()))
    assert isinstance(first, FileLock)
    second = FileLock.try_acquire(path, holder(1))  # another open file description: flock says no
    assert second == holder(os.getpid())
    assert holder_of(path) == holder(os.getpid())
    first.release()
    assert not path.exists() and holder_of(path) is None
    again = FileLock.try_acquire(path, holder(2))
    assert isinstance(again, FileLock)
    again.release()


def test_a_lock_file_left_by_a_dead_holder_is_stale_and_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    # What a kill -9 leaves: the file with its holder, and no flock (the kernel dropped it with the process).
    path.write_text(json.dumps(holder(999_999_999).to_json()))
    assert holder_of(path) is None
    lock = FileLock.try_acquire(path, holder(os.getpid()))
    assert isinstance(lock, FileLock)
    assert parse_holder(path.read_text()) == holder(os.getpid())
    lock.release()


def test_acquire_run_raises_run_busy_naming_the_live_coordinator(tmp_path: Path) -> None:
    lock = acquire_run(tmp_path, "launch", "fault-1")
    try:
        with pytest.raises(RunBusy, match=rf"run fault-1 is supervised by `coordinator launch` \(pid {os.getpid()} on "
                                          rf"{socket.gethostname()}"):
            acquire_run(tmp_path, "attach", "fault-1")
        assert RunBusy("x").exit_code == 2
    finally:
        lock.release()


def node(name: str, host: str, port: int | None = None, connection: Connection = Connection.SSH) -> Node:
    return Node(name=name, host=host, port=port, connection=connection)


def test_node_lock_key_is_the_machine_behind_the_node() -> None:
    assert node_lock_key(node("a", "10.0.0.1")) == "10.0.0.1:22"
    assert node_lock_key(node("a", "Mac.local", 2222)) == "mac.local:2222"
    assert node_lock_key(node("a", "127.0.0.1", connection=Connection.LOCAL)) == "local"


def test_nodes_held_by_a_live_run_refuse_a_second_run_or_are_shared_with_allow_shared(tmp_path: Path) -> None:
    ours = [node("a", "10.0.0.1"), node("b", "10.0.0.2")]
    held = acquire_nodes(ours, "launch", "first", allow_shared=False, root=tmp_path)
    try:
        theirs = [node("b2", "10.0.0.2"), node("c", "10.0.0.3")]
        with pytest.raises(RunBusy, match=r"in use by another live run: b2 \(run first, "):
            acquire_nodes(theirs, "launch", "second", allow_shared=False, root=tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["10.0.0.1:22.lock", "10.0.0.2:22.lock"]  # none kept
        shared = acquire_nodes(theirs, "launch", "second", allow_shared=True, root=tmp_path)
        assert list(shared.shared) == ["b2"] and shared.shared["b2"] is not None
        assert len(shared.held) == 1  # c
        shared.release()
    finally:
        held.release()
    assert list(tmp_path.iterdir()) == []


def test_two_local_nodes_of_one_run_share_one_lock(tmp_path: Path) -> None:
    nodes = [node("a", "127.0.0.1", connection=Connection.LOCAL), node("b", "127.0.0.1", connection=Connection.LOCAL)]
    locks = acquire_nodes(nodes, "launch", "r", allow_shared=False, root=tmp_path)
    assert len(locks.held) == 1 and not locks.shared
    locks.release()


def test_supervision_records_the_first_signal_and_detaches_only_on_a_hangup_when_asked() -> None:
    sup = Supervision()
    assert sup.stop_reason() is None and sup.message() == "interrupted"
    assert sup.on_signal(signal.SIGTERM) and not sup.on_signal(signal.SIGINT)
    assert sup.stop_reason() == "SIGTERM" and sup.message() == "interrupted by SIGTERM" and not sup.detach
    hup = Supervision()
    hup.on_signal(signal.SIGHUP)
    assert not hup.detach and hup.message() == "interrupted by SIGHUP"
    detaching = Supervision(detach_on_hangup=True)
    detaching.on_signal(signal.SIGHUP)
    assert detaching.detach and detaching.message() == "detached on SIGHUP: the run goes on"
    term = Supervision(detach_on_hangup=True)
    term.on_signal(signal.SIGTERM)
    assert not term.detach


def test_a_stop_request_in_the_run_dir_is_a_reason_to_stop(tmp_path: Path) -> None:
    sup = Supervision(run_dir=tmp_path)
    assert sup.stop_reason() is None
    request_stop(tmp_path)
    assert sup.stop_reason() == "stopped by `coordinator stop`"
    assert sup.message() == "stopped by `coordinator stop`"


def test_exit_codes_are_128_plus_the_signal() -> None:
    assert [exit_code_for(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == [130, 143, 129]


def test_parse_holder_of_an_empty_or_foreign_file_is_none() -> None:
    assert parse_holder("") is None and parse_holder("{}") is None and parse_holder("pid=3") is None


# --- worker.follow --skip -------------------------------------------------------------------------------------


def test_parse_skip() -> None:
    assert parse_skip("") == {} and parse_skip("0=12,3=0") == {0: 12, 3: 0}


def test_a_reopened_follower_skips_what_was_delivered_but_still_learns_the_pid(tmp_path: Path) -> None:
    path = tmp_path / "rank1.jsonl"
    lines = [{"event": "started", "pid": 77}, {"event": "step", "step": 1}, "not json", {"event": "step", "step": 2}]
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    pids: dict[int, int] = {}
    skip = {1: 3}
    out = read_events(Tail(str(path)), 1, skip, pids)
    assert out == [{"src": "event", "rank": 1, "event": {"event": "step", "step": 2}}]
    assert pids == {1: 77} and skip == {1: 0}
    fresh = read_events(Tail(str(path)), 1, {}, {})
    assert [m["src"] for m in fresh] == ["event", "event", "bad", "event"]


def test_attach_adopts_what_the_launch_decided_for_the_whole_run_from_meta_json(tmp_path: Path) -> None:
    """The nodes left out at start, the drill flag and --restart-from-scratch outlive the coordinator: attach's
    summary (`job.supervise`) still names the left-out nodes, and its relaunches answer faults as the launch's
    would have."""
    from coordinator.config.playbook import parse_playbook
    from coordinator.fleet.transport import Fleet
    from coordinator.models import Inventory
    from coordinator.planning.hostfile import Hostfile
    from coordinator.run.control import _adopt, read_meta
    from coordinator.run.launch import Launch
    from coordinator.run.launchfiles import RankPlan

    node = Node("a", "127.0.0.1", Connection.LOCAL, workdir=str(tmp_path / "w"))
    pb = parse_playbook({"name": "t", "model": "/m", "data": "/d"}, path="pb.yaml").model_copy(update={"path": None})
    run_dir = tmp_path / "runs" / "t-1"
    launched = Launch(Fleet([node]), pb, [RankPlan(0, node, 4)], Hostfile("ring", ()), {}, run_id="t-1",
                      run_dir=run_dir)
    launched.left_out = [{"node": "b", "reason": "crash at step 3"}]
    launched.drill, launched.restart_from_scratch = True, True
    launched.write_local_files(EMPTY_PLAN)
    launched.write_meta()
    adopted = _adopt(Fleet([node]), run_dir, read_meta(run_dir), Inventory((node,)), pb, None)
    assert adopted.left_out == launched.left_out and adopted.drill and adopted.restart_from_scratch
    assert adopted.remote_tmp == launched.remote_tmp


# --- the run's record: written once, by who knows --------------------------------------------------------------


def test_a_summary_written_after_the_attempt_started_is_the_runs_end(tmp_path: Path) -> None:
    from coordinator.run.control import ended_summary

    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    (run_dir / "meta.json").write_text('{"run_id": "r1"}')
    assert ended_summary(run_dir) is None  # running, or its coordinator died before it could write one
    (run_dir / "summary.json").write_text('{"run_id": "r1", "state": "failed", "steps": 7, "message": "job error"}')
    os.utime(run_dir / "meta.json", ns=(1_000, 1_000))
    os.utime(run_dir / "summary.json", ns=(2_000, 2_000))
    ended = ended_summary(run_dir)
    assert ended is not None and (ended.state, ended.steps, ended.message) == ("failed", 7, "job error")
    # A `--resume` started a new attempt after that summary: the run has not ended again yet.
    os.utime(run_dir / "meta.json", ns=(3_000, 3_000))
    assert ended_summary(run_dir) is None


# --- orphans: ranks nobody supervises ---------------------------------------------------------------------------


def test_ranks_of_a_run_whose_coordinator_is_gone_are_orphans_a_supervised_run_is_not() -> None:
    from coordinator.run.supervision import LiveRank, OrphanRun, describe_orphans, find_orphans

    ranks = [LiveRank("h1", 10, "dead-1"), LiveRank("h2", 11, "dead-1"), LiveRank("h2", 12, "dead-1"),
             LiveRank("h1", 20, "live-1"), LiveRank("h3", 30, "elsewhere"), LiveRank("h1", 40, "mine")]
    orphans = find_orphans(ranks, own_run_id="mine", holders={"live-1": holder(run_id="live-1"), "mine": holder()},
                           known={"dead-1": 4242, "live-1": 99, "mine": None})
    assert [(o.run_id, o.nodes) for o in orphans] == [("dead-1", ("h1", "h2")), ("elsewhere", ("h3",)),
                                                      ("mine", ("h1",))]
    assert "pid 4242" in orphans[0].why and "no run dir" in orphans[1].why
    text = describe_orphans([OrphanRun("dead-1", ("h1", "h2"), "its coordinator is gone")], Path("/x/runs"))
    assert "h1, h2 run ranks of run dead-1" in text
    assert "`coordinator attach dead-1 --run-dir /x/runs`" in text and "`coordinator stop dead-1 --run-dir /x/runs`" in text
    assert "--run-dir" not in describe_orphans(orphans[:1], Path("runs"))
    assert find_orphans([], own_run_id="mine", holders={}, known={}) == []


def test_the_nodes_answer_about_its_ranks_is_read_strictly() -> None:
    from coordinator.run.supervision import LiveRank, parse_live_ranks

    out = 'noise\n{"ranks": [{"pid": 7, "run_id": "r1", "config": "/w/runs/r1/h1/run.json"}, {"pid": "x"}]}\n'
    assert parse_live_ranks("h1", out) == [LiveRank("h1", 7, "r1")]
    assert parse_live_ranks("h1", "") == [] and parse_live_ranks("h1", "Traceback ...") == []


def test_worker_ranks_finds_this_users_trainers_in_the_process_table(tmp_path: Path) -> None:
    from worker.ranks import parse_ps, read_run_id

    table = ("  101  501 /usr/bin/python3 -m worker.train --config /Users/me/mlx-work/runs/r1/h1/run.json\n"
             "  102  501 /opt/py -m worker.train --config /srv/my work/runs/r 2/h1/run.json\n"
             "  103    0 /usr/bin/python3 -m worker.train --config /root/runs/r3/h1/run.json\n"
             "  104  501 grep worker.train --config\n"
             "  105  501 python -m worker.follow --run-dir /w/runs/r1/h1\n"
             "garbage\n")
    assert parse_ps(table, 501) == [(101, "/Users/me/mlx-work/runs/r1/h1/run.json"),
                                    (102, "/srv/my work/runs/r 2/h1/run.json")]
    config = tmp_path / "run.json"
    config.write_text('{"run_id": "r1", "world_size": 2}')
    assert read_run_id(str(config)) == "r1"
    config.write_text('{"run_id": ')  # half-written: not this node's run (yet)
    assert read_run_id(str(config)) is None and read_run_id(str(tmp_path / "gone.json")) is None


# --- torn last lines ----------------------------------------------------------------------------------------------


def test_a_torn_last_line_is_never_read_until_it_is_complete(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_text('{"event": "step", "step": 1}\n{"event": "step", "st')
    tail = Tail(str(path))
    assert read_events(tail, 0, {}, {}) == [{"src": "event", "rank": 0, "event": {"event": "step", "step": 1}}]
    with path.open("a") as fh:
        fh.write('ep": 2}\n')
    assert read_events(tail, 0, {}, {}) == [{"src": "event", "rank": 0, "event": {"event": "step", "step": 2}}]


def test_follow_once_reports_the_files_and_the_newest_complete_checkpoint_then_exits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from worker.follow import main

    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "rank0.jsonl").write_text(
        '{"event": "started", "pid": 1}\n{"event": "step", "step": 1}\n{"event": "step", "step": 2}\n{"event": "st')
    ckpts = tmp_path / "checkpoints"
    for name, manifest in (("step-000002", True), ("step-000004", True), ("step-000006", False),
                           ("step-000008.tmp-12", True), ("step-000009.invalid-sha256-mismatch", True)):
        (ckpts / name).mkdir(parents=True)
        if manifest:
            (ckpts / name / "manifest.sha256").write_text("x  weights.safetensors\n")
    assert main(["--run-dir", str(tmp_path), "--ranks", "0,1", "--once", "--skip", "0=1"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out == [{"src": "event", "rank": 0, "event": {"event": "step", "step": 1}},
                   {"src": "event", "rank": 0, "event": {"event": "step", "step": 2}},
                   {"src": "checkpoints", "step": 4}]
    assert main(["--run-dir", str(tmp_path / "nothing"), "--ranks", "0", "--once"]) == 0
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == [{"src": "checkpoints", "step": None}]
