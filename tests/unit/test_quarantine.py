"""The quarantine store: keying by machine (inventory + name + address), expiry, the file's shape (wrong shapes
are one-line errors naming the file, old name-keyed files are read with a note), the degraded-launch gate and its
warning block, and the `quarantine` verbs on such files."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import asyncssh
import pytest
from click.testing import CliRunner
from rich.console import Console

from coordinator.cli import main
from coordinator.config.playbook import FaultsConfig, Playbook
from coordinator.errors import ConfigError
from coordinator.fleet.transport import known_host_keys
from coordinator.models import Inventory, Node
from coordinator.run.job import JobOptions, QuietUI, usable_inventory
from coordinator.run.launch import LaunchError
from coordinator.run.monitor import Monitor, PlannedRank
from coordinator.run.quarantine import (
    DEFAULT_QUARANTINE_FOR,
    Entry,
    LeftOut,
    QuarantineStore,
    check_degraded,
    compute_left_out,
    dump_state,
    format_left_out,
    inventory_key,
    matching_entry,
    new_entry,
    parse_state,
    replaced,
)
from coordinator.views.liveview import RichUI, build_table

NOW = 1_700_000_000.0
A, B = "/fleets/a.yaml", "/fleets/b.yaml"
N2 = Node("n2", "10.0.0.2")
N2_OTHER_HOST = Node("n2", "10.0.9.2")
N2_OTHER_PORT = Node("n2", "10.0.0.2", port=2222)


def entry(node: Node = N2, inventory: str | None = A, *, t: float = NOW, quarantine_for: float = 3600.0) -> Entry:
    return new_entry(node, inventory, "crash at step 5", run_id="r1", incident={"kind": "crash"},
                     host_key="ssh-ed25519 SHA256:abc", now=t, quarantine_for=quarantine_for)


# --- keying and expiry -----------------------------------------------------------------------------------------


def test_an_entry_leaves_out_only_its_own_inventorys_node_at_its_own_address() -> None:
    e = entry()
    assert (e.inventory, e.host, e.host_key) == (A, "10.0.0.2", "ssh-ed25519 SHA256:abc")
    assert matching_entry([e], A, N2, NOW) == e
    assert matching_entry([e], B, N2, NOW) is None  # same name, another fleet
    assert matching_entry([e], A, N2_OTHER_HOST, NOW) is None  # the name now points at another machine
    assert matching_entry([e], A, N2_OTHER_PORT, NOW) is None
    assert matching_entry([e], A, Node("n3", "10.0.0.2"), NOW) is None
    assert entry(N2_OTHER_PORT).host == "10.0.0.2:2222"


def test_an_inventory_without_a_file_is_its_own_scope() -> None:
    e = entry(inventory=None)
    assert e.inventory == ""
    assert matching_entry([e], None, N2, NOW) == e
    assert matching_entry([e], A, N2, NOW) is None


def test_expiry_and_until_cleared() -> None:
    e = entry(quarantine_for=3600)
    assert e.expires == NOW + 3600
    assert matching_entry([e], A, N2, NOW + 3599) == e
    assert matching_entry([e], A, N2, NOW + 3600) is None
    forever = entry(quarantine_for=0)
    assert forever.expires is None and matching_entry([forever], A, N2, NOW + 10 * 365 * 86400) == forever


def test_store_add_replaces_the_same_machine_and_drops_expired_entries(tmp_path: Path) -> None:
    store = QuarantineStore(tmp_path / "q.json")
    old = entry(Node("n1", "10.0.0.1"), t=NOW - 7200, quarantine_for=3600)  # expired an hour ago
    store.add(old, now=NOW - 7200)
    store.add(entry(t=NOW - 10), now=NOW - 10)
    store.add(entry(inventory=B, t=NOW - 5), now=NOW - 5)
    latest = new_entry(N2, A, "hang at step 9", run_id="r2", incident={}, host_key=None, now=NOW, quarantine_for=60)
    store.add(latest, now=NOW)
    entries = store.read().entries
    assert [(e.node, e.inventory, e.reason) for e in entries] == [("n2", B, "crash at step 5"),
                                                                   ("n2", A, "hang at step 9")]
    assert parse_state(dump_state(entries), "x").entries == entries  # the file round-trips


def test_compute_left_out_in_inventory_order() -> None:
    inv = Inventory((Node("n1", "10.0.0.1"), N2, Node("n3", "10.0.0.3")), A)
    entries = [entry(Node("n3", "10.0.0.3")), entry(), entry(Node("n1", "10.0.0.1"), inventory=B)]
    left = compute_left_out(inv, A, entries, NOW + 60)
    assert [lo.node for lo in left] == ["n2", "n3"]
    assert left[0].reason == "quarantined: crash at step 5 (run r1, 60s ago; expires in 59m)"
    assert left[0].to_json() == {"node": "n2", "reason": left[0].reason}


def test_clear_by_name_everywhere_or_in_one_inventory(tmp_path: Path) -> None:
    store = QuarantineStore(tmp_path / "q.json")
    store.add(entry(), now=NOW)
    store.add(entry(inventory=B), now=NOW)
    store.add(entry(Node("n1", "10.0.0.1")), now=NOW)
    assert [e.inventory for e in store.clear("n2", inventory=B)] == [B]
    assert [(e.node, e.inventory) for e in store.read().entries] == [("n2", A), ("n1", A)]
    assert store.clear("n2", inventory=B) == []
    store.add(entry(inventory=B), now=NOW)
    assert sorted(str(e.inventory) for e in store.clear("n2")) == [A, B]
    assert [e.node for e in store.read().entries] == ["n1"]


def test_inventory_key_is_the_real_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "inv.yaml"
    real.write_text("nodes: []\n")
    (tmp_path / "link.yaml").symlink_to(real)
    monkeypatch.chdir(tmp_path)
    assert inventory_key("inv.yaml") == inventory_key(str(tmp_path / "link.yaml")) == str(real)
    assert inventory_key(None) is None


# --- the file's shape ------------------------------------------------------------------------------------------


def test_an_absent_or_empty_file_is_no_quarantine(tmp_path: Path) -> None:
    assert QuarantineStore(tmp_path / "none.json").read().entries == ()
    assert parse_state("{}", "q.json").entries == ()


@pytest.mark.parametrize(("text", "says"), [
    ("[]", "the top level must be an object, got []"),
    ('"nodes"', "the top level must be an object"),
    ('{"hosts": {}}', 'the top level must be an object with "version" and "entries"'),
    ('{"version": 2, "entries": {}}', '"entries" must be a list'),
    ('{"version": 2}', '"entries" must be a list, got null'),
    ('{"version": "2", "entries": []}', '"version" must be 2'),
    ('{"version": 2, "entries": [3]}', "entries[0] must be an object, got 3"),
    ('{"version": 2, "entries": [{"t": 1}]}', "entries[0].node must be a node name, got null"),
    ('{"version": 2, "entries": [{"node": "n", "t": "yesterday"}]}', 'entries[0].t must be a number, got "yesterday"'),
    ('{"version": 2, "entries": [{"node": "n", "t": 1, "expires": "never"}]}', "entries[0].expires must be a number or null"),
    ('{"version": 2, "entries": [{"node": "n", "t": 1, "inventory": "/a"}]}', "entries[0].inventory and .host must be both set"),
    ('{"version": 2, "entries": [{"node": "n", "t": 1, "incident": []}]}', "entries[0].incident must be an object"),
    ('{"version": 2, "entries": [{"node": "n", "t": true}]}', "entries[0].t must be a number, got true"),
    ('{"nodes": []}', '"nodes" must be an object of node name -> entry'),
    ('{"nodes": {"n2": "crash"}}', 'nodes["n2"] must be an object, got "crash"'),
    ('{"nodes": {"n2": {"t": "x"}}}', 'nodes["n2"].t must be a number'),
    ('{"nodes": {"n2": {"t": 1, "reason": 7}}}', 'nodes["n2"].reason must be a string or null, got 7'),
])
def test_a_wrong_shape_is_a_one_line_error_naming_the_file(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_state(text, "/state/quarantine.json")
    message = err.value.location_message()
    assert message.startswith("/state/quarantine.json: quarantine state has the wrong shape: ")
    assert says in message and "\n" not in message
    assert err.value.exit_code == 2


def test_invalid_json_names_the_line() -> None:
    with pytest.raises(ConfigError) as err:
        parse_state('{\n  "version": 2,\n  "entries": [,]\n}', "q.json")
    assert err.value.location_message().startswith("q.json:3: quarantine state is not valid JSON")


def test_a_newer_version_says_so() -> None:
    with pytest.raises(ConfigError, match="version 3, written by a newer coordinator"):
        parse_state('{"version": 3, "entries": []}', "q.json")


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "q.json").mkdir()
    with pytest.raises(ConfigError, match="quarantine state is unreadable"):
        QuarantineStore(tmp_path / "q.json").read()
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="unreadable"):
        QuarantineStore(tmp_path / "bin.json").read()


OLD = {"nodes": {"n2": {"reason": "crash at step 5", "run_id": "r0", "t": NOW, "incident": {"kind": "crash"}}}}


def test_an_old_format_file_is_read_with_a_note_and_applies_to_any_inventory_for_the_default_cooldown() -> None:
    state = parse_state(json.dumps(OLD), "q.json")
    [e] = state.entries
    assert e.legacy and (e.inventory, e.host) == (None, None)
    assert e.expires == NOW + DEFAULT_QUARANTINE_FOR
    assert matching_entry([e], A, N2, NOW) == e and matching_entry([e], B, N2_OTHER_HOST, NOW) == e
    assert matching_entry([e], A, N2, NOW + DEFAULT_QUARANTINE_FOR) is None
    [note] = state.notes
    assert note.startswith("q.json: old name-keyed format: its 1 entry leave out a node of that name in any inventory")
    assert "the next change rewrites the file" in note
    # A scoped entry of the same machine wins over the old one (its reason and expiry are the ones shown).
    assert matching_entry([e, entry()], A, N2, NOW) == entry()


def test_the_next_change_rewrites_an_old_file_in_the_current_format(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps(OLD))
    store = QuarantineStore(path)
    store.add(entry(Node("n1", "10.0.0.1")), now=NOW)
    doc = json.loads(path.read_text())
    assert doc["version"] == 2
    assert [(e["node"], e["inventory"]) for e in doc["entries"]] == [("n2", None), ("n1", A)]
    assert store.read().notes == ()
    assert [e.node for e in store.clear("n2", inventory=B)] == ["n2"]  # old entries apply to every inventory


# --- degraded launches -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("named", "usable", "min_nodes", "explicit", "allow", "fresh", "verdict"), [
    (3, 3, 1, False, False, True, None),
    (3, 2, 1, False, False, True, "would start degraded on 2 of 3 node(s)"),
    (3, 2, 1, False, True, True, None),  # --allow-degraded
    (3, 2, 2, True, False, True, None),  # a written faults.min_nodes says 2 are enough
    (3, 2, 1, True, False, True, None),
    (3, 1, 2, True, True, True, "1 usable node(s) of 3 < faults.min_nodes 2"),  # never below min_nodes
    (3, 2, 1, False, False, False, None),  # --resume: follows min_nodes like a relaunch
    (1, 0, 1, False, True, True, "0 usable node(s) of 1 < faults.min_nodes 1"),
])
def test_check_degraded(named: int, usable: int, min_nodes: int, explicit: bool, allow: bool, fresh: bool,
                        verdict: str | None) -> None:
    got = check_degraded(named, usable, min_nodes=min_nodes, min_nodes_explicit=explicit, allow_degraded=allow,
                         fresh=fresh)
    if verdict is None:
        assert got is None
    else:
        assert got is not None and got.startswith(verdict)


def test_the_warning_block_names_each_node_why_and_the_command_that_brings_it_back() -> None:
    left = [LeftOut("n2", "quarantined: crash at step 5 (run r1, 60s ago; expires in 59m)"),
            LeftOut("n3", "quarantined: hang at step 2 (run r1, 60s ago; until cleared)")]
    block = format_left_out(left, 4, "inv/fleet.yaml")
    assert block.splitlines() == [
        "DEGRADED: 2 of 4 node(s) of inv/fleet.yaml; left out:",
        "  n2: quarantined: crash at step 5 (run r1, 60s ago; expires in 59m)",
        "    bring it back: coordinator quarantine clear n2 -i inv/fleet.yaml",
        "  n3: quarantined: hang at step 2 (run r1, 60s ago; until cleared)",
        "    bring it back: coordinator quarantine clear n3 -i inv/fleet.yaml",
    ]
    assert format_left_out([], 4, "inv/fleet.yaml") == ""  # never a header with nothing after it


def test_quarantine_for_accepts_seconds_and_units() -> None:
    assert FaultsConfig().quarantine_for == DEFAULT_QUARANTINE_FOR
    assert [FaultsConfig(quarantine_for=v).quarantine_for for v in (0, "90", "30m", "24h", " 7d")] == \
        [0, 90, 1800, 86400, 7 * 86400]
    for bad in ("soon", "h", True, "-1h"):
        with pytest.raises(ValueError):
            FaultsConfig(quarantine_for=bad)


# --- the verbs -------------------------------------------------------------------------------------------------


def cli(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), env={"XDG_STATE_HOME": str(tmp_path)})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def test_verbs_on_a_wrong_shaped_file_exit_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "mlx-coordinator" / "quarantine.json"
    path.parent.mkdir()
    path.write_text('["n2"]')
    for args in (("quarantine", "list"), ("quarantine", "list", "--json"), ("quarantine", "clear", "n2")):
        code, out, err = cli(tmp_path, *args)
        assert (code, out) == (2, "")
        assert err == f"coordinator: error: {path}: quarantine state has the wrong shape: the top level must be an " \
                      "object, got [\"n2\"] (fix the file, or delete it to forget every quarantine)\n"


def test_list_and_clear(tmp_path: Path) -> None:
    store = QuarantineStore(tmp_path / "mlx-coordinator" / "quarantine.json")
    store.path.parent.mkdir()
    store.path.write_text(json.dumps({"nodes": {"n9": {"reason": "hang", "t": 1.0}}}))  # expired long ago
    code, out, err = cli(tmp_path, "quarantine", "list")
    assert (code, out) == (0, "no node is quarantined\n") and "old name-keyed format" in err
    inv_a = tmp_path / "a.yaml"
    inv_a.write_text("nodes: []\n")
    store.add(entry(inventory=str(inv_a), t=time.time(), quarantine_for=0))
    store.add(entry(inventory=B, t=time.time()))
    code, out, _ = cli(tmp_path, "quarantine", "list", "--json")
    rows = json.loads(out)["entries"]
    assert code == 0 and [(r["inventory"], r["expires"] is None) for r in rows] == [(str(inv_a), True), (B, False)]
    assert rows[1]["expires_in_s"] > 3500 and rows[0]["host_key"] == "ssh-ed25519 SHA256:abc"
    code, out, _ = cli(tmp_path, "quarantine", "list", "-i", str(inv_a))
    assert code == 0 and out.startswith(f"n2 10.0.0.2 in {inv_a}\tcrash at step 5\trun r1\t") and "until cleared" in out
    assert len(out.splitlines()) == 1
    code, out, _ = cli(tmp_path, "quarantine", "clear", "n2", "-i", str(inv_a))
    assert (code, out) == (0, f"cleared n2 10.0.0.2 in {inv_a}\n")
    code, _, err = cli(tmp_path, "quarantine", "clear", "n2", "-i", str(inv_a))
    assert code == 2 and f"n2 is not quarantined in {inv_a}" in err
    code, out, _ = cli(tmp_path, "quarantine", "clear", "n2")
    assert (code, out) == (0, f"cleared n2 10.0.0.2 in {B}\n")


def test_the_live_view_prints_the_block_and_keeps_saying_degraded() -> None:
    console = Console(record=True, width=200, force_terminal=False)
    ui = RichUI(console)
    ui.degraded("DEGRADED: 1 of 2 node(s) of inv.yaml; left out:\n  n2: quarantined: hang [rank 1]", ["n2"])
    mon = Monitor.create([PlannedRank(0, "a", 1, None)], iters=4, now=0.0)
    ui.progress(mon, 10.0)  # not a terminal: the plain progress line
    text = console.export_text()
    assert "  n2: quarantined: hang [rank 1]\n" in text  # printed as written, not read as markup
    assert "step 0/4  loss -  - real tokens/s  ETA -  [a 0 pending]  DEGRADED (n2 left out)\n" in text
    table = Console(record=True, width=200)
    table.print(build_table(mon, 10.0, ["n2"]))
    assert "DEGRADED: n2 left out" in table.export_text()


class Shown(QuietUI):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)

    def degraded(self, warning: str, nodes: Sequence[str]) -> None:
        self.lines.append(f"degraded {list(nodes)}: {warning}")


def test_usable_inventory_says_nothing_about_another_fleets_nodes_and_gates_a_degraded_start(tmp_path: Path) -> None:
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text("nodes: []\n")
    inv = Inventory((Node("n1", "10.0.0.1"), N2), str(inv_path))
    pb = Playbook(name="t", model="/m", data="/d")
    store = QuarantineStore(tmp_path / "q.json")
    store.add(entry(inventory=B, t=time.time()))  # another fleet's n2
    ui = Shown()
    assert usable_inventory(inv, pb, store, ui, JobOptions()) == (inv, [])
    assert ui.lines == []  # not even an empty "left out:" line

    store.add(entry(inventory=inventory_key(str(inv_path)), t=time.time()))
    ui = Shown()
    with pytest.raises(LaunchError, match="would start degraded on 1 of 2 node"):
        usable_inventory(inv, pb, store, ui, JobOptions())
    [shown] = ui.lines
    assert shown.startswith(f"degraded ['n2']: DEGRADED: 1 of 2 node(s) of {inv_path}; left out:\n  n2: quarantined: ")
    usable, left = usable_inventory(inv, pb, store, Shown(), JobOptions(allow_degraded=True))
    assert usable.names() == ["n1"] and [lo.node for lo in left] == ["n2"]
    written = pb.model_copy(update={"faults": FaultsConfig(min_nodes=1)})
    assert usable_inventory(inv, written, store, Shown(), JobOptions())[0].names() == ["n1"]
    assert usable_inventory(inv, pb, store, Shown(), JobOptions(resume="run-1"))[0].names() == ["n1"]
    two = pb.model_copy(update={"faults": FaultsConfig(min_nodes=2)})
    with pytest.raises(LaunchError, match="1 usable node"):
        usable_inventory(inv, two, store, Shown(), JobOptions(allow_degraded=True))


def test_a_replaced_machine_is_not_left_out(tmp_path: Path) -> None:
    old_key, new_key = (asyncssh.generate_private_key("ssh-ed25519") for _ in range(2))
    known = tmp_path / "known_hosts"
    known.write_text(f"10.0.0.2 {new_key.export_public_key('openssh').decode().strip()}\n"
                     f"[10.0.0.2]:2222 {old_key.export_public_key('openssh').decode().strip()}\n")

    def name(key: asyncssh.SSHKey) -> str:  # as ConnectInfo names a host key
        return f"ssh-ed25519 {key.get_fingerprint()}"

    assert known_host_keys(str(known), "10.0.0.2", 22) == {name(new_key)}
    assert known_host_keys(str(known), "10.0.0.2", 2222) == {name(old_key)}
    assert known_host_keys(str(known), "10.0.0.3", 22) == frozenset()
    assert known_host_keys(str(tmp_path / "absent"), "10.0.0.2", 22) == frozenset()

    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text("nodes: []\n")
    node = Node("n2", "10.0.0.2", known_hosts=str(known))
    inv = Inventory((Node("n1", "10.0.0.1"), node), str(inv_path))
    failed = new_entry(node, inventory_key(str(inv_path)), "crash at step 5", run_id="r1", incident={},
                       host_key=name(old_key), now=time.time(), quarantine_for=3600)
    assert replaced(failed, frozenset({name(new_key)})) and not replaced(failed, frozenset({name(old_key)}))
    assert not replaced(failed, frozenset()) and not replaced(failed, None)  # nothing known: the key alone decides
    store = QuarantineStore(tmp_path / "q.json")
    store.add(failed)
    ui = Shown()
    pb = Playbook(name="t", model="/m", data="/d")
    assert usable_inventory(inv, pb, store, ui, JobOptions()) == (inv, [])
    [said] = ui.lines
    assert said.startswith(f"n2: not left out: its quarantine (crash at step 5) names host key {name(old_key)}, "
                           f"which {known} no longer lists for 10.0.0.2 (another machine now)")
    # The same machine (its key still the one known) stays out.
    known.write_text(f"10.0.0.2 {old_key.export_public_key('openssh').decode().strip()}\n")
    with pytest.raises(LaunchError, match="would start degraded"):
        usable_inventory(inv, pb, store, Shown(), JobOptions())


def test_a_quarantined_gpu_is_left_out_of_its_machines_rank_nodes(tmp_path: Path) -> None:
    """One rank per GPU (planning.gpuranks): the rank that failed is `box/gpu1`; its entry leaves that GPU out of
    the next launch's rank nodes (job.per_gpu_ranks runs usable_inventory over them), the machine's other GPU
    stays, and the degraded-start gate applies as for a node."""
    from coordinator.facts.linux import parse_nvidia_smi
    from coordinator.facts.model import NodeFacts
    from coordinator.planning.gpuranks import build_rank_nodes

    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text("nodes: []\n")
    box = Node("box", "10.0.0.5")
    smi = "".join(f"{i}, NVIDIA H100 80GB HBM3, GPU-{i}, 81559, 0, 0, 580.159.04, 9.0\n" for i in range(2))
    ranks = build_rank_nodes(Inventory((box,), str(inv_path)), "nccl", {"box": NodeFacts(node="box",
                                                                                       gpu=parse_nvidia_smi(smi))})
    store = QuarantineStore(tmp_path / "q.json")
    store.add(entry(ranks.nodes[1], inventory_key(str(inv_path)), t=time.time()))
    pb = Playbook(name="t", model="/m", data="/d")
    assert usable_inventory(Inventory((box,), str(inv_path)), pb, store, Shown(), JobOptions())[0].names() == ["box"]
    with pytest.raises(LaunchError, match="would start degraded on 1 of 2 node"):
        usable_inventory(ranks, pb, store, Shown(), JobOptions())
    usable, left = usable_inventory(ranks, pb, store, Shown(), JobOptions(allow_degraded=True))
    assert usable.names() == ["box/gpu0"] and [lo.node for lo in left] == ["box/gpu1"]


def test_a_failed_rank_quarantines_its_gpu_not_its_machine(tmp_path: Path) -> None:
    """job.quarantine_node on a fleet view of rank nodes (one per GPU, over the machine's one connection): the
    entry names `box/gpu1`, so the next launch keeps the machine and leaves out only that GPU, and `quarantine
    clear box/gpu1` finds it. (On 2x H200 the entry named the machine `box`: the next launch left out both GPUs,
    and clearing `box/gpu1` said it was not quarantined.)"""
    import asyncio

    from coordinator.facts.linux import parse_nvidia_smi
    from coordinator.facts.model import NodeFacts
    from coordinator.fleet.transport import Fleet
    from coordinator.models import ConnectInfo
    from coordinator.planning.gpuranks import build_rank_nodes
    from coordinator.run.job import quarantine_node

    class Transport:
        def __init__(self, node: Node) -> None:
            self.node = node

        async def connect(self) -> ConnectInfo:
            return ConnectInfo(self.node.name, 0.0, 0.0, None)

        async def close(self) -> None:
            return None

    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text("nodes: []\n")
    box = Node("box", "10.0.0.5")
    smi = "".join(f"{i}, NVIDIA H100 80GB HBM3, GPU-{i}, 81559, 0, 0, 580.159.04, 9.0\n" for i in range(2))
    ranks = build_rank_nodes(Inventory((box,), str(inv_path)), "nccl",
                             {"box": NodeFacts(node="box", gpu=parse_nvidia_smi(smi))})
    store = QuarantineStore(tmp_path / "q.json")

    async def go() -> None:
        fleet = Fleet([box], transport_factory=Transport)  # type: ignore[arg-type]
        await fleet.connect_all()
        view = fleet.for_ranks(ranks.nodes)
        quarantine_node(store, view, "box/gpu1", "crash at step 8", inventory=inventory_key(str(inv_path)),
                        run_id="r1", incident={}, quarantine_for=3600)
        await fleet.close()

    asyncio.run(go())
    assert [(e.node, e.host) for e in store.read().entries] == [("box/gpu1", "10.0.0.5")]
    pb = Playbook(name="t", model="/m", data="/d")
    assert usable_inventory(Inventory((box,), str(inv_path)), pb, store, Shown(), JobOptions())[0].names() == ["box"]
    usable, left = usable_inventory(ranks, pb, store, Shown(), JobOptions(allow_degraded=True))
    assert usable.names() == ["box/gpu0"] and [lo.node for lo in left] == ["box/gpu1"]
    assert [e.node for e in store.clear("box/gpu1", inventory=inventory_key(str(inv_path)))] == ["box/gpu1"]
