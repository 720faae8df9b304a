"""`coordinator setup`'s pure core: the inspect answer parsed, the node's platform, the wheelhouse download argv,
and the plan (facts in, actions out); the `software:` pins of a playbook; the software check's remedies naming
the setup command; `--network`'s Thunderbolt /30s from recorded Mac profiles."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from coordinator.config.playbook import load_playbook
from coordinator.errors import ConfigError
from coordinator.facts.build import build_node_facts
from coordinator.facts.model import NetInterface, NodeFacts, ParseError, Software
from coordinator.fleet.netsetup import NETMASK, compute_cables, plan_network, render_command
from coordinator.fleet.nodesetup import (
    _INSTALL,
    NodeState,
    Pins,
    Platform,
    SetupError,
    build_download_argv,
    compute_bad_wheels,
    compute_platform,
    describe_install_failure,
    parse_node_state,
    parse_pip_failure,
    plan_node,
    requirements,
    venv_dir_for,
    verify_wheelhouse,
    wanted_dists,
)
from coordinator.fleet.transport import LocalTransport, sftp_path
from coordinator.models import Node, Status
from coordinator.preflight.checks.context import CheckContext
from coordinator.preflight.checks.system import check_software
from tests.factsutil import load_profile

PINS = Pins("0.32.4", "0.32.2", "test")
LINUX = NodeState(system="Linux", machine="x86_64", python3="3.11.2", python3_path="/usr/bin/python3", glibc="2.36",
                  macos=None, cuda_driver=None, python_exists=False, python_version=None, python_error=None)
MAC = dataclasses.replace(LINUX, system="Darwin", machine="arm64", python3="3.9.6", glibc=None, macos="14.5")
SET_UP = dataclasses.replace(LINUX, python_exists=True, python_version="3.11.2", worker=True,
                             installed={"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-cpu": "0.32.4"})
NODE = Node("n1", "10.0.0.1", python="~/venvs/mlx/bin/python")


def state_json(**changes: Any) -> str:
    doc = {"system": "Linux", "machine": "x86_64", "python3": "3.11.2", "python3_path": "/usr/bin/python3",
           "glibc": "2.36", "macos": None, "cuda_driver": None, "python_exists": True, "python_version": "3.11.2",
           "python_error": None, "installed": {"mlx": "0.32.4"}, "worker": False}
    return json.dumps({**doc, **changes})


# --- the inspect answer -----------------------------------------------------------------------------------------


def test_parse_node_state_reads_the_last_line() -> None:
    state = parse_node_state("a warning from a sitecustomize\n" + state_json(cuda_driver="580.65.06") + "\n")
    assert state.installed == {"mlx": "0.32.4"} and state.cuda_driver == "580.65.06" and state.python_exists
    assert state.glibc == "2.36" and state.macos is None


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", json.dumps({"system": "Linux"})])
def test_parse_node_state_rejects_garbage(text: str) -> None:
    with pytest.raises(ParseError, match="inspect: "):
        parse_node_state(text)


# --- the platform -----------------------------------------------------------------------------------------------

PLATFORMS = [
    pytest.param(LINUX, Platform("linux", "x86_64", (3, 11), (2, 36), "cpu"), id="linux-cpu"),
    pytest.param(dataclasses.replace(LINUX, cuda_driver="580.65.06"), Platform("linux", "x86_64", (3, 11), (2, 36),
                                                                              "cuda13"), id="driver-580-cuda13"),
    pytest.param(dataclasses.replace(LINUX, cuda_driver="535.104.05", machine="aarch64"),
                 Platform("linux", "aarch64", (3, 11), (2, 36), "cuda12"), id="driver-535-cuda12"),
    pytest.param(MAC, Platform("darwin", "arm64", (3, 9), (14, 0), None), id="macos"),
    # An existing `python` decides the CPython tag, not the system python3 that would have made it.
    pytest.param(dataclasses.replace(MAC, python_exists=True, python_version="3.12.4"),
                 Platform("darwin", "arm64", (3, 12), (14, 0), None), id="macos-venv-312"),
]


@pytest.mark.parametrize(("state", "expected"), PLATFORMS)
def test_compute_platform(state: NodeState, expected: Platform) -> None:
    assert compute_platform(state) == expected


@pytest.mark.parametrize(("state", "message"), [
    (dataclasses.replace(MAC, machine="x86_64"), "macOS on x86_64: mlx needs Apple silicon (arm64)"),
    (dataclasses.replace(LINUX, glibc=None), "Linux without glibc (musl?)"),
    (dataclasses.replace(LINUX, system="Windows"), "unsupported OS 'Windows'"),
])
def test_compute_platform_refuses_what_mlx_has_no_wheels_for(state: NodeState, message: str) -> None:
    with pytest.raises(SetupError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        compute_platform(state)


def test_platform_tags_and_keys() -> None:
    linux = compute_platform(LINUX)
    assert linux.key == "linux-x86_64-cp311-glibc2.36-cpu"
    tags = linux.pip_platforms()
    assert tags[0] == "manylinux_2_36_x86_64" and tags[-2:] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    assert len(tags) == 36 - 17 + 2
    mac = compute_platform(MAC)
    assert mac.key == "darwin-arm64-cp39-macos14.0-metal" and mac.pip_platforms() == ["macosx_14_0_arm64"]


def test_requirements_and_wanted_dists_carry_the_backend() -> None:
    linux, mac = compute_platform(LINUX), compute_platform(MAC)
    assert requirements(linux, PINS) == ("mlx[cpu]==0.32.4", "mlx-lm==0.32.2")
    assert requirements(mac, PINS) == ("mlx==0.32.4", "mlx-lm==0.32.2")
    assert wanted_dists(linux, PINS) == {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-cpu": "0.32.4"}
    assert wanted_dists(mac, PINS)["mlx-metal"] == "0.32.4"


def test_download_argv_is_for_the_node_not_the_coordinator() -> None:
    argv = build_download_argv("/py", compute_platform(LINUX), PINS, Path("/cache/x"))
    assert argv[:4] == ["/py", "-m", "pip", "download"]
    joined = " ".join(argv)
    assert "--only-binary :all: --dest /cache/x --implementation cp --python-version 3.11 --abi cp311" in joined
    assert "--platform manylinux_2_36_x86_64" in joined and "--no-index" not in joined
    assert argv[-3:] == ["mlx[cpu]==0.32.4", "mlx-lm==0.32.2", "pip"]
    offline = build_download_argv("/py", compute_platform(LINUX), PINS, Path("/d"), find_links=[Path("/mirror")])
    assert "--find-links /mirror --no-index" in " ".join(offline)
    # A cache being repaired is a source besides the index, never a reason for --no-index
    repair = build_download_argv("/py", compute_platform(LINUX), PINS, Path("/d"), cached=[Path("/old")])
    assert "--find-links /old" in " ".join(repair) and "--no-index" not in repair


# --- pip's failures, the wheel cache's check ---------------------------------------------------------------------

PIP = Path(__file__).parent.parent / "fixtures" / "pip"


def test_a_pip_traceback_is_reduced_to_the_wheel_and_its_error() -> None:
    out = (PIP / "install-corrupt-wheel.txt").read_text()
    assert len(out.splitlines()) > 30
    assert parse_pip_failure(out) == ("wheel-0.43.0-py3-none-any.whl: zipfile.BadZipFile: Bad CRC-32 for file "
                                      "'wheel/cli/pack.py'")
    # pip processes every wheel before it installs any: with several, the one that fails is the one whose CRC
    # check fails (found on the node), never a guess
    several = out.replace("Processing ", "Processing /srv/a-1-py3-none-any.whl\nProcessing ", 1)
    assert parse_pip_failure(several).startswith("zipfile.BadZipFile: ")
    assert parse_pip_failure(several, ["b-2-py3-none-any.whl"]).startswith("b-2-py3-none-any.whl: zipfile.BadZipFile")


def test_pips_own_errors_are_its_error_lines() -> None:
    assert parse_pip_failure((PIP / "install-no-match.txt").read_text()) == (
        "Could not find a version that satisfies the requirement nosuchpkg==1.0 (from versions: none); "
        "No matching distribution found for nosuchpkg==1.0")
    assert parse_pip_failure("Killed\n") == "Killed"
    assert parse_pip_failure("") == "no output"


def test_compute_bad_wheels() -> None:
    recorded = {"a.whl": "1" * 64, "b.whl": "2" * 64, "c.whl": "3" * 64, "d.whl": "4" * 64}
    found: dict[str, str | None] = {"a.whl": "1" * 64, "b.whl": "f" * 64, "d.whl": None, "extra.whl": "5" * 64}
    assert compute_bad_wheels(recorded, found) == [
        ("b.whl", "sha256 ffffffffffff... is not the 222222222222... recorded at download"),
        ("c.whl", "missing"), ("d.whl", "unreadable")]
    assert compute_bad_wheels(recorded, {k: v for k, v in recorded.items()}) == []


def make_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("m/__init__.py", "x = 1\n" * 4000)
    return path


def test_the_install_script_names_the_wheel_pip_failed_on_in_pips_order(tmp_path: Path) -> None:
    """The node's install script, run here: pip (a stand-in that fails as pip does on a bad wheel) names no wheel;
    the script finds it by CRC, in pip's install order, and stops there. A bad wheel of a package pip did not
    reach is not blamed."""
    house = tmp_path / "wheels"
    house.mkdir()
    for name in ("aaa-1-py3-none-any.whl", "mdurl-0.1.2-py3-none-any.whl", "mlx_lm-0.32.2-py3-none-any.whl",
                 "zzz-1-py3-none-any.whl"):
        make_wheel(house / name)
    for name in ("mlx_lm-0.32.2-py3-none-any.whl", "zzz-1-py3-none-any.whl"):
        data = bytearray((house / name).read_bytes())
        data[len(data) // 3] ^= 0xFF
        (house / name).write_bytes(bytes(data))
    pip = tmp_path / "python"
    pip.write_text("#!/bin/sh\necho 'Installing collected packages: mdurl, mlx-lm, zzz'\n"
                   "echo 'Traceback (most recent call last):'\necho 'zlib.error: Error -3'\nexit 2\n")
    pip.chmod(0o755)
    args = {"python": str(pip), "venv": None, "install": ["mlx-lm==0.32.2"], "wheelhouse": str(house)}
    r = subprocess.run([sys.executable, "-c", _INSTALL, json.dumps(args)], capture_output=True, text=True, check=False)
    assert r.returncode == 1
    why = json.loads(r.stdout.strip().splitlines()[-1])
    assert why["broken"] == ["mlx_lm-0.32.2-py3-none-any.whl"] and why["failed"] == "pip install mlx-lm==0.32.2"
    assert why["removed"] is None  # no venv was made by this run: nothing removed
    assert describe_install_failure("n1", why, tmp_path / "logs").startswith(
        "`pip install mlx-lm==0.32.2` failed: mlx_lm-0.32.2-py3-none-any.whl: zlib.error: Error -3; full log: "
        f"{tmp_path}/logs/install-n1-")
    # the wheels the coordinator's hashes name are checked first: a copy that differs stops it before anything
    args["hashes"] = {"aaa-1-py3-none-any.whl": "0" * 64}
    r = subprocess.run([sys.executable, "-c", _INSTALL, json.dumps(args)], capture_output=True, text=True, check=False)
    why = json.loads(r.stdout.strip().splitlines()[-1])
    assert why["failed"] == "verify" and why["output"].endswith(": aaa-1-py3-none-any.whl")
    assert not (house / "aaa-1-py3-none-any.whl").exists()  # removed: the next setup sends it again


def test_verify_wheelhouse_checks_the_recorded_hashes_and_gives_an_old_cache_its_hashes(tmp_path: Path) -> None:
    platform = compute_platform(LINUX)
    house = tmp_path / "h"
    house.mkdir()
    wheel = make_wheel(house / "m-1-py3-none-any.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    # an older coordinator's marker: no hashes; its wheels pass a zip CRC check, then the marker records them
    (house / ".complete").write_text(json.dumps({"requirements": [], "wheels": "0123456789abcdef"}))
    assert verify_wheelhouse(house, platform, PINS) == ({wheel.name: digest}, [])
    assert json.loads((house / ".complete").read_text())["wheels"] == {wheel.name: digest}
    data = bytearray(wheel.read_bytes())
    data[len(data) // 3] ^= 0xFF
    wheel.write_bytes(bytes(data))
    hashes, bad = verify_wheelhouse(house, platform, PINS)
    assert hashes == {wheel.name: digest} and [w for w, _ in bad] == [wheel.name]
    # and an old marker over a bad wheel: the CRC check finds it
    (house / ".complete").write_text(json.dumps({"requirements": [], "wheels": "0123456789abcdef"}))
    assert verify_wheelhouse(house, platform, PINS)[1] == [(wheel.name, "fails its zip CRC check")]


@pytest.mark.parametrize(("python", "venv"), [
    ("~/venvs/mlx/bin/python", "~/venvs/mlx"),
    ("/srv/venvs/mlx/bin/python3", "/srv/venvs/mlx"),
    ("/opt/v/bin/python3.12", "/opt/v"),
    ("/usr/local/bin/python", None),
    ("/usr/bin/python3.11", None),
    ("/opt/homebrew/bin/python3", None),
    ("python3", None),
    ("/opt/v/python", None),
    ("/opt/v/bin/pip", None),
    ("/bin/python", None),
])
def test_venv_dir_for(python: str, venv: str | None) -> None:
    assert venv_dir_for(python) == venv


# --- the plan ---------------------------------------------------------------------------------------------------


def test_a_missing_venv_is_created_installed_and_given_the_worker() -> None:
    plan = plan_node(NODE, LINUX, PINS)
    assert plan.problem is None and plan.changes
    assert plan.create_venv == "~/venvs/mlx"
    assert plan.install == ("mlx[cpu]==0.32.4", "mlx-lm==0.32.2")
    assert plan.ship_worker
    assert plan.actions() == ["create venv ~/venvs/mlx", "install mlx[cpu]==0.32.4 mlx-lm==0.32.2", "ship the worker"]


def test_a_set_up_node_plans_nothing() -> None:
    plan = plan_node(NODE, SET_UP, PINS)
    assert not plan.changes and plan.problem is None and plan.reasons == () and plan.actions() == []


def test_a_version_drift_reinstalls_only() -> None:
    state = dataclasses.replace(SET_UP, installed={**SET_UP.installed, "mlx-lm": "0.31.0"})
    plan = plan_node(NODE, state, PINS)
    assert plan.create_venv is None and not plan.ship_worker
    assert plan.install == ("mlx[cpu]==0.32.4", "mlx-lm==0.32.2")
    assert plan.reasons == ("mlx-lm 0.31.0 (want 0.32.2)",)


def test_a_missing_backend_is_installed_and_another_one_left_alone() -> None:
    state = dataclasses.replace(SET_UP, installed={"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-cuda-13": "0.32.4"})
    plan = plan_node(NODE, state, PINS)
    assert plan.install and "mlx-cpu missing (want 0.32.4)" in plan.reasons
    assert "also installed: mlx-cuda-13 (left alone)" in plan.reasons


def test_the_worker_alone() -> None:
    plan = plan_node(NODE, dataclasses.replace(SET_UP, worker=False), PINS)
    assert plan.actions() == ["ship the worker"] and plan.reasons == ("worker not shipped",)


@pytest.mark.parametrize(("node", "state", "problem"), [
    (Node("n1", "h", python="/usr/bin/python3.11"), LINUX, "is not a venv path"),
    (NODE, dataclasses.replace(LINUX, python_exists=True, python_error="Segmentation fault"),
     "exists but does not run: Segmentation fault"),
    (NODE, dataclasses.replace(MAC, machine="x86_64"), "mlx needs Apple silicon"),
    (NODE, dataclasses.replace(LINUX, venv_dir="other"), "~/venvs/mlx is a directory but not a venv"),
])
def test_what_setup_cannot_do_fails_the_node(node: Node, state: NodeState, problem: str) -> None:
    plan = plan_node(node, state, PINS)
    assert plan.problem is not None and problem in plan.problem
    assert not plan.changes


# --- the playbook's pins ----------------------------------------------------------------------------------------


def test_playbook_software_pins(tmp_path: Path) -> None:
    pb = tmp_path / "pb.yaml"
    pb.write_text("name: t\nmodel: /m\ndata: /d\nsoftware:\n  mlx: 0.32.4\n  mlx_lm: '0.32.2'\n")
    software = load_playbook(pb).software
    assert (software.mlx, software.mlx_lm) == ("0.32.4", "0.32.2")
    pb.write_text("name: t\nmodel: /m\ndata: /d\n")
    assert load_playbook(pb).software.mlx is None


@pytest.mark.parametrize("value", ["latest", "'>=0.32'", "[1]", "true"])
def test_playbook_software_rejects_what_is_not_one_version(tmp_path: Path, value: str) -> None:
    pb = tmp_path / "pb.yaml"
    pb.write_text(f"name: t\nmodel: /m\ndata: /d\nsoftware:\n  mlx: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_playbook(pb)
    assert str(info.value).startswith(f"{pb}:5: software.mlx: must be an exact version like 0.32.4")


# --- preflight's remedies ---------------------------------------------------------------------------------------


def test_software_remedies_name_the_setup_command(tmp_path: Path) -> None:
    pb_path = tmp_path / "my pb.yaml"
    pb_path.write_text("name: t\nmodel: /m\ndata: /d\n")
    facts = build_node_facts("mbp", load_profile("m5max-mbp-tb5"))
    facts = dataclasses.replace(facts, software=None)
    node = Node("mbp", "mbp.local", python="~/venvs/mlx/bin/python", source="/etc/fleet.yaml:7")
    ctx = CheckContext.build((node,), {}, {"mbp": facts}, load_playbook(pb_path))
    result = check_software(ctx, node, facts)
    assert result.status in (Status.ERROR, Status.FAIL)
    assert result.remedy is not None
    assert result.remedy.startswith(f"`coordinator setup -i /etc/fleet.yaml -p '{pb_path}' --limit mbp`, or by hand: ")


def test_the_playbooks_pins_are_checked(tmp_path: Path) -> None:
    pb_path = tmp_path / "pb.yaml"
    facts = dataclasses.replace(build_node_facts("mbp", load_profile("m5max-mbp-tb5")), software=Software(
        "/Users/me/venvs/mlx/bin/python", "3.12.8", "0.32.4", "0.32.2", mlx_backends={"mlx-metal": "0.32.4"}))
    node = Node("mbp", "mbp.local", source="/etc/fleet.yaml:7")
    assert facts.software is not None
    for pins, status in ((f"{{mlx: {facts.software.mlx_version}}}", Status.PASS), ("{mlx_lm: 9.9.9}", Status.FAIL)):
        pb_path.write_text(f"name: t\nmodel: /m\ndata: /d\nsoftware: {pins}\n")
        ctx = CheckContext.build((node,), {}, {"mbp": facts}, load_playbook(pb_path))
        result = check_software(ctx, node, facts)
        assert result.status is status, result
    assert result.summary.endswith(f"differ from the playbook's software: pins (mlx {facts.software.mlx_version} / "
                                   "mlx-lm 9.9.9)")
    assert result.remedy is not None and result.remedy.startswith("`coordinator setup -i /etc/fleet.yaml -p ")
    assert result.remedy.endswith(f"-m pip install mlx=={facts.software.mlx_version} mlx-lm==9.9.9")


# --- --network --------------------------------------------------------------------------------------------------

MACS = {"mbp": build_node_facts("mbp", load_profile("m5max-mbp-tb5")),
        "studio": build_node_facts("studio", load_profile("m3ultra-studio-tb5"))}


def with_addresses(facts: NodeFacts, addresses: dict[str, str], bridge_off: bool) -> NodeFacts:
    ifaces = []
    for i in facts.interfaces or ():
        if i.name in addresses:
            i = dataclasses.replace(i, ipv4=(*i.ipv4, addresses[i.name]))
        if i.name == "bridge0" and bridge_off:
            i = NetInterface("bridge0")
        ifaces.append(i)
    return dataclasses.replace(facts, interfaces=tuple(ifaces))


def test_one_cable_is_one_slash_30_numbered_in_inventory_order() -> None:
    cables, problems = compute_cables(["mbp", "studio"], MACS)
    assert problems == {}
    [cable] = cables
    assert (cable.a.node, cable.a.interface, cable.a.service, cable.a.ip) == ("mbp", "en1", "Thunderbolt 1", "192.168.0.1")
    assert (cable.b.node, cable.b.interface, cable.b.service, cable.b.ip) == ("studio", "en3", "Thunderbolt 2",
                                                                              "192.168.0.2")
    assert cable.subnet == "192.168.0.0/30"
    [flipped] = compute_cables(["studio", "mbp"], MACS)[0]
    assert (flipped.a.node, flipped.a.ip, flipped.b.node) == ("studio", "192.168.0.1", "mbp")


def test_network_plan_turns_the_bridge_off_and_sets_each_end() -> None:
    nodes = [Node("mbp", "a", user="me"), Node("studio", "b", user="root"), Node("lin", "c")]
    plans = plan_network(nodes, MACS)
    assert plans["mbp"].commands == (("networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"),
                                     ("networksetup", "-setmanual", "Thunderbolt 1", "192.168.0.1", NETMASK))
    assert plans["studio"].addresses == (("en3", "192.168.0.2/30", "mbp", "192.168.0.1"),)
    assert plans["lin"].commands == () and plans["lin"].note == "no facts"
    assert render_command(nodes[0], plans["mbp"].commands[1]) == (
        "sudo -n networksetup -setmanual 'Thunderbolt 1' 192.168.0.1 255.255.255.252")
    assert render_command(nodes[1], plans["studio"].commands[0]) == (
        "networksetup -setnetworkserviceenabled 'Thunderbolt Bridge' off")


def test_network_plan_is_empty_once_the_addresses_are_there() -> None:
    done = {"mbp": with_addresses(MACS["mbp"], {"en1": "192.168.0.1"}, bridge_off=True),
            "studio": with_addresses(MACS["studio"], {"en3": "192.168.0.2"}, bridge_off=True)}
    plans = plan_network([Node("mbp", "a"), Node("studio", "b")], done)
    assert plans["mbp"].commands == () and plans["studio"].commands == ()
    assert plans["mbp"].addresses == (("en1", "192.168.0.1/30", "studio", "192.168.0.2"),)


def test_a_mac_without_a_cable_to_the_fleet_plans_nothing() -> None:
    plans = plan_network([Node("mbp", "a")], {"mbp": MACS["mbp"]})
    assert plans["mbp"].commands == () and plans["mbp"].note == "no Thunderbolt cable to another node of the inventory"


def test_an_end_without_its_interface_fails_that_node() -> None:
    hidden = dataclasses.replace(MACS["studio"], hardware_ports=tuple(
        hp for hp in MACS["studio"].hardware_ports or () if hp.port != "Thunderbolt 2"))
    plans = plan_network([Node("mbp", "a"), Node("studio", "b")], {"mbp": MACS["mbp"], "studio": hidden})
    assert plans["studio"].problem is not None and "no Thunderbolt interface in networksetup" in plans["studio"].problem
    assert plans["mbp"].commands == ()


# --- uploads ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "sftp"), [("~/mlx-work/.coordinator", "mlx-work/.coordinator"), ("~", "."),
                                            ("~/", "."), ("/srv/work", "/srv/work"), ("rel/dir", "rel/dir")])
def test_sftp_paths_are_relative_to_the_home(path: str, sftp: str) -> None:
    assert sftp_path(path) == sftp


def test_a_local_node_upload_copies_into_a_new_directory(tmp_path: Path) -> None:
    (tmp_path / "a.whl").write_bytes(b"wheel")
    target = tmp_path / "node" / "wheelhouse"
    asyncio.run(LocalTransport(Node("me", "127.0.0.1")).upload([tmp_path / "a.whl"], str(target)))
    assert (target / "a.whl").read_bytes() == b"wheel"
