"""`coordinator preflight` end to end: the real CLI over real SSH against test-bed hosts (tests/testbed.py).

Fake Macs replay the recorded profiles of tests/fixtures/profiles (see its README); Linux hosts are themselves.
Every node's python is the repository's venv, which has mlx and mlx-lm, so `software` passes unless a test points
`python:` elsewhere. Hosts that no test changes live in one bed per module (`fleet`); tests that stop, unplug,
re-key or edit a host build their own (`testbed`).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shlex
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.models import CHECK_IDS
from coordinator.views.jsonout import validate_output
from tests.integration.conftest import RunCli
from tests.testbed import PROFILES_DIR, SSH_PORT, VENV_PYTHON, Host, TestBed

# A tiny llama-style config: ~95k parameters, 2 layers (the lint and the memory estimate read it).
TINY_CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 100,
}  # fmt: skip
# Llama-3-70B's shape: ~70.6B parameters by the config alone (no weights are needed for the estimate).
HUGE_CONFIG = {
    "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
}  # fmt: skip

# Lint-clean training settings (save_every <= iters/20, evals cost <= 20% of training).
TRAIN = {"method": "lora", "iters": 200, "batch_size": 2, "save_every": 10, "steps_per_eval": 100, "val_batches": 2}

CONNECT_TIMEOUT = 30  # seconds; only the tests of timeouts shorten it

REPORT_KEYS = {"ok", "summary", "nodes", "lint"}
SUMMARY_KEYS = ["pass", "warn", "fail", "error", "skip"]
CHECK_KEYS = {"id", "status", "summary", "remedy", "evidence"}
LINT_KEYS = {"id", "status", "summary", "remedy"}


# ---------------------------------------------------------------------------------------------------- helpers


def safetensors_file(tag: str, params: int = 1) -> bytes:
    """A minimal safetensors file whose header declares one tensor of `params` elements (the probe counts
    parameters from headers only; the data is one float), `tag` in its metadata: two tags, two digests."""
    header = json.dumps({"__metadata__": {"tag": tag},
                         "w": {"dtype": "BF16", "shape": [params], "data_offsets": [0, 4]}})
    raw = header.encode()
    return len(raw).to_bytes(8, "little") + raw + b"\0\0\0\0"


def prepare_srv(bed: TestBed, host: Host, *, model: str = "/srv/model", data: str = "/srv/data",
                config: Mapping[str, Any] = TINY_CONFIG, weights: str = "weights-v1\n", params: int = 1) -> None:
    """A model dir (config.json, a weights file, a tokenizer: what the model check requires to be there) and a
    data dir on the host, made from inside the host."""
    script = (
        f"set -e; mkdir -p {shlex.quote(model)} {shlex.quote(data)}"
        f"; printf %s {shlex.quote(json.dumps(config))} > {shlex.quote(model)}/config.json"
        f"; printf %s {base64.b64encode(safetensors_file(weights, params)).decode()} | base64 -d"
        f" > {shlex.quote(model)}/model.safetensors"
        f"; printf '{{}}' > {shlex.quote(model)}/tokenizer.json"
        f"; printf '%s\\n' '{{\"text\": \"hello\"}}' > {shlex.quote(data)}/train.jsonl"
        f"; printf '%s\\n' '{{\"text\": \"bye\"}}' > {shlex.quote(data)}/valid.jsonl"
    )
    bed.exec(host, ["sh", "-c", script], check=True)


def write_inventory(bed: TestBed, path: Path, hosts: Sequence[Host],
                    nodes: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """The bed's inventory for `hosts`, with per-node keys from `nodes` (by host name) merged in."""
    bed.write_inventory(path, hosts)
    doc = yaml.safe_load(path.read_text())
    for node in doc["nodes"]:
        node.update((nodes or {}).get(node["name"], {}))
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def write_playbook(path: Path, *, backend: str = "ring", model: str = "/srv/model", data: str = "/srv/data",
                   train: Mapping[str, Any] | None = None, **extra: Any) -> Path:
    doc = {"name": "itest", "kind": "train", "model": model, "data": data, "backend": backend,
           "train": {**TRAIN, **(train or {})}, **extra}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@dataclass
class Outcome:
    cp: subprocess.CompletedProcess[str]
    report: dict[str, Any]

    @property
    def code(self) -> int:
        return self.cp.returncode

    def check(self, node: str, check_id: str) -> dict[str, Any]:
        checks = {c["id"]: c for n in self.report["nodes"] if n["node"] == node for c in n["checks"]}
        assert check_id in checks, (node, check_id, self.report)
        return checks[check_id]

    def status(self, node: str, check_id: str) -> str:
        return str(self.check(node, check_id)["status"])

    def statuses(self, node: str) -> dict[str, str]:
        return {c["id"]: c["status"] for n in self.report["nodes"] if n["node"] == node for c in n["checks"]}

    def dump(self) -> str:
        return json.dumps(self.report, indent=1) + "\n--- stderr\n" + self.cp.stderr


