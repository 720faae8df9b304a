"""Inventory loading: files of every format in, Nodes out; bad files in, `file:line: message` out.

Fixtures live in tests/fixtures/config/{good,bad}; the repo's own samples under inventory/ must load too.
The expected Ansible results were checked against `ansible-inventory --list` (ansible-core 2.19).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coordinator.config.inventory import InventoryFormat, detect_inventory_format, load_inventory
from coordinator.config.inventory.ansible import expand_host_pattern
from coordinator.config.yamlsrc import parse_yaml
from coordinator.errors import ConfigError
from coordinator.models import Connection, Inventory, Node, parse_limit

REPO = Path(__file__).resolve().parents[2]
GOOD = REPO / "tests" / "fixtures" / "config" / "good"
BAD = REPO / "tests" / "fixtures" / "config" / "bad"
LOCAL = Connection.LOCAL


def _at(name: str, line: int) -> str:
    return f"{GOOD / name}:{line}"


GOOD_CASES: list[tuple[str, InventoryFormat, list[Node]]] = [
    ("inventory.yaml", InventoryFormat.YAML, [
        Node("ultra", "192.168.1.10", user="mlx", port=22, python="~/venvs/mlx/bin/python", workdir="~/mlx-work",
             identity="~/.ssh/id_ed25519", known_hosts="~/.ssh/known_hosts", ips=("10.0.0.1",),
             labels=(("role", "primary"), ("tb", "5")),
             env=(("MLX_A", "1"), ("SHARED", "node"), ("FLAG", "false")), source=_at("inventory.yaml", 12)),
        Node("max.laptop_2", "mbp.local", user="alex", port=2222, python="/opt/homebrew/bin/python3",
             workdir="/Volumes/Scratch/mlx", identity="~/.ssh/mbp_key", known_hosts="~/.ssh/lab_known_hosts",
             ips=("fe80::1%en2",), env=(("MLX_A", "1"), ("SHARED", "default")), source=_at("inventory.yaml", 18)),
        Node("here", "127.0.0.1", connection=LOCAL, user="mlx", port=22, python="~/venvs/mlx/bin/python",
             workdir="~/mlx-work", identity="~/.ssh/id_ed25519", known_hosts="~/.ssh/known_hosts",
             env=(("MLX_A", "1"), ("SHARED", "default")), source=_at("inventory.yaml", 29)),
    ]),
    ("hostfile-list.json", InventoryFormat.MLX_HOSTFILE, [
        Node("10.0.0.1", "10.0.0.1", user="mlx", ips=("10.0.0.1",), source=_at("hostfile-list.json", 2)),
        Node("10.0.0.2", "10.0.0.2", ips=("10.0.0.2",), source=_at("hostfile-list.json", 3)),
        Node("10.0.0.2-2", "10.0.0.2", user="mlx", source=_at("hostfile-list.json", 4)),
        Node("127.0.0.1", "127.0.0.1", connection=LOCAL, source=_at("hostfile-list.json", 5)),
    ]),
    ("hostfile-dict.json", InventoryFormat.MLX_HOSTFILE, [
        Node("studio.local", "studio.local", ips=("10.10.0.1",), env=(("MLX_METAL_FAST_SYNCH", "1"), ("EMPTY", "")),
             source=_at("hostfile-dict.json", 5)),
        Node("mbp.local", "mbp.local", user="alex", ips=("10.10.0.2",),
             env=(("MLX_METAL_FAST_SYNCH", "1"), ("EMPTY", "")), source=_at("hostfile-dict.json", 6)),
    ]),
    ("ansible.yaml", InventoryFormat.ANSIBLE_YAML, [
        Node("control", "control", connection=LOCAL, user="mlx", python=sys.executable, workdir="~/lab-work",
             source=_at("ansible.yaml", 8)),
        Node("studio", "192.168.1.10", user="ultra", python="/opt/homebrew/bin/python3", workdir="~/lab-work",
             ips=("10.0.0.1",), labels=(("chip", "m3-ultra"),), source=_at("ansible.yaml", 16)),
        Node("mbp", "192.168.1.11", user="macadmin", port=2222, python="/opt/homebrew/bin/python3",
             workdir="~/lab-work", identity="~/.ssh/mbp", source=_at("ansible.yaml", 20)),
        Node("gpu01.lab", "gpu01.lab", user="mlx", workdir="~/lab-work", env=(("CUDA_VISIBLE_DEVICES", "0"),),
             source=_at("ansible.yaml", 32)),
        Node("gpu02.lab", "gpu02.lab", user="mlx", workdir="~/lab-work", env=(("CUDA_VISIBLE_DEVICES", "0"),),
             source=_at("ansible.yaml", 32)),
    ]),
    ("ansible.ini", InventoryFormat.ANSIBLE_INI, [
        Node("control", "control", connection=LOCAL, python=sys.executable, source=_at("ansible.ini", 3)),
        Node("studio", "192.168.1.10", user="mlx", python="/opt/homebrew/bin/python3", workdir="~/cluster-work",
             ips=("10.0.0.1",), source=_at("ansible.ini", 6)),
        Node("mbp", "192.168.1.11", user="mlx", port=2222, python="/opt/homebrew/bin/python3",
             workdir="~/cluster-work", source=_at("ansible.ini", 7)),
        Node("mini", "mini", user="mlx", port=2200, python="/opt/homebrew/bin/python3", workdir="~/cluster-work",
             source=_at("ansible.ini", 8)),
    ]),
    ("hosts", InventoryFormat.ANSIBLE_INI, [
        Node("studio", "192.168.1.10", user="mlx", source=_at("hosts", 1)),
        Node("mbp", "mbp", source=_at("hosts", 2)),
    ]),
]


@pytest.mark.parametrize(("name", "fmt", "expected"), GOOD_CASES, ids=[c[0] for c in GOOD_CASES])
def test_good_inventories(name: str, fmt: InventoryFormat, expected: list[Node]) -> None:
    path = GOOD / name
    assert detect_inventory_format(path.read_text(encoding="utf-8"), str(path)) == fmt
    inventory = load_inventory(path)
    assert inventory.path == str(path)
    assert list(inventory.nodes) == expected


def test_sample_local_inventory() -> None:
    inventory = load_inventory(REPO / "inventory" / "local.yaml")
    assert inventory.names() == ["local-a", "local-b"]
    for node in inventory.nodes:
        assert node.connection is Connection.LOCAL
        assert node.host == "127.0.0.1"  # the one host mlx.launch starts without ssh
        # A local node runs the coordinator's own interpreter, and its relative workdir is made absolute.
        assert node.python == sys.executable
        assert node.workdir == str(Path.cwd() / "runs" / "local" / node.name.removeprefix("local-"))


def test_sample_two_macs_inventory() -> None:
    inventory = load_inventory(REPO / "inventory" / "example-two-macs.yaml")
    studio, mbp = inventory.nodes
    assert (studio.name, studio.ssh_target, studio.data_ip) == ("studio", "mlx@studio.local", "10.10.0.1")
    assert (mbp.name, mbp.ssh_target, mbp.data_ip) == ("mbp", "alex@192.168.1.42", "10.10.0.2")
    assert studio.python == "~/venvs/mlx/bin/python"  # `~` is kept: it is expanded on the node


# (file, line, substring of the message after `file:line: `)
BAD_CASES: list[tuple[str, int, str]] = [
    ("inv-unknown-key.yaml", 3, "defaults: unknown key 'prot' (did you mean 'port'?)"),
    ("inv-unknown-node-key.yaml", 4, "nodes[0]: unknown key 'workdri' (did you mean 'workdir'?)"),
    ("inv-duplicate-key.yaml", 5, "duplicate key 'host' (first at line 3)"),
    ("inv-bad-port.yaml", 7, "nodes[1].port: must be an integer 1..65535 (got 'twenty-two')"),
    ("inv-port-range.yaml", 4, "nodes[0].port: must be an integer 1..65535 (got 70000)"),
    ("inv-duplicate-name.yaml", 6, "nodes[2].name: duplicate node name 'ultra' (first defined at line 2)"),
    ("inv-hostile-name.yaml", 2, "nodes[0].name: invalid name 'a;rm -rf /'"),
    ("inv-hostile-host.yaml", 3, "starts with '-': ssh would read it as an option"),
    ("inv-host-metachar.yaml", 3, "nodes[0].host: host '10.0.0.1;reboot' contains whitespace or characters"),
    ("inv-host-with-user.yaml", 3, "contains '@': put the user in `user:`"),
    ("inv-bad-ip.yaml", 6, "nodes[0].ips[1]: '10.0.0.256' is not a valid IP address"),
    ("inv-bad-connection.yaml", 4, "nodes[0].connection: must be one of 'ssh' or 'local' (got 'telnet')"),
    ("inv-env-name.yaml", 6, "nodes[0].env: environment variable name read as the boolean true"),
    ("inv-syntax.yaml", 4, "invalid YAML: "),
    ("inv-nodes-missing.yaml", 1, "missing required key 'nodes'"),
    ("inv-nodes-empty.yaml", 3, "nodes: must not be empty"),
    ("inv-ssh-no-host.yaml", 4, "nodes[1]: missing required key 'host'"),
    ("hostfile-bad-ip.json", 3, "hosts[1].ips[0]: '10.0.0' is not a valid IP address"),
    ("hostfile-bad-env.json", 3, "envs[0]: 'MLX_METAL_FAST_SYNCH' is not of the form NAME=value"),
    ("hostfile-hostile.json", 3, "hosts[1].ssh: host '-oProxyCommand=evil' starts with '-'"),
    ("hostfile-unknown-key.json", 2, "hosts[0]: unknown key 'ip' (did you mean 'ips'?)"),
    ("ansible-bad-port.yaml", 7, "host mbp: ansible_port: must be an integer 1..65535 (got 'ssh')"),
    ("ansible-hostile.ini", 3, "host a;reboot: name: invalid name 'a;reboot'"),
    ("ansible-template.ini", 5, "host studio: ansible_user: templated values"),
    ("ansible-connection.yaml", 6, "host c1: ansible_connection 'docker' is not supported"),
    ("ansible-bad-group-key.yaml", 6, "group 'macs': unknown key 'var' (did you mean 'vars'?)"),
    ("ansible-bad-section.ini", 4, "unknown section kind ':varz'"),
]


@pytest.mark.parametrize(("name", "line", "message"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_inventories(name: str, line: int, message: str) -> None:
    path = BAD / name
    with pytest.raises(ConfigError) as info:
        load_inventory(path)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"{path}:{line}: "), first
    assert message in first
    assert info.value.path == str(path) and info.value.line == line


def test_invalid_json_hostfile_has_line_and_column() -> None:
    path = BAD / "hostfile-invalid.json"
    with pytest.raises(ConfigError) as info:
        load_inventory(path)
    assert str(info.value) == f"{path}:3:26: invalid JSON: Expecting ',' delimiter"
    assert info.value.location_message() == str(info.value)
    assert (info.value.path, info.value.line) == (str(path), 3)


def test_several_errors_are_all_reported_in_line_order() -> None:
    text = "nodes:\n  - name: a\n    host: h\n    port: 0\n  - name: b\n    hots: x\n"
    path = BAD / "virtual.yaml"
    from coordinator.config.inventory import parse_inventory

    with pytest.raises(ConfigError) as info:
        parse_inventory(text, str(path))
    lines = str(info.value).splitlines()
    assert lines[0] == f"{path}:4: nodes[0].port: must be an integer 1..65535 (got 0)"
    assert lines[1] == f"{path}:6: nodes[1]: unknown key 'hots' (did you mean 'host'?)"


def test_empty_and_missing_files() -> None:
    with pytest.raises(ConfigError, match=r"inv-empty\.yaml: inventory is empty"):
        load_inventory(BAD / "inv-empty.yaml")
    with pytest.raises(ConfigError, match=r"nope\.yaml: inventory not found"):
        load_inventory(BAD / "nope.yaml")


def test_env_and_label_values_are_kept_as_typed() -> None:
    from coordinator.config.inventory import parse_inventory

    text = "nodes:\n  - name: a\n    host: h\n    env: {A: off, B: 1.10, C: 010, D: 'x'}\n    labels: {v: 1.20}\n"
    (node,) = parse_inventory(text, "x.yaml").nodes
    assert node.env_dict == {"A": "off", "B": "1.10", "C": "010", "D": "x"}
    assert node.label_dict == {"v": "1.20"}


@pytest.mark.parametrize(("pattern", "expected"), [
    ("plain", ["plain"]),
    ("web[01:03].lab", ["web01.lab", "web02.lab", "web03.lab"]),
    ("n[1:3:2]", ["n1", "n3"]),
    ("r[a:c]", ["ra", "rb", "rc"]),
])
def test_expand_host_pattern(pattern: str, expected: list[str]) -> None:
    assert expand_host_pattern(pattern) == expected


# --- yamlsrc: the line-keeping YAML reader both loaders share ---------------------------------------------------


def test_yamlsrc_lines_and_nearest_ancestor() -> None:
    src = parse_yaml("a:\n  b:\n    - x\n    - {c: 1}\nd: 2\n", "f.yaml")
    assert src.value == {"a": {"b": ["x", {"c": 1}]}, "d": 2}
    assert src.line_for(("a", "b", 1, "c")) == 4
    assert src.line_for(("a", "b", 0)) == 3
    assert src.line_for(("a", "b", 1, "missing", "deeper")) == 4
    assert src.line_for(("zzz",)) == 1
    assert src.where(("d",)) == "f.yaml:5"


def test_yamlsrc_merge_keys_do_not_count_as_duplicates() -> None:
    src = parse_yaml("base: &b\n  x: 1\n  y: 2\nuse:\n  <<: *b\n  y: 3\n", "f.yaml")
    assert src.value["use"] == {"x": 1, "y": 3}
    assert src.line_for(("use", "y")) == 6  # the explicit key, not the merged one
    assert src.line_for(("use", "x")) == 2  # a merged key points at where it was written


@pytest.mark.parametrize(("text", "line", "message"), [
    ("a: 1\nb: 2\na: 3\n", 3, "duplicate key 'a' (first at line 1)"),
    ("a: 1\n---\nb: 2\n", 2, "a second document ('---') starts here"),
    ("a: !!python/object:os.system x\n", 1, "could not determine a constructor"),
    ("a:\n\tb: 1\n", 2, "indent with spaces, not tabs"),
    ("a: b: c\n", 1, "mapping values are not allowed here (column 5)"),
])
def test_yamlsrc_errors(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_yaml(text, "f.yaml")
    assert str(info.value).startswith(f"f.yaml:{line}: ")
    assert message in str(info.value)


@pytest.mark.parametrize(("text", "names"), [(None, None), ("a", ["a"]), (" a , b ", ["a", "b"])])
def test_parse_limit(text: str | None, names: list[str] | None) -> None:
    assert parse_limit(text) == names


@pytest.mark.parametrize(("text", "message"), [
    ("", "--limit '' names no node"), (",", "--limit ',' names no node"), ("  ", "--limit '  ' names no node"),
    ("a,,b", "--limit 'a,,b' has an empty name between commas"), ("a,", "--limit 'a,' has an empty name"),
])
def test_a_limit_naming_nobody_is_an_error_not_the_whole_fleet(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_limit(text)
    inv = Inventory((Node("a", "h"),))
    with pytest.raises(ConfigError, match="--limit names no node; known: a"):
        inv.limit([])
    assert inv.limit(None) is inv
