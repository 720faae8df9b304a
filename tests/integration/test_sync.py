"""`coordinator sync` end to end: the real CLI over real SSH between test-bed hosts (tests/testbed.py), the relay
chain over the hosts' own addresses."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import yaml

from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.integration.test_preflight import TINY_CONFIG
from tests.testbed import REPO, Host, TestBed

CHUNK = 1 << 20


def _tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root (partials included: none may be left)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _safetensors(n: int) -> bytes:
    """A valid safetensors file of one uint8 tensor of n random bytes (preflight's model check parses it)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    return struct.pack("<Q", len(header)) + header + os.urandom(n)


def _files(host: Host) -> list[Path]:
    return [p for d in ("model", "data") for p in (host.srv / d).rglob("*") if p.is_file()]


def _fill_source(host: Host, *, big: int = 3 * CHUNK + 123) -> None:
    model = host.srv / "model"
    (model / "sub").mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(_safetensors(big))
    (model / "sub" / "small.bin").write_bytes(b"small\n" * 100)
    data = host.srv / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text('{"text": "hello"}\n' * 50)
    (data / "valid.jsonl").write_text('{"text": "bye"}\n' * 5)


def _playbook(path: Path, model: str = "/srv/model", data: str = "/srv/data") -> Path:
    path.write_text(yaml.safe_dump({"name": "sync", "kind": "train", "model": model, "data": data,
                                    "backend": "ring", "train": {"method": "lora", "iters": 20}}))
    return path


def test_sync_repairs_missing_truncated_stale_and_extra(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    h1, h2, h3 = testbed.add_hosts(3)
    _fill_source(h1)
    # h2: nothing at all. h3: a truncated big file, a stale small file, an extra file, and a copy that matches.
    _fill_source(h3)
    src_big = (h1.srv / "model" / "model.safetensors").read_bytes()
    (h3.srv / "model" / "model.safetensors").write_bytes(src_big[: len(src_big) // 2])
    (h3.srv / "model" / "sub" / "small.bin").write_bytes(b"stale\n" * 100)  # same size, other bytes
    (h3.srv / "model" / "extra.bin").write_bytes(b"not in the source")
    (h3.srv / "data" / "train.jsonl").write_bytes((h1.srv / "data" / "train.jsonl").read_bytes())
    (h3.srv / "data" / "valid.jsonl").write_bytes((h1.srv / "data" / "valid.jsonl").read_bytes())
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    pb = _playbook(tmp_path / "pb.yaml")
    before = {h.name: (_tree(h.srv / "model"), _tree(h.srv / "data")) for h in (h2, h3)}

    check = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--check", "--json")
    assert check.returncode == 0, check.stderr + check.stdout
    plan = validate_output("sync", json.loads(check.stdout)).model_dump(by_alias=True)["plan"]
    by_node = {n["node"]: n for n in plan["nodes"]}
    assert set(by_node) == {"h2", "h3"}
    assert by_node["h2"]["files"] == 6
    assert sorted(by_node["h3"]["copy"]) == ["model/model.safetensors", "model/sub/small.bin"]
    assert by_node["h3"]["delete"] == ["model/extra.bin"]
    assert plan["chain"] == ["h2", "h3"]
    after_check = {h.name: (_tree(h.srv / "model"), _tree(h.srv / "data")) for h in (h2, h3)}
    assert after_check == before, "--check changed files"

    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json")
    assert cp.returncode == 0, cp.stderr + cp.stdout
    doc = json.loads(cp.stdout)
    validate_output("sync", doc)  # docs/json.md's schema, unknown keys refused
    assert doc["ok"] and doc["verified"] == {"h2": True, "h3": True}
    # Sent once down the chain: the union of what h2 and h3 miss (all of it), not twice.
    assert doc["sent_bytes"] == sum(p.stat().st_size for p in _files(h1))
    for h in (h2, h3):
        assert _tree(h.srv / "model") == _tree(h1.srv / "model"), h.name
        assert _tree(h.srv / "data") == _tree(h1.srv / "data"), h.name

    # Warm re-sync: nothing to do, nothing sent.
    again = run_cli("sync", "-i", str(inv), "-p", str(pb), "--json")  # no --from: the copy all nodes share
    assert again.returncode == 0, again.stderr + again.stdout
    doc = json.loads(again.stdout)
    assert doc["sent_bytes"] == 0 and doc["plan"]["chain"] == []

    # preflight's model check agrees.
    pre = run_cli("preflight", "-i", str(inv), "-p", str(pb), "--json", timeout=120)
    report = json.loads(pre.stdout)
    model = [c for n in report["nodes"] for c in n["checks"] if c["id"] == "model"]
    assert model and all(c["status"] in ("pass", "warn") for c in model), model


def test_killed_sync_resumes(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    h1, h2, h3 = testbed.add_hosts(3)
    size = 12 * CHUNK
    _fill_source(h1, big=size)
    for h in (h2, h3):  # ~1.2 MB/s into each target: the transfer takes ~10 s, time to kill it
        subprocess.run(["tc", "qdisc", "add", "dev", h.veth, "root", "tbf", "rate", "10mbit", "burst", "32kb",
                        "latency", "50ms"], check=True)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    pb = _playbook(tmp_path / "pb.yaml")
    argv = [sys.executable, "-m", "coordinator", "sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    partial = h3.srv / "model" / "model.safetensors.partial"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (partial.exists() and partial.stat().st_size > 3 * CHUNK):
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert partial.exists(), "the sync never reached h3"
    # The relays notice their SSH session is gone at their next progress line, and exit: what they wrote is then
    # final (relays that outlive their coordinator fail test_roots_are_refused_and_relays_die_with_their_coordinator).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _relays(testbed, [h2, h3]):
        time.sleep(0.05)
    kept = min((h.srv / "model" / "model.safetensors.partial").stat().st_size for h in (h2, h3))
    assert 0 < kept < size
    for h in (h2, h3):
        subprocess.run(["tc", "qdisc", "del", "dev", h.veth, "root"], check=True)

    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json")
    assert cp.returncode == 0, cp.stderr + cp.stdout
    doc = json.loads(cp.stdout)
    small = sum(p.stat().st_size for p in _files(h1) if p.name != "model.safetensors")
    # What was missing (plus at most one chunk, as the relays may have written a little after we measured).
    assert doc["sent_bytes"] <= size - kept + small + CHUNK, (doc["sent_bytes"], size, kept)
    assert doc["sent_bytes"] < size
    for h in (h2, h3):
        assert _tree(h.srv / "model") == _tree(h1.srv / "model"), h.name


def test_full_disk_fails_before_copying(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    small = tmp_path / "small"
    small.mkdir()
    # Mounted before the host exists: its sshd's private mount namespace is a copy of ours at its start.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        testbed.add_hosts(1)
        source = tmp_path / "source"
        (source / "model").mkdir(parents=True)
        (source / "model" / "w.bin").write_bytes(os.urandom(2 * CHUNK))
        (source / "data").mkdir()
        (source / "data" / "train.jsonl").write_text('{"text": "hi"}\n')
        inv = testbed.write_inventory(tmp_path / "inv.yaml")
        pb = tmp_path / "pb.yaml"
        pb.write_text(yaml.safe_dump({"name": "sync", "kind": "train", "model": str(small / "model"),
                                      "data": str(small / "data"), "backend": "ring", "train": {"method": "lora", "iters": 20}}))
        cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--source", str(source))
        assert cp.returncode == 1, cp.stderr + cp.stdout
        assert "not enough free disk space" in cp.stdout and "h1" in cp.stdout
        assert not any(small.rglob("*")), "bytes were written despite the full disk"
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_sync_usage_errors(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    testbed.add_hosts(1)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    pb = _playbook(tmp_path / "pb.yaml")
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "nope")
    assert cp.returncode == 2 and "unknown node nope" in cp.stderr and "Traceback" not in cp.stderr
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--source", str(tmp_path))
    assert cp.returncode == 2 and "not both" in cp.stderr
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--source", str(tmp_path))
    assert cp.returncode == 2 and "lacks model" in cp.stderr


def test_falls_back_to_ssh_when_the_data_plane_fails(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    h1, h2, h3 = testbed.add_hosts(3)
    _fill_source(h1)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    doc = yaml.safe_load(inv.read_text())
    # h3's data-plane IP is on no host: its relay cannot listen there, so the chain fails and the coordinator
    # streams the files over the SSH connections instead.
    bogus = h1.ip.rsplit(".", 1)[0] + ".250"
    for node in doc["nodes"]:
        if node["name"] == "h3":
            node["ips"] = [bogus]
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    pb = _playbook(tmp_path / "pb.yaml")
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json")
    assert cp.returncode == 0, cp.stderr + cp.stdout
    out = json.loads(cp.stdout)
    assert out["ok"] and out["verified"] == {"h2": True, "h3": True}
    assert "h3" in out["fallback"], out["fallback"]
    for h in (h2, h3):
        assert _tree(h.srv / "model") == _tree(h1.srv / "model"), h.name
        assert _tree(h.srv / "data") == _tree(h1.srv / "data"), h.name


def test_limit_an_unreachable_node_and_no_majority(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    h1, h2, h3, h4 = testbed.add_hosts(4)
    _fill_source(h1)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    pb = _playbook(tmp_path / "pb.yaml")
    # --limit: only h2 is synced (the --from node need not be in the limit).
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--limit", "h2", "--json")
    assert cp.returncode == 0, cp.stderr + cp.stdout
    assert _tree(h2.srv / "model") == _tree(h1.srv / "model") and _tree(h3.srv / "model") == {}
    # A node that cannot be reached fails (exit 1); the others are still synced.
    testbed.stop_sshd(h4)
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json", "--connect-timeout", "3")
    assert cp.returncode == 1, cp.stderr + cp.stdout
    doc = json.loads(cp.stdout)
    assert not doc["ok"] and "h4" in doc["errors"] and doc["verified"] == {"h2": True, "h3": True}
    assert _tree(h3.srv / "model") == _tree(h1.srv / "model")
    # Two nodes that disagree and no --from: no majority to copy from, a usage error naming the way out.
    (h3.srv / "model" / "config.json").write_text("{}")
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--limit", "h2,h3")
    assert cp.returncode == 2 and "--from NODE" in cp.stderr and "Traceback" not in cp.stderr, cp.stderr


def test_falls_back_to_ssh_when_a_node_cannot_reach_the_next(testbed: TestBed, tmp_path: Path,
                                                            run_cli: RunCli) -> None:
    h1, h2, h3 = testbed.add_hosts(3)
    _fill_source(h1)
    # h2 has no route to h3: the chain h1 -> h2 -> h3 breaks at h2's connect; h3 gets the files over SSH, and
    # h3's relay, which never hears from h2, is stopped rather than left to its idle timeout.
    testbed.exec(h2, ["ip", "route", "add", "blackhole", f"{h3.ip}/32"], check=True)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    pb = _playbook(tmp_path / "pb.yaml")
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json")
    assert cp.returncode == 0, cp.stderr + cp.stdout
    out = json.loads(cp.stdout)
    assert out["ok"] and out["verified"] == {"h2": True, "h3": True}
    # h2 received its files down the chain all the same (a next hop it cannot reach fails only what is after it).
    assert set(out["fallback"]) == {"h3"}, out["fallback"]
    assert "stopped: the chain broke upstream" in out["fallback"]["h3"], out["fallback"]
    for h in (h2, h3):
        assert _tree(h.srv / "model") == _tree(h1.srv / "model"), h.name


def _relays(testbed: TestBed, hosts: list[Host]) -> list[str]:
    """Command lines of the `worker.relay` processes running on the hosts."""
    from tests.testbed import _netns_pids

    found = []
    for pids in _netns_pids([h.ns for h in hosts]).values():
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "worker.relay" in cmd:
                found.append(cmd)
    return found


def _on_terminal(args: list[str], answer: bytes, timeout: float = 120) -> tuple[int, str]:
    """Run the CLI on a pseudo-terminal, typing `answer` at its first yes/no question: (exit code, what it showed)."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI, its stdin and stdout the terminal
        os.chdir(REPO)
        os.environ.update({"NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"})
        os.execv(sys.executable, [sys.executable, "-m", "coordinator", *args])
    shown = b""
    deadline = time.monotonic() + timeout
    asked = False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(fd, 4096)
            except OSError:  # the CLI exited: the terminal is gone
                break
            if not data:
                break
            shown += data
            if not asked and b"[y/N]" in shown:
                os.write(fd, answer)
                asked = True
    finally:
        with contextlib.suppress(ProcessLookupError):
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), shown.decode(errors="replace")


def test_a_doubtful_source_is_refused_unless_confirmed(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    h1, h2, h3 = testbed.add_hosts(3)
    for h in (h1, h2, h3):
        _fill_source(h)
    for p in (h1.srv / "model").rglob("*"):  # h1's model dir exists but is empty (an unmounted disk, a typo)
        if p.is_file():
            p.unlink()
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    pb = _playbook(tmp_path / "pb.yaml")
    before = {h.name: _tree(h.srv / "model") for h in (h2, h3)}
    held = sum(p.stat().st_size for p in (h2.srv / "model").rglob("*") if p.is_file())

    check = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--check", "--json")
    assert check.returncode == 2, check.stderr + check.stdout
    doc = validate_output("sync", json.loads(check.stdout)).model_dump(by_alias=True)
    assert not doc["ok"] and doc["refusal"]
    plan = doc["plan"]
    assert {(d["node"], d["dir"], d["files"], d["bytes"]) for d in plan["doubtful"]} == \
        {("h2", "model", 4, held), ("h3", "model", 4, held)}
    assert {n["node"]: (n["delete_files"], n["delete_bytes"]) for n in plan["nodes"]} == \
        {"h2": (4, held), "h3": (4, held)}
    line = check.stderr.strip().splitlines()[-1]
    assert "source h1:/srv/model is empty" in line and "4 of 4 files" in line and "on h2" in line \
        and "--delete-extras" in line, check.stderr

    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1")  # not a terminal: no one to say yes
    assert cp.returncode == 2 and "source h1:/srv/model is empty" in cp.stderr, cp.stderr + cp.stdout
    assert "Traceback" not in cp.stderr
    # Lacking most of what the targets hold (1 file of 4, a few bytes of 3 MB) is as doubtful as empty.
    (h1.srv / "model" / "config.json").write_text(json.dumps(TINY_CONFIG))
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json")
    assert cp.returncode == 2 and "source h1:/srv/model holds only 1 file" in cp.stderr, cp.stderr
    assert {h.name: _tree(h.srv / "model") for h in (h2, h3)} == before, "a refused sync changed files"

    # At a terminal the sync asks; no keeps everything.
    code, shown = _on_terminal(["sync", "-i", str(inv), "-p", str(pb), "--from", "h1"], b"n\n")
    assert code == 2 and "Delete them?" in shown, shown
    assert {h.name: _tree(h.srv / "model") for h in (h2, h3)} == before, "a refused sync changed files"

    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--delete-extras", "--json")
    assert cp.returncode == 0, cp.stderr + cp.stdout
    for h in (h2, h3):
        assert _tree(h.srv / "model") == _tree(h1.srv / "model"), h.name
    _fill_source(h2)  # h2 holds a full copy again: yes at the terminal deletes it as --delete-extras did
    code, shown = _on_terminal(["sync", "-i", str(inv), "-p", str(pb), "--from", "h1"], b"y\n")
    assert code == 0 and _tree(h2.srv / "model") == _tree(h1.srv / "model"), shown
    # A missing source dir stays refused.
    (h1.srv / "model" / "config.json").unlink()
    (h1.srv / "model" / "sub").rmdir()
    (h1.srv / "model").rmdir()
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--delete-extras")
    assert cp.returncode == 2 and "source h1 lacks /srv/model (no such directory)" in cp.stderr, cp.stderr


def test_roots_are_refused_and_relays_die_with_their_coordinator(testbed: TestBed, tmp_path: Path,
                                                                run_cli: RunCli) -> None:
    h1, h2 = testbed.add_hosts(2)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    for model, data, says in (("/", "/srv/data", "model: / is the filesystem root"),
                              ("/srv/data/model", "/srv/data", "model: /srv/data/model is inside data")):
        pb = _playbook(tmp_path / "pb.yaml", model, data)
        line = next(i for i, text in enumerate(pb.read_text().splitlines(), 1) if text.startswith("model:"))
        cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--check", timeout=30)
        assert cp.returncode == 2 and f"pb.yaml:{line}: {says}" in cp.stderr, cp.stderr
        assert len(cp.stderr.strip().splitlines()) == 1, cp.stderr

    _fill_source(h1)
    _fill_source(h2)
    with open(h2.srv / "model" / "huge.bin", "wb") as fh:  # sparse: h2's plan hashes 64 GiB of zeros (minutes)
        fh.truncate(64 << 30)
    pb = _playbook(tmp_path / "pb.yaml")
    argv = [sys.executable, "-m", "coordinator", "sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--check"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(" plan" in c for c in _relays(testbed, [h2])):
            time.sleep(0.2)
        assert any(" plan" in c for c in _relays(testbed, [h2])), "h2's plan never started"
        time.sleep(1)
        assert proc.poll() is None, "the coordinator ended before it could be killed mid-plan"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _relays(testbed, [h1, h2]):
        time.sleep(0.2)
    assert not _relays(testbed, [h1, h2]), "relay processes outlived their coordinator"


def test_stray_partials_long_names_and_a_failing_node(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    h1, h2, h3 = testbed.add_hosts(3)
    _fill_source(h1)
    long = "l" * 250  # `<name>.partial.sha256` would pass NAME_MAX (255)
    (h1.srv / "model" / long).write_bytes(b"long name\n")
    (h1.srv / "model" / "zz.bin").write_bytes(b"after the long name\n")
    for h in (h2, h3):
        _fill_source(h)
        (h.srv / "model" / "model.safetensors").write_bytes((h1.srv / "model" / "model.safetensors").read_bytes())
    # A wrong partial on h2: a dir (with a file in it) where the big file's partial goes.
    (h2.srv / "model" / "model.safetensors").unlink()
    (h2.srv / "model" / "model.safetensors.partial").mkdir()
    (h2.srv / "model" / "model.safetensors.partial" / "junk").write_bytes(b"junk")
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    pb = _playbook(tmp_path / "pb.yaml")
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json")
    assert cp.returncode == 0, cp.stderr + cp.stdout
    doc = json.loads(cp.stdout)
    assert doc["ok"] and doc["verified"] == {"h2": True, "h3": True} and doc["errors"] == {}, doc
    for h in (h2, h3):
        assert _tree(h.srv / "model") == _tree(h1.srv / "model"), h.name

    # h2 fails one file (its `sub` is a symlinked dir, refused: nothing is written through it): the file after it
    # and h3, after h2 in the chain, are served all the same, in seconds.
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(h2.srv / "model" / "sub")
    (h2.srv / "model" / "sub").symlink_to(outside)
    (h2.srv / "model" / "zz.bin").unlink()
    (h3.srv / "model" / "tokenizer.json").unlink()
    (h3.srv / "model" / "zz.bin").unlink()
    started = time.monotonic()
    cp = run_cli("sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json")
    elapsed = time.monotonic() - started
    assert cp.returncode == 1, cp.stderr + cp.stdout
    doc = json.loads(cp.stdout)
    assert doc["verified"]["h3"] and doc["differences"]["h2"] == ["differs or missing: model/sub/small.bin"], doc
    assert "model/sub/small.bin" in doc["errors"]["h2"] and "symlink" in doc["errors"]["h2"], doc["errors"]
    assert (h2.srv / "model" / "zz.bin").read_bytes() == b"after the long name\n"
    assert _tree(h3.srv / "model") == _tree(h1.srv / "model") and not any(outside.iterdir())
    assert elapsed < 30, f"took {elapsed:.0f}s: a failed node held up the chain"


def test_a_hung_relay_is_routed_around_in_seconds(testbed: TestBed, tmp_path: Path, run_cli: RunCli) -> None:
    from tests.testbed import _netns_pids

    h1, h2, h3 = testbed.add_hosts(3)
    _fill_source(h1, big=12 * CHUNK)
    # ~1.2 MB/s into h2: its relay is still receiving when it is frozen (SIGSTOP: alive, silent, reading nothing).
    subprocess.run(["tc", "qdisc", "add", "dev", h2.veth, "root", "tbf", "rate", "10mbit", "burst", "32kb",
                    "latency", "50ms"], check=True)
    inv = testbed.write_inventory(tmp_path / "inv.yaml")
    pb = _playbook(tmp_path / "pb.yaml")
    argv = [sys.executable, "-m", "coordinator", "sync", "-i", str(inv), "-p", str(pb), "--from", "h1", "--json"]
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen: list[int] = []
    partial = h2.srv / "model" / "model.safetensors.partial"
    deadline = time.monotonic() + 60
    while not frozen and time.monotonic() < deadline and proc.poll() is None:
        if not (partial.exists() and partial.stat().st_size > CHUNK):  # mid-stream
            time.sleep(0.05)
            continue
        for pid in _netns_pids([h2.ns])[h2.ns]:
            with contextlib.suppress(OSError):
                if b"worker.relay\0serve" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGSTOP)
                    frozen.append(pid)
        time.sleep(0.05)
    assert frozen, "h2's relay never started"
    subprocess.run(["tc", "qdisc", "del", "dev", h2.veth, "root"], check=True)
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, err + out
    doc = json.loads(out)
    assert doc["ok"] and doc["verified"] == {"h2": True, "h3": True}, doc
    assert "silent" in doc["fallback"]["h2"], doc["fallback"]
    for h in (h2, h3):
        assert _tree(h.srv / "model") == _tree(h1.srv / "model"), h.name
    assert elapsed < 45, f"took {elapsed:.0f}s: the chain waited for the hung relay"