def preflight(run_cli: RunCli, inventory: Path, playbook: Path, *args: str) -> Outcome:
    """`coordinator preflight --json`: the parsed report. Never a traceback; exit 0 or 1 with a report.
    The SSH handshake gets a generous timeout (a loaded CI machine) unless the test sets its own."""
    patience = () if "--connect-timeout" in args else ("--connect-timeout", str(CONNECT_TIMEOUT))
    cp = run_cli("preflight", "-i", str(inventory), "-p", str(playbook), "--json", *patience, *args, timeout=120)
    assert "Traceback" not in cp.stderr, cp.stderr
    assert cp.returncode in (0, 1), (cp.returncode, cp.stdout, cp.stderr)
    report = json.loads(cp.stdout)
    validate_output("preflight", report)  # docs/json.md's schema, unknown keys refused
    out = Outcome(cp, report)
    assert report["ok"] is (cp.returncode == 0), out.dump()
    for node in report["nodes"]:  # every check of every node, always, in the documented order
        assert [c["id"] for c in node["checks"]] == list(CHECK_IDS), out.dump()
    return out


def slow_link_profile(profile: str, own_bus_uuid: str, dest: Path) -> Path:
    """A copy of `profile` whose Thunderbolt link (the bus `own_bus_uuid`, receptacle connected to the other
    Mac) negotiated 40 Gb/s instead of 80: what a TB4 cable between two TB5 ports gives. Only that one
    `current_speed_key` changes."""
    src = PROFILES_DIR / profile
    dest.mkdir(parents=True)
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    sp = dest / "system_profiler.out"
    head, sep, tail = sp.read_text().partition(f'"domain_uuid_key" : "{own_bus_uuid}"')
    assert sep and '"80 Gb/s"' in tail, f"{profile}: no 80 Gb/s link on bus {own_bus_uuid}"
    sp.write_text(head + sep + tail.replace('"current_speed_key" : "80 Gb/s"', '"current_speed_key" : "40 Gb/s"', 1))
    return dest


MBP_BUS = "817DCFA4-B481-4100-80FC-91C7AA969F0B"  # the MacBook's bus cabled to the Studio (profiles README)
STUDIO_BUS = "28CA4C30-A263-4C55-B302-953416D0B209"  # and the Studio's end of that cable


# ---------------------------------------------------------------------------------------------- module bed


