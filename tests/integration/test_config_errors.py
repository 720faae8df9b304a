"""Malformed inventories and playbooks through the real CLI: exit 2, one `file:line: message` on stderr, no traceback.

No hosts are needed: every one of these fails while loading, before any connection is attempted (the inventories
name addresses of TEST-NET-1, 192.0.2.0/24, which nothing answers).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.conftest import RunCli

GOOD_INVENTORY = """\
nodes:
  - name: a
    host: 192.0.2.1
"""

GOOD_PLAYBOOK = """\
name: t
model: /srv/model
data: /srv/data
"""


@dataclass(frozen=True)
class Case:
    id: str
    file: str  # the file name of the bad one; the other of the pair is the good one above
    text: str
    line: str  # expected `line` (or `line:col`) after the file name
    fragments: tuple[str, ...]  # in the message after `file:line: `

    @property
    def is_playbook(self) -> bool:
        return self.file.startswith("pb")


CASES = [
    Case(
        "inventory-unknown-key", "inv.yaml",
        "defaults:\n  user: root\nnodes:\n  - name: a\n    host: 192.0.2.1\n    workdri: /srv/work\n",
        "6", ("nodes[0]: unknown key 'workdri'", "did you mean 'workdir'?"),
    ),
    Case(
        "inventory-bad-yaml", "inv.yaml",
        "nodes:\n  - name: a\n    host: 192.0.2.1\n   port: 22\n",
        "4", ("invalid YAML",),
    ),
    Case(
        "inventory-duplicate-node-name", "inv.yaml",
        "nodes:\n  - name: a\n    host: 192.0.2.1\n  - name: b\n    host: 192.0.2.2\n  - name: a\n    host: 192.0.2.3\n",
        "6", ("nodes[2].name: duplicate node name 'a' (first defined at line 2)",),
    ),
    Case(
        "inventory-hostile-node-name", "inv.yaml",
        'nodes:\n  - name: a\n    host: 192.0.2.1\n  - name: "b;touch /tmp/pwned-name"\n    host: 192.0.2.2\n',
        "4", ("nodes[1].name: invalid name 'b;touch /tmp/pwned-name'", "use only letters, digits"),
    ),
    Case(
        "inventory-hostile-host", "inv.yaml",
        'nodes:\n  - name: a\n    host: "-oProxyCommand=touch /tmp/pwned-host"\n',
        "3", ("starts with '-'", "ssh would read it as an option"),
    ),
    Case(
        "hostfile-invalid-json", "hosts.json",
        '[\n  {"ssh": "root@192.0.2.1", "ips": ["192.0.2.1"]},\n  {"ssh": "root@192.0.2.2", "ips": ["192.0.2.2"]},\n]\n',
        "4:1", ("invalid JSON: Expecting value",),
    ),
    Case(
        "hostfile-unknown-key", "hosts.json",
        '[\n  {"ssh": "root@192.0.2.1", "ips": ["192.0.2.1"]},\n  {"ssh": "root@192.0.2.2", "ip": ["192.0.2.2"]}\n]\n',
        "3", ("unknown key 'ip'",),
    ),
    Case(
        "playbook-unknown-key", "pb.yaml",
        "name: t\nmodel: /srv/model\ndata: /srv/data\nbakend: ring\n",
        "4", ("unknown key 'bakend'", "did you mean 'backend'?"),
    ),
    Case(
        "playbook-bad-yaml", "pb.yaml",
        "name: t\nmodel: [/srv/model\ndata: /srv/data\n",
        "3", ("invalid YAML",),
    ),
    Case(
        "playbook-unknown-check-id", "pb.yaml",
        "name: t\nmodel: /srv/model\ndata: /srv/data\nchecks:\n  skip: [rdma, thunderbolts]\n",
        "5", ("checks.skip[1]: unknown check id 'thunderbolts'", "did you mean 'thunderbolt'?",
            "known: ssh, os, rdma, thunderbolt, software, model, env, resources"),
    ),
    Case(
        "playbook-unknown-train-key", "pb.yaml",
        "name: t\nmodel: /srv/model\ndata: /srv/data\ntrain:\n  method: lora\n  batchsize: 4\n",
        "6", ("unknown key", "batchsize"),
    ),
]


def _args(verb: str, inventory: Path, playbook: Path) -> list[str]:
    return [verb, "-i", str(inventory), "-p", str(playbook), *(["--json"] if verb == "preflight" else [])]


def _assert_usage_error(cp: subprocess.CompletedProcess[str], where: str, fragments: tuple[str, ...]) -> None:
    assert cp.returncode == 2, (cp.returncode, cp.stdout, cp.stderr)
    assert "Traceback" not in cp.stderr and "Traceback" not in cp.stdout, cp.stderr
    assert cp.stdout == "", cp.stdout  # nothing half-done on stdout (a --json consumer sees no report)
    lines = cp.stderr.splitlines()
    assert len(lines) == 1, cp.stderr  # one line, the message
    prefix = f"coordinator: error: {where}: "
    assert lines[0].startswith(prefix), (prefix, cp.stderr)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, cp.stderr)


# Every case through preflight; `facts` loads inventories the same way, so a few of them through it as well.
ALSO_FACTS = {"inventory-unknown-key", "inventory-duplicate-node-name", "hostfile-invalid-json"}
RUNS = [
    pytest.param(case, verb, id=f"{case.id}-{verb}")
    for case in CASES
    for verb in (("preflight", "facts") if case.id in ALSO_FACTS else ("preflight",))
]


@pytest.mark.parametrize(("case", "verb"), RUNS)
def test_malformed_config_is_a_usage_error_with_its_line(case: Case, verb: str, tmp_path: Path, run_cli: RunCli) -> None:
    bad = tmp_path / case.file
    bad.write_text(case.text)
    inventory, playbook = tmp_path / "good-inv.yaml", tmp_path / "good-pb.yaml"
    inventory.write_text(GOOD_INVENTORY)
    playbook.write_text(GOOD_PLAYBOOK)
    if case.is_playbook:
        playbook = bad
    else:
        inventory = bad
    cp = run_cli(*_args(verb, inventory, playbook), timeout=60)
    _assert_usage_error(cp, f"{bad}:{case.line}", case.fragments)


def test_invalid_json_names_line_and_column(tmp_path: Path, run_cli: RunCli) -> None:
    """The JSON decoder's own position (`file:line:col:`), as editors and compilers print it."""
    bad = tmp_path / "hosts.json"
    bad.write_text('[\n  {"ssh": "root@192.0.2.1"\n  "ips": []}\n]\n')  # missing comma before line 3's "ips"
    cp = run_cli("facts", "-i", str(bad), timeout=60)
    _assert_usage_error(cp, f"{bad}:3:3", ("invalid JSON: Expecting ',' delimiter",))