@dataclass
class Fleet:
    bed: TestBed
    dir: Path

    def host(self, name: str) -> Host:
        return self.bed.host(name)

    def hosts(self, *names: str) -> list[Host]:
        return [self.bed.host(n) for n in names]

    def inventory(self, *names: str, nodes: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
        path = self.dir / f"inv-{secrets.token_hex(3)}.yaml"
        return write_inventory(self.bed, path, self.hosts(*names), nodes)

    def playbook(self, **kwargs: Any) -> Path:
        return write_playbook(self.dir / f"pb-{secrets.token_hex(3)}.yaml", **kwargs)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Hosts no test of this module changes (tests may add dirs of their own under /srv):

    mbp + studio   the Thunderbolt 5 pair (RDMA active between them)
    mbp40/studio40 the same pair with the cable at 40 Gb/s (derived copies, see slow_link_profile; they keep the
                   pair's bus UUIDs, so never put them in one inventory with mbp or studio)
    old            M1 Max on macOS 14.6.1 (no RDMA)
    nodev          M4 Max, RDMA "enabled" but no device, 40 Gb/s link to a Mac outside the fleet, on battery
    lin lin2 lin3  Linux
    preset         Linux whose SSH sessions have MLX_RANK=0 (sshd SetEnv)
    fastsynch      Linux whose SSH sessions have MLX_METAL_FAST_SYNCH=1
    """
    tmp = tmp_path_factory.mktemp("preflight")
    bed = TestBed(tmp=tmp / "bed")
    try:
        profiles = tmp / "profiles"
        bed.add_host("mbp", mac_profile="m5max-mbp-tb5")
        bed.add_host("studio", mac_profile="m3ultra-studio-tb5")
        bed.add_host("mbp40", mac_profile=slow_link_profile("m5max-mbp-tb5", MBP_BUS, profiles / "mbp40"))
        bed.add_host("studio40", mac_profile=slow_link_profile("m3ultra-studio-tb5", STUDIO_BUS, profiles / "studio40"))
        bed.add_host("old", mac_profile="m1max-macos14")
        bed.add_host("nodev", mac_profile="m4max-mbp-tb4-rdma-nodev")
        bed.add_hosts(["lin", "lin2", "lin3"])
        bed.add_host("preset", env={"MLX_RANK": "0"})
        bed.add_host("fastsynch", env={"MLX_METAL_FAST_SYNCH": "1"})
        for h in bed.hosts:
            prepare_srv(bed, h)
        yield Fleet(bed, tmp)
    finally:
        bed.close()


# ------------------------------------------------------------------------------------------- whole fleets


def test_mixed_fleet_with_ring_is_ready(fleet: Fleet, run_cli: RunCli) -> None:
    """TB5 pair + Linux, ring: every check of every node, the right verdicts, the documented JSON shape."""
    out = preflight(run_cli, fleet.inventory("mbp", "studio", "lin"), fleet.playbook(backend="ring"))
    report = out.report
    assert out.code == 0 and report["ok"] is True, out.dump()

    # The shape (coordinator.models.PreflightReport.to_json), exactly.
    assert set(report) == REPORT_KEYS
    assert list(report["summary"]) == SUMMARY_KEYS
    assert [n["node"] for n in report["nodes"]] == ["mbp", "studio", "lin"]  # inventory order
    for node in report["nodes"]:
        assert set(node) == {"node", "checks"}
        for c in node["checks"]:
            assert set(c) == CHECK_KEYS and isinstance(c["evidence"], dict) and isinstance(c["summary"], str)
            assert c["summary"] and (c["remedy"] == "" or c["status"] != "pass")
    assert report["lint"] and all(set(lint) == LINT_KEYS for lint in report["lint"])
    statuses = [c["status"] for n in report["nodes"] for c in n["checks"]] + [lint["status"] for lint in report["lint"]]
    assert report["summary"] == {s: statuses.count(s) for s in SUMMARY_KEYS}

    expected = {**dict.fromkeys(CHECK_IDS, "pass"), "rdma": "skip"}
    for name in ("mbp", "studio", "lin"):
        assert out.statuses(name) == expected, out.dump()
        assert out.check(name, "rdma")["summary"] == "backend ring does not use RDMA"
        tb = out.check(name, "thunderbolt")  # ring: reachability of every peer's data-plane address
        assert tb["summary"] == "data plane reaches all 2 peer(s)"
        peers = {"mbp", "studio", "lin"} - {name}
        assert set(tb["evidence"]["reach"]) == peers
        assert all(tb["evidence"]["reach"][p]["ok"] and tb["evidence"]["reach"][p]["ip"] == fleet.host(p).ip
                   for p in peers)
        model = out.check(name, "model")
        assert model["summary"].startswith("5 files") and "identical on 3/3 nodes" in model["summary"]
        assert model["evidence"]["dirs"] == {"model": "/srv/model", "data": "/srv/data"}
        sw = out.check(name, "software")["evidence"]
        assert sw["python"] == VENV_PYTHON and sw["mlx"] and sw["mlx_lm"]
        ssh = out.check(name, "ssh")["evidence"]
        assert ssh["target"] == f"root@{fleet.host(name).ip}" and ssh["port"] == SSH_PORT
        assert ssh["host_key"].startswith("ssh-ed25519 SHA256:") and ssh["host_key_recorded"] is False
        assert out.check(name, "env")["evidence"]["job_env"] == {"TOKENIZERS_PARALLELISM": "false"}
        assert "fit" in out.check(name, "resources")["evidence"]

    os_release = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().split("\n") if "=" in line)
    lin_os = out.check("lin", "os")
    assert lin_os["evidence"]["system"] == "Linux"
    assert lin_os["evidence"]["name"] == os_release["PRETTY_NAME"].strip('"')
    assert lin_os["evidence"]["kernel"] == os.uname().release and lin_os["evidence"]["arch"] == os.uname().machine
    assert lin_os["summary"].startswith(os_release["PRETTY_NAME"].strip('"'))
    for mac in ("mbp", "studio"):
        assert out.check(mac, "os")["summary"] == "macOS 26.5 (25F71) on arm64"
        assert out.check(mac, "os")["evidence"]["system"] == "Darwin"
    assert out.check("studio", "resources")["evidence"]["memory_total"] == 512 * 1024**3  # the profile's, not ours
    assert out.check("mbp", "resources")["evidence"]["memory_total"] == 128 * 1024**3
    assert {lint["id"]: lint["status"] for lint in report["lint"]} == {
        "num_layers": "pass", "save_every": "pass", "eval_cost": "pass"}  # fmt: skip
    assert out.cp.stderr == ""  # --json: nothing else on either stream


def test_tb5_pair_with_jaccl_names_the_rdma_links(fleet: Fleet, run_cli: RunCli) -> None:
    out = preflight(run_cli, fleet.inventory("mbp", "studio"), fleet.playbook(backend="jaccl"))
    assert out.code == 0, out.dump()
    for name in ("mbp", "studio"):
        assert set(out.statuses(name).values()) == {"pass"}, out.dump()
    # MacBook receptacle 1 -> en1 -> rdma_en1; Studio receptacle 2 -> en3 -> rdma_en3 (profiles README).
    assert out.check("mbp", "rdma")["summary"] == "RDMA enabled, 3 device(s); rdma_en1 -> studio"
    assert out.check("studio", "rdma")["summary"] == "RDMA enabled, 6 device(s); rdma_en3 -> mbp"
    assert out.check("mbp", "rdma")["evidence"]["peer_devices"] == {"studio": "rdma_en1"}
    assert out.check("mbp", "thunderbolt")["summary"] == "Thunderbolt 5 links and data plane reaches all 1 peer(s)"
    assert out.check("mbp", "thunderbolt")["evidence"]["links"] == {
        "studio": [{"receptacle": "1", "interface": "en1", "speed_gbps": 80.0}]}
    assert out.check("studio", "thunderbolt")["evidence"]["links"] == {
        "mbp": [{"receptacle": "2", "interface": "en3", "speed_gbps": 80.0}]}


def parse_tables(text: str) -> tuple[dict[str, list[list[str]]], list[str]]:
    """rich's tables as printed without a terminal: {title: rows of cells, header first} in print order, plus
    the other non-blank lines. A title is the line above a table's top border; a row whose first cell is empty
    continues the cells (folded text) of the row above."""
    tables: dict[str, list[list[str]]] = {}
    other: list[str] = []
    lines = text.splitlines()
    rows: list[list[str]] = []
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and lines[i + 1].startswith("┏"):
            rows = tables.setdefault(line.strip(), [])
        elif line.startswith(("┃", "│")):
            cells = [cell.strip() for cell in line[1:-1].split(line[0])]
            if rows and not cells[0] and line[0] == "│":
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
            else:
                rows.append(cells)
        elif line.strip() and not line.startswith(("┏", "┡", "└")):
            other.append(line.strip())
    return tables, other


def test_readable_table_puts_the_failing_node_first(fleet: Fleet, run_cli: RunCli) -> None:
    inventory, playbook = fleet.inventory("lin", "preset"), fleet.playbook()
    cp = run_cli("preflight", "-i", str(inventory), "-p", str(playbook), "--connect-timeout", str(CONNECT_TIMEOUT),
                 timeout=120)
    assert cp.returncode == 1 and "Traceback" not in cp.stderr, cp.stdout + cp.stderr
    assert cp.stderr == ""
    tables, other = parse_tables(cp.stdout)
    assert list(tables) == ["preset", "lin", "playbook lint"], cp.stdout  # the failing node first
    header, *rows = tables["preset"]
    assert header == ["check", "status", "summary", "remedy"]
    assert [r[:2] for r in rows] == [  # failures first, then passes (check order), skips last
        ["env", "FAIL"], ["ssh", "PASS"], ["os", "PASS"], ["thunderbolt", "PASS"], ["software", "PASS"],
        ["model", "PASS"], ["resources", "PASS"], ["rdma", "SKIP"]]  # fmt: skip
    env = rows[0]
    assert env[2] == "MLX_RANK=0 preset in the ssh env"
    assert env[3].startswith("remove MLX_RANK from the node's shell startup files")  # folded cell, rejoined
    assert all(r[3] == "" for r in rows[1:])  # no remedy on a pass or a skip
    assert [r[1] for r in tables["lin"][1:]] == ["PASS"] * 7 + ["SKIP"]
    assert [r[:2] for r in tables["playbook lint"][1:]] == [["num_layers", "PASS"], ["save_every", "PASS"],
                                                           ["eval_cost", "PASS"]]
    assert other == ["NOT READY  pass: 16  warn: 0  fail: 1  error: 0  skip: 2"]


# ----------------------------------------------------------------------------------- each check failing


def test_ssh_fails_for_a_stopped_sshd_and_the_others_are_still_checked(testbed: TestBed, run_cli: RunCli) -> None:
    hosts = testbed.add_hosts(["a", "b", "c"])
    for h in hosts:
        prepare_srv(testbed, h)
    testbed.stop_sshd(testbed.host("b"))
    out = preflight(run_cli, testbed.write_inventory(testbed.tmp / "inv.yaml"), write_playbook(testbed.tmp / "pb.yaml"))
    assert out.code == 1, out.dump()
    ssh = out.check("b", "ssh")
    assert ssh["status"] == "fail" and ssh["evidence"]["kind"] == "connect", out.dump()
    assert ssh["summary"].startswith(f"b: cannot connect to {testbed.host('b').ip}") and "Remote Login" in ssh["remedy"]
    assert {cid: out.check("b", cid)["summary"] for cid in CHECK_IDS[1:]} == dict.fromkeys(
        CHECK_IDS[1:], "not evaluated: node unreachable")
    assert set(out.statuses("b").values()) == {"fail", "skip"}
    for name in ("a", "c"):  # fully evaluated; b's address still answers (a refused port is a live host)
        assert out.statuses(name) == {**dict.fromkeys(CHECK_IDS, "pass"), "rdma": "skip"}, out.dump()
        assert out.check(name, "model")["summary"].endswith("identical on 2/2 nodes")


def test_ssh_times_out_for_an_unplugged_node(testbed: TestBed, run_cli: RunCli) -> None:
    hosts = testbed.add_hosts(["a", "b", "c"])
    for h in hosts:
        prepare_srv(testbed, h)
    b = testbed.host("b")
    testbed.link_down(b)
    inventory = testbed.write_inventory(testbed.tmp / "inv.yaml")
    out = preflight(run_cli, inventory, write_playbook(testbed.tmp / "pb.yaml"), "--connect-timeout", "1")
    assert out.code == 1, out.dump()
    ssh = out.check("b", "ssh")
    assert ssh["status"] == "fail" and ssh["evidence"]["kind"] == "timeout", out.dump()
    assert ssh["summary"] == f"b: no SSH answer from {b.ip} within 1s"
    assert "pmset" in ssh["remedy"]
    assert set(out.statuses("b").values()) == {"fail", "skip"}
    for name in ("a", "c"):
        assert out.statuses(name) == {**dict.fromkeys(CHECK_IDS, "pass"), "rdma": "skip",
                                      "thunderbolt": "fail"}, out.dump()
        tb = out.check(name, "thunderbolt")
        assert tb["summary"].startswith(f"cannot reach b ({b.ip}): ")
        assert tb["evidence"]["reach"]["b"]["ok"] is False
        assert tb["evidence"]["reach"][({"a", "c"} - {name}).pop()]["ok"] is True


def test_ssh_fails_for_a_key_the_node_does_not_accept(fleet: Fleet, run_cli: RunCli) -> None:
    key = fleet.dir / "stranger_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30)
    lin = fleet.host("lin")
    out = preflight(run_cli, fleet.inventory("lin", "lin2", nodes={"lin": {"identity": str(key)}}), fleet.playbook())
    ssh = out.check("lin", "ssh")
    assert out.code == 1 and ssh["status"] == "fail" and ssh["evidence"]["kind"] == "auth", out.dump()
    assert ssh["summary"].startswith(f"lin: authentication failed for root@{lin.ip}")
    assert f"ssh-copy-id -i {key} root@{lin.ip}" in ssh["remedy"]
    assert out.status("lin2", "ssh") == "pass" and out.status("lin2", "model") == "pass"


def test_os_fails_for_macos_14_with_jaccl(fleet: Fleet, run_cli: RunCli) -> None:
    out = preflight(run_cli, fleet.inventory("old"), fleet.playbook(backend="jaccl"))
    assert out.code == 1, out.dump()
    os_ = out.check("old", "os")
    assert os_["status"] == "fail"
    assert os_["summary"] == "macOS 14.6.1: RDMA over Thunderbolt (jaccl) needs macOS 26.2+"
    assert os_["evidence"]["version"] == "14.6.1" and os_["evidence"]["build"] == "23G93"
    assert "26.2" in os_["remedy"] and "ring" in os_["remedy"]
    rdma = out.check("old", "rdma")
    assert rdma["status"] == "fail" and rdma["summary"] == "rdma_ctl not found (macOS older than 26.2?)"


def test_os_passes_for_macos_14_with_ring(fleet: Fleet, run_cli: RunCli) -> None:
    out = preflight(run_cli, fleet.inventory("old"), fleet.playbook(backend="ring"))
    assert out.status("old", "os") == "pass" and out.check("old", "os")["summary"] == "macOS 14.6.1 (23G93) on arm64"
    assert out.status("old", "rdma") == "skip"


def test_rdma_enabled_but_no_device_fails_with_jaccl(fleet: Fleet, run_cli: RunCli) -> None:
    out = preflight(run_cli, fleet.inventory("nodev"), fleet.playbook(backend="jaccl"))
    assert out.code == 1, out.dump()
    rdma = out.check("nodev", "rdma")
    assert rdma["status"] == "fail", out.dump()
    assert rdma["summary"].startswith("rdma_ctl says enabled but `ibv_devices` lists no rdma_* device")
    assert rdma["evidence"] == {"rdma_ctl": "enabled", "devices": {}}
    assert "Thunderbolt 5" in rdma["remedy"]
    assert out.status("nodev", "os") == "pass"  # macOS 26.4 is recent enough: it is the device that is missing


def test_thunderbolt_fails_for_a_40_gbps_link_with_jaccl(fleet: Fleet, run_cli: RunCli) -> None:
    out = preflight(run_cli, fleet.inventory("mbp40", "studio40"), fleet.playbook(backend="jaccl"))
    assert out.code == 1, out.dump()
    for name, peer in (("mbp40", "studio40"), ("studio40", "mbp40")):
        tb = out.check(name, "thunderbolt")
        assert tb["status"] == "fail", out.dump()
        assert tb["summary"] == f"link to {peer} negotiated 40 Gb/s (< 80 Gb/s: Thunderbolt 4 or a TB4 cable)"
        assert "Thunderbolt 5 cable" in tb["remedy"]
        assert out.status(name, "rdma") == "pass"  # the RDMA ports are up: only the speed is wrong


def test_thunderbolt_fails_without_a_link_to_a_peer_with_jaccl(fleet: Fleet, run_cli: RunCli) -> None:
    out = preflight(run_cli, fleet.inventory("mbp", "nodev"), fleet.playbook(backend="jaccl"))
    assert out.code == 1, out.dump()
    tb = out.check("mbp", "thunderbolt")
    assert tb["status"] == "fail" and tb["summary"] == "no Thunderbolt link to nodev", out.dump()
    assert tb["evidence"]["links"] == {"nodev": []}
    assert "connect mbp and nodev with a Thunderbolt 5 cable" in tb["remedy"]
    assert out.check("nodev", "thunderbolt")["summary"].startswith("no Thunderbolt link to mbp")


def test_thunderbolt_fails_for_an_unreachable_peer_address(fleet: Fleet, run_cli: RunCli) -> None:
    """lin2's data-plane address (`ips:`) is in the bed's subnet but no host has it."""
    subnet = fleet.bed.subnet
    assert subnet is not None
    ghost = str(subnet.broadcast_address - 1)
    assert ghost not in {h.ip for h in fleet.bed.hosts}
    inventory = fleet.inventory("lin", "lin2", nodes={"lin2": {"ips": [ghost]}})
    out = preflight(run_cli, inventory, fleet.playbook())
    assert out.code == 1, out.dump()
    tb = out.check("lin", "thunderbolt")
    assert tb["status"] == "fail", out.dump()
    assert tb["summary"].startswith(f"cannot reach lin2 ({ghost}): ")
    assert tb["evidence"]["reach"]["lin2"] == {"ip": ghost, "ok": False, "rtt_ms": None}
    assert "`ips:`" in tb["remedy"]
    assert out.status("lin2", "thunderbolt") == "pass"  # lin2 itself reaches lin
    assert out.status("lin2", "ssh") == "pass"  # the control plane uses `host`, not `ips`


def test_software_fails_for_a_python_that_does_not_exist(fleet: Fleet, run_cli: RunCli) -> None:
    missing = "/srv/no-such-venv/bin/python"
    out = preflight(run_cli, fleet.inventory("lin", "lin2", nodes={"lin2": {"python": missing}}), fleet.playbook())
    assert out.code == 1, out.dump()
    sw = out.check("lin2", "software")
    assert sw["status"] == "fail" and sw["summary"] == f"python not found at {missing}", out.dump()
    assert "`python:`" in sw["remedy"]
    # Without the node's python nothing was hashed or probed: those checks error, they do not pass.
    assert out.status("lin2", "model") == "error" and out.status("lin2", "thunderbolt") == "error"
    assert out.status("lin", "software") == "pass"


def test_software_fails_for_the_node_with_another_mlx_version(fleet: Fleet, run_cli: RunCli) -> None:
    """lin3's `python` is a wrapper around the venv's whose PYTHONPATH puts an mlx 0.33.0 dist-info first, so
    package metadata (what the probe reads) says 0.33.0 there while lin and lin2 have the venv's version."""
    lin3 = fleet.host("lin3")
    wrapper = "/srv/mlx-0.33/bin/python"
    script = (
        "set -e; mkdir -p /srv/mlx-0.33/bin /srv/mlx-0.33/site/mlx-0.33.0.dist-info"
        "; printf 'Metadata-Version: 2.1\\nName: mlx\\nVersion: 0.33.0\\n' > /srv/mlx-0.33/site/mlx-0.33.0.dist-info/METADATA"
        f"; printf '#!/bin/sh\\nPYTHONPATH=/srv/mlx-0.33/site exec {VENV_PYTHON} \"$@\"\\n' > {wrapper}"
        f"; chmod +x {wrapper}"
    )
    fleet.bed.exec(lin3, ["sh", "-c", script], check=True)
    out = preflight(run_cli, fleet.inventory("lin", "lin2", "lin3", nodes={"lin3": {"python": wrapper}}),
                    fleet.playbook())
    assert out.code == 1, out.dump()
    sw = out.check("lin3", "software")
    assert sw["status"] == "fail", out.dump()
    assert sw["evidence"]["mlx"] == "0.33.0"
    ours = out.check("lin", "software")["evidence"]
    assert sw["summary"].startswith(f"mlx 0.33.0 / mlx-lm {ours['mlx_lm']} differ from the fleet")
    assert f"mlx=={ours['mlx']} mlx-lm=={ours['mlx_lm']}" in sw["remedy"]
    assert out.status("lin", "software") == "pass" and out.status("lin2", "software") == "pass"


def test_model_fails_on_the_node_whose_file_differs(testbed: TestBed, run_cli: RunCli) -> None:
    hosts = testbed.add_hosts(["a", "b", "c"])
    for h in hosts:
        prepare_srv(testbed, h)
    other = base64.b64encode(safetensors_file("weights-v2")).decode()
    testbed.exec(testbed.host("c"), ["sh", "-c", f"printf %s {other} | base64 -d > /srv/model/model.safetensors"],
                 check=True)
    inventory, playbook = testbed.write_inventory(testbed.tmp / "inv.yaml"), write_playbook(testbed.tmp / "pb.yaml")
    out = preflight(run_cli, inventory, playbook)
    assert out.code == 1, out.dump()
    model = out.check("c", "model")
    assert model["status"] == "fail", out.dump()
    assert model["summary"] == "differs from the majority (a, b): differ: model/model.safetensors"
    assert model["evidence"]["diff"] == {"differ": ["model/model.safetensors"], "missing": [], "extra": []}
    # rsync cannot copy between two remote hosts: the remedy runs it on the good node, to the other's address.
    a, c = testbed.host("a"), testbed.host("c")
    assert f"ssh root@{a.ip} rsync -a --delete /srv/model/ root@{c.ip}:/srv/model/" in model["remedy"]
    assert f"coordinator sync -i INVENTORY -p {playbook} --from a --limit c" in model["remedy"]
    for name in ("a", "b"):
        assert out.check(name, "model")["summary"].endswith("identical on 2/3 nodes"), out.dump()
    # Two nodes that disagree: no majority, both fail, neither copy is trusted.
    out = preflight(run_cli, inventory, playbook, "--limit", "a,c")
    for name in ("a", "c"):
        assert out.status(name, "model") == "fail"
        assert out.check(name, "model")["summary"].startswith("nodes disagree with no majority")


def test_env_fails_for_a_preset_launcher_variable(fleet: Fleet, run_cli: RunCli) -> None:
    out = preflight(run_cli, fleet.inventory("preset"), fleet.playbook())
    assert out.code == 1, out.dump()
    env = out.check("preset", "env")
    assert env["status"] == "fail" and env["summary"] == "MLX_RANK=0 preset in the ssh env", out.dump()
    assert env["evidence"]["ssh_env_mlx"] == {"MLX_RANK": "0"}
    assert "remove MLX_RANK" in env["remedy"]


def test_env_warns_for_fast_synch_and_strict_fails(fleet: Fleet, run_cli: RunCli) -> None:
    inventory, playbook = fleet.inventory("fastsynch"), fleet.playbook()
    out = preflight(run_cli, inventory, playbook)
    env = out.check("fastsynch", "env")
    assert env["status"] == "warn", out.dump()
    assert env["summary"] == "MLX_METAL_FAST_SYNCH=1 in the ssh env (can deadlock and wedge the GPU)"
    assert out.code == 0 and out.report["ok"] is True and out.report["summary"]["warn"] == 1, out.dump()
    strict = preflight(run_cli, inventory, playbook, "--strict")
    assert strict.code == 1 and strict.report["ok"] is False, strict.dump()
    assert strict.status("fastsynch", "env") == "warn"  # the same verdicts; only the exit code and `ok` change


def test_resources_fail_for_a_full_fine_tune_that_does_not_fit(fleet: Fleet, run_cli: RunCli) -> None:
    """A 70B model (a header declaring its parameters, no data) with `method: full` on the 512 GB Studio."""
    studio = fleet.host("studio")
    prepare_srv(fleet.bed, studio, model="/srv/model-70b", config=HUGE_CONFIG, params=70_553_706_496)
    playbook = fleet.playbook(model="/srv/model-70b", train={"method": "full", "grad_checkpoint": True})
    out = preflight(run_cli, fleet.inventory("studio"), playbook)
    assert out.code == 1, out.dump()
    res = out.check("studio", "resources")
    assert res["status"] == "fail", out.dump()
    ev = res["evidence"]
    assert 69e9 < ev["params"] < 72e9 and ev["estimate"] > ev["usable"] == int(512 * 1024**3 * 0.75)
    assert "needed (70." in res["summary"] and "B params, full" in res["summary"]
    assert "of 384.0 GiB usable" in res["summary"]
    assert "use LoRA" in res["remedy"]


def test_resources_warn_on_battery_and_sleep(fleet: Fleet, run_cli: RunCli) -> None:
    out = preflight(run_cli, fleet.inventory("nodev"), fleet.playbook())
    res = out.check("nodev", "resources")
    assert res["status"] == "warn", out.dump()
    assert "system sleep after 1 min (now prevented by powerd, sharingd)" in res["summary"]
    assert "on battery (91%)" in res["summary"]
    assert res["evidence"]["power"] == {"sleep_minutes": 1, "on_battery": True, "battery_percent": 91}
    assert "pmset -a sleep 0" in res["remedy"] and "AC power" in res["remedy"]
    assert out.code == 0  # warnings alone do not fail without --strict


# --------------------------------------------------------------------------------------------- host keys


def test_changed_host_key_fails_even_with_accept_new(testbed: TestBed, run_cli: RunCli) -> None:
    a = testbed.add_host("a")
    prepare_srv(testbed, a)
    testbed.regenerate_host_key(a)
    inventory, playbook = testbed.write_inventory(testbed.tmp / "inv.yaml"), write_playbook(testbed.tmp / "pb.yaml")
    known_before = testbed.known_hosts.read_text()
    for flags in ((), ("--accept-new-host-keys",)):
        out = preflight(run_cli, inventory, playbook, *flags)
        ssh = out.check("a", "ssh")
        assert out.code == 1 and ssh["status"] == "fail", out.dump()
        assert ssh["evidence"]["kind"] == "host_key"
        assert f"host key for {a.ip} does NOT match {testbed.known_hosts}" in ssh["summary"]
        assert f"ssh-keygen -R {a.ip}" in ssh["remedy"]
        assert set(out.statuses("a").values()) == {"fail", "skip"}
    assert testbed.known_hosts.read_text() == known_before  # a changed key is never "accepted"


def test_unknown_host_keys_need_accept_new_and_are_then_recorded(testbed: TestBed, run_cli: RunCli) -> None:
    hosts = testbed.add_hosts(["u", "v"], known=False)
    for h in hosts:
        prepare_srv(testbed, h)
    assert testbed.known_hosts.read_text() == ""
    inventory, playbook = testbed.write_inventory(testbed.tmp / "inv.yaml"), write_playbook(testbed.tmp / "pb.yaml")
    recorded = {f"{h.ip} {h.host_key_pub}" for h in hosts}

    out = preflight(run_cli, inventory, playbook)
    assert out.code == 1, out.dump()
    for h in hosts:
        ssh = out.check(h.name, "ssh")
        assert ssh["status"] == "fail" and ssh["evidence"]["kind"] == "host_key", out.dump()
        assert f"host key for {h.ip} is unknown" in ssh["summary"] and "--accept-new-host-keys" in ssh["summary"]
    assert testbed.known_hosts.read_text() == ""  # nothing recorded without the flag

    out = preflight(run_cli, inventory, playbook, "--accept-new-host-keys")
    assert out.code == 0, out.dump()
    for h in hosts:
        ssh = out.check(h.name, "ssh")
        assert ssh["evidence"]["host_key_recorded"] is True and "(new key recorded)" in ssh["summary"]
    assert set(testbed.known_hosts.read_text().splitlines()) == recorded  # one line each, the keys sshd has
    assert len(testbed.known_hosts.read_text().splitlines()) == 2

    out = preflight(run_cli, inventory, playbook)  # known now: no flag needed, nothing recorded again
    assert out.code == 0, out.dump()
    assert not any(out.check(h.name, "ssh")["evidence"]["host_key_recorded"] for h in hosts)
    assert len(testbed.known_hosts.read_text().splitlines()) == 2


# ----------------------------------------------------------------------------------------- hostile input


def test_hostile_paths_are_never_run_by_a_shell(testbed: TestBed, run_cli: RunCli) -> None:
    """Shell syntax in the playbook's dirs and in a node's python/workdir reaches the node as data: nothing is
    executed, and the report says plainly that the dir or python does not exist."""
    token = secrets.token_hex(4)
    markers = {k: f"pwned-{token}-{k}" for k in ("model", "data", "python", "home", "workdir", "tmp")}
    model = f"/srv/model; touch /srv/{markers['model']}"
    data = f"/srv/data`touch /srv/{markers['data']}`"
    bad_python = f"/srv/$(touch /srv/{markers['python']})/bin/python"
    home_python = f"~/`touch /srv/{markers['home']}`/python"
    workdir = f"/srv/work'; touch /srv/{markers['workdir']}; touch /tmp/{markers['tmp']}; '"
    hosts = testbed.add_hosts(["a", "b", "c"])
    for h in hosts:
        prepare_srv(testbed, h)
    inventory = write_inventory(testbed, testbed.tmp / "inv.yaml", hosts, {
        "a": {"python": bad_python}, "b": {"workdir": workdir}, "c": {"python": home_python}})  # fmt: skip
    # `$(...)` in a dir is refused by the playbook check before anything reaches a node (a `$` is never expanded
    # there); the other shell syntax goes to the nodes as data.
    dollar = f"/srv/data$(touch /srv/{markers['data']})"
    refused = run_cli("preflight", "-i", str(inventory), "-p",
                      str(write_playbook(testbed.tmp / "dollar.yaml", model=model, data=dollar)))
    assert refused.returncode == 2 and "environment variables are not expanded" in refused.stderr, refused
    out = preflight(run_cli, inventory, write_playbook(testbed.tmp / "pb.yaml", model=model, data=data))
    assert out.code == 1, out.dump()
    for h in hosts:
        left = testbed.exec(h, ["sh", "-c", "ls -a /srv /tmp"], check=True).stdout
        assert token not in left, f"{h.name}: {left}"
    assert not any(token in p.name for p in Path("/tmp").iterdir())
    assert all(out.status(n, "ssh") == "pass" for n in ("a", "b", "c")), out.dump()
    assert out.check("a", "software")["summary"] == f"python not found at {bad_python}"
    # `~/` is the node user's home, expanded by the node's shell; the rest stays literal.
    assert out.check("c", "software")["summary"] == f"python not found at /root/{home_python[2:]}"
    b_model = out.check("b", "model")
    assert b_model["status"] == "fail", out.dump()
    assert b_model["summary"] == f"model dir {model} is missing; data dir {data} is missing"
    assert out.status("b", "software") == "pass"  # b's own python ran fine despite the hostile workdir


# ----------------------------------------------------------------------------------------------- timeouts


def test_probe_timeout_does_not_wait_for_a_hung_node(testbed: TestBed, run_cli: RunCli) -> None:
    """The node's python hangs (here: sleeps, then leaves a marker). With --probe-timeout 2 its checks report the
    timeout, and the CLI returns without waiting for the hung command to end: the marker must not exist yet when
    it returns (the command sleeps 4x longer than the timeout)."""
    a = testbed.add_host("a")
    prepare_srv(testbed, a)
    marker = f"/srv/hung-python-finished-{secrets.token_hex(4)}"
    script = f"printf '#!/bin/sh\\nsleep 8\\ntouch {marker}\\n' > /srv/hung-python && chmod +x /srv/hung-python"
    testbed.exec(a, ["sh", "-c", script], check=True)
    inventory = write_inventory(testbed, testbed.tmp / "inv.yaml", [a], {"a": {"python": "/srv/hung-python"}})
    out = preflight(run_cli, inventory, write_playbook(testbed.tmp / "pb.yaml"), "--probe-timeout", "2")
    finished_before_return = testbed.exec(a, ["test", "-e", marker]).returncode == 0
    assert out.code == 1, out.dump()
    assert out.status("a", "ssh") == "pass"
    for cid in CHECK_IDS[1:]:
        check = out.check("a", cid)
        assert check["status"] == "error" and check["summary"] == "not evaluated: a: `sh` timed out after 2s", out.dump()
    assert not finished_before_return, "the CLI waited for the hung node command to finish"