@pytest.mark.parametrize("which", ["inventory", "playbook"])
def test_nonexistent_file(which: str, tmp_path: Path, run_cli: RunCli) -> None:
    inventory, playbook = tmp_path / "inv.yaml", tmp_path / "pb.yaml"
    inventory.write_text(GOOD_INVENTORY)
    playbook.write_text(GOOD_PLAYBOOK)
    missing = tmp_path / "no-such-dir" / f"{which}.yaml"
    if which == "inventory":
        inventory = missing
    else:
        playbook = missing
    cp = run_cli("preflight", "-i", str(inventory), "-p", str(playbook), "--json", timeout=60)
    _assert_usage_error(cp, str(missing), (f"{which} not found",))


def test_limit_naming_an_unknown_node(tmp_path: Path, run_cli: RunCli) -> None:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(GOOD_INVENTORY)
    cp = run_cli("facts", "-i", str(inventory), "--limit", "a,zz", timeout=60)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr == "coordinator: error: --limit names unknown node(s): zz; known: a\n"


def test_bad_flag_value_is_a_usage_error(tmp_path: Path, run_cli: RunCli) -> None:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(GOOD_INVENTORY)
    cp = run_cli("preflight", "-i", str(inventory), "--connect-timeout", "0", timeout=60)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr
    assert "--connect-timeout" in cp.stderr


def test_restart_from_scratch_without_resume_is_a_usage_error(tmp_path: Path, run_cli: RunCli) -> None:
    inventory, playbook = tmp_path / "inv.yaml", tmp_path / "pb.yaml"
    inventory.write_text(GOOD_INVENTORY)
    playbook.write_text(GOOD_PLAYBOOK)
    cp = run_cli("launch", "-i", str(inventory), str(playbook), "--restart-from-scratch", timeout=60)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr == "coordinator: error: --restart-from-scratch applies to --resume RUN_ID only\n"
