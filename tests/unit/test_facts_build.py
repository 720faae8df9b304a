"""`build_node_facts`: probe sections in, typed NodeFacts out; every failure a FactError with the raw text.

Built from the recorded node profiles (tests/fixtures/profiles) plus the `env` and `worker` sections the
profiles lack (tests/factsutil.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from coordinator.facts import macos
from coordinator.facts.build import build_node_facts, node_load, parse_env, parse_worker
from coordinator.facts.model import DirHashes, FactError, FactErrorKind, FileHash, ParseError, Rdma, RdmaDevice, Reach
from coordinator.facts.probe import Section
from tests.factsutil import (
    ALL_PROFILES,
    DATA_DIR,
    ENV_TEXT,
    MBP,
    MODEL_CONFIG,
    MODEL_DIR,
    MODEL_PARAMS,
    NODEV,
    OLD,
    PYTHON,
    STUDIO,
    capture,
    facts_from,
    hashes_answer,
    linux_sections,
    load_profile,
    profile_sections,
    worker_answer,
)

GiB = 1024**3

FACT_FIELDS = ("os", "hardware", "thunderbolt", "hardware_ports", "interfaces", "rdma", "memory", "power", "disk",
               "gpu", "software", "hashes", "reach", "env", "model_config", "model_params")

REACH = [{"peer": "other", "ip": "192.168.10.2", "ok": True, "rtt_ms": 0.4, "error": None}]


def full_sections(profile: str | dict[str, Section], **kw: Any) -> dict[str, Section]:
    answer = worker_answer(hashes=hashes_answer(), reach=REACH)
    return profile_sections(profile, worker=answer, **kw)


# ------------------------------------------------------------------------------------------------- profiles

# profile -> (os version, build, chip, memory GiB, rdma, power (sleep minutes, on battery), connected TB speeds)
PROFILE_FACTS: dict[str, tuple[Any, ...]] = {
    MBP: ("26.5", "25F71", "Apple M5 Max", 128, Rdma("enabled", (
        RdmaDevice("rdma_en1", "PORT_ACTIVE"), RdmaDevice("rdma_en6", "PORT_DOWN"), RdmaDevice("rdma_en2", "PORT_DOWN"))),
        (0, False), [80.0]),
    STUDIO: ("26.5", "25F71", "Apple M3 Ultra", 512, Rdma("enabled", (
        RdmaDevice("rdma_en2", "PORT_DOWN"), RdmaDevice("rdma_en3", "PORT_ACTIVE"), RdmaDevice("rdma_en5", "PORT_DOWN"),
        RdmaDevice("rdma_en4", "PORT_DOWN"), RdmaDevice("rdma_en6", "PORT_DOWN"), RdmaDevice("rdma_en7", "PORT_DOWN"))),
        (0, False), [80.0, 80.0]),
    NODEV: ("26.4", "25E246", "Apple M4 Max", 48, Rdma("enabled", ()), (1, True), [40.0]),
    OLD: ("14.6.1", "23G93", "Apple M1 Max", 64, Rdma(None, ()), (1, False), []),
}


@pytest.mark.parametrize("profile", ALL_PROFILES)
def test_every_profile_builds_without_fact_errors(profile: str) -> None:
    sections = full_sections(profile)
    facts = facts_from("n1", sections)
    assert facts.errors == ()
    for name in FACT_FIELDS:
        assert getattr(facts, name) is not None, name
    version, build, chip, mem_gib, rdma, (sleep, battery), speeds = PROFILE_FACTS[profile]
    assert facts.os is not None and facts.hardware is not None and facts.power is not None
    assert (facts.os.system, facts.os.arch, facts.os.name, facts.os.version, facts.os.build) == \
        ("Darwin", "arm64", "macOS", version, build)
    assert facts.hardware.chip == chip
    assert facts.hardware.memory_bytes == mem_gib * GiB
    assert facts.memory is not None and facts.memory.total_bytes == mem_gib * GiB
    assert facts.memory.page_size == 16384
    assert facts.rdma == rdma
    assert (facts.power.sleep_minutes, facts.power.on_battery) == (sleep, battery)
    assert [p.speed_gbps for p in facts.thunderbolt or () if p.connected] == speeds
    # the raw answers are kept as given, exit statuses included
    assert facts.raw == {k: s.text for k, s in sections.items()}
    assert facts.raw_rc == {k: s.rc for k, s in sections.items()}


def test_missing_commands_that_are_facts_are_not_errors() -> None:
    """macOS 14 has no rdma_ctl/ibv_* (exit 127): "no RDMA" is the fact. A header-only ibv_devices makes
    ibv_devinfo exit 255 ("No IB devices found"): no device is the fact, not an error."""
    old = facts_from("old", full_sections(OLD))
    assert old.raw_rc["rdma_ctl"] == old.raw_rc["ibv_devices"] == old.raw_rc["ibv_devinfo"] == 127
    assert old.rdma == Rdma(ctl_status=None) and old.errors == ()
    nodev = facts_from("nodev", full_sections(NODEV))
    assert nodev.raw_rc["ibv_devinfo"] == 255 and "No IB devices found" in nodev.raw["ibv_devinfo"]
    assert nodev.rdma == Rdma("enabled", ()) and nodev.errors == ()


def test_linux_node_builds_without_fact_errors() -> None:
    facts = facts_from("gpu1", full_sections(linux_sections()))
    assert facts.errors == ()
    assert facts.os is not None and (facts.os.system, facts.os.name, facts.os.version) == \
        ("Linux", "Debian GNU/Linux 12 (bookworm)", "12")
    assert facts.rdma == Rdma(ctl_status=None, devices=())  # no /sys/class/infiniband (exit 2): optional
    assert facts.raw_rc["infiniband"] == 2
    assert facts.interfaces is not None and ("192.0.2.2",) in [i.ipv4 for i in facts.interfaces]
    ib = facts_from("gpu1", full_sections(linux_sections(), replace={"infiniband": "mlx5_0\n"}))
    assert ib.rdma == Rdma(ctl_status=None, devices=(RdmaDevice("mlx5_0"),))
    assert facts.net_links is not None and [n.name for n in facts.net_links] == ["eth0", "ifb0", "ifb1", "lo"]


def test_linux_sys_class_net_is_optional_but_garbage_is_an_error() -> None:
    sections = full_sections(linux_sections())
    del sections["sys_class_net"]
    facts = facts_from("gpu1", sections)
    assert facts.net_links is None and facts.errors == ()  # nettest then says `unknown`, no check fails
    bad = facts_from("gpu1", full_sections(linux_sections(), replace={"sys_class_net": "eth0 type=1\n"}))
    assert bad.net_links is None
    assert [(e.source, e.raw) for e in bad.errors] == [("sys_class_net", "eth0 type=1\n")]


def test_linux_gpu_facts_come_from_nvidia_smi_and_its_absence_is_no_gpu() -> None:
    facts = facts_from("gpu1", full_sections(linux_sections()))
    assert facts.gpu is None and facts.errors == ()  # no nvidia-smi on the node: no section, no GPU, no error
    smi = capture("nvidia_smi/constructed-a100-x2.txt")
    two = facts_from("gpu1", full_sections(linux_sections(), replace={"nvidia_smi": smi}))
    assert two.errors == () and two.gpu is not None and two.gpu.cuda
    assert [(d.index, d.memory_total_bytes, d.driver_version) for d in two.gpu.devices] == \
        [(0, 81920 * 1024**2, "535.183.01"), (1, 81920 * 1024**2, "535.183.01")]


def test_linux_failing_nvidia_smi_is_an_error_not_no_gpu() -> None:
    text = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
            "NVIDIA driver is installed and running.\n")
    sections = full_sections(linux_sections())
    sections["nvidia_smi"] = Section("nvidia_smi", text, 9)
    facts = facts_from("gpu1", sections)
    assert facts.gpu is None
    assert [(e.source, e.message, e.raw) for e in facts.errors] == \
        [("nvidia_smi", "nvidia-smi exited with status 9", text)]


# ------------------------------------------------------------------------------------------------- missing sections

# section -> the fact that is then unknown (None), or None when the section only refines another fact
MISSING_SECTION_CASES = [
    ("uname", "os"),
    ("sw_vers", "os"),
    ("system_profiler", "thunderbolt"),
    ("networksetup", "hardware_ports"),
    ("ifconfig", "interfaces"),
    ("rdma_ctl", "rdma"),
    ("ibv_devices", "rdma"),
    ("pmset", "power"),
    ("ioreg", "gpu"),
    ("df", "disk"),
    ("env", "env"),
    ("worker", "software"),
    ("sysctl", None),  # memory size then comes from memory_pressure, hardware from system_profiler
    ("vm_stat", None),
    ("memory_pressure", None),
    ("pmset_batt", None),
    ("ibv_devinfo", None),
]


@pytest.mark.parametrize(("section", "unknown"), MISSING_SECTION_CASES)
def test_missing_section_is_a_fact_error(section: str, unknown: str | None) -> None:
    facts = facts_from("n1", full_sections(MBP, replace={section: None}))
    assert [e.source for e in facts.errors] == [section]
    (err,) = facts.errors
    assert "no" in err.message and "output" in err.message and err.raw == ""
    if unknown is not None:
        assert getattr(facts, unknown) is None
    assert section not in facts.raw


def test_missing_section_refinements() -> None:
    no_devinfo = facts_from("n1", full_sections(MBP, replace={"ibv_devinfo": None}))
    assert no_devinfo.rdma is not None
    assert [d.port_state for d in no_devinfo.rdma.devices] == [None, None, None]  # devices known, states not
    no_batt = facts_from("n1", full_sections(MBP, replace={"pmset_batt": None}))
    assert no_batt.power is not None and no_batt.power.on_battery is None
    no_sysctl = facts_from("n1", full_sections(MBP, replace={"sysctl": None}))
    assert no_sysctl.memory is not None and no_sysctl.memory.total_bytes == 128 * GiB  # from memory_pressure


NONZERO_CASES = [
    # section, text, rc -> message
    ("pmset", "pmset: unable to read settings\n", 1, "exited with status 1"),
    ("sw_vers", "sh: line 1: sw_vers: command not found\n", 127, "command not found"),
    ("df", "df: /Users/me/mlx-work: Operation not permitted\n", 1, "exited with status 1"),
    ("system_profiler", "2026-11-23 system_profiler[812:5521] SPThunderboltDataType: timed out\n", 124,
     "exited with status 124"),
    ("ibv_devices", "Failed to get IB devices list: Function not implemented\n", 1, "exited with status 1"),
]


@pytest.mark.parametrize(("section", "text", "rc", "message"), NONZERO_CASES)
def test_nonzero_exit_is_recorded_with_the_raw_text(section: str, text: str, rc: int, message: str) -> None:
    facts = facts_from("n1", full_sections(MBP, replace={section: Section(section, text, rc)}))
    assert facts.errors == (FactError(section, message, text),)
    assert facts.raw[section] == text and facts.raw_rc[section] == rc


@pytest.mark.parametrize("section", sorted(load_profile(MBP)))
@pytest.mark.parametrize("garbage", ["garbage\n", "", "{}", "\x00\xff\n", "Darwin 1 2 3 4\n"])
def test_garbage_never_crashes_and_is_kept_as_evidence(section: str, garbage: str) -> None:
    facts = facts_from("n1", full_sections(MBP, replace={section: garbage}))
    assert facts.raw[section] == garbage
    for err in facts.errors:
        assert err.raw == garbage and err.source == section
        assert err.kind == FactErrorKind.NODE, err  # odd output is the node's, never reported as our bug
        json.dumps(err.to_json())
    if (section, garbage) == ("rdma_ctl", "garbage\n"):
        assert facts.rdma == Rdma("unknown", facts.rdma.devices if facts.rdma else ())  # one word: a state
    else:
        assert facts.errors, "garbage must not parse silently"


def test_garbage_system_profiler() -> None:
    facts = facts_from("n1", full_sections(MBP, replace={"system_profiler": "garbage\n"}))
    assert (facts.hardware, facts.thunderbolt) == (None, None)
    (err,) = facts.errors
    assert err.source == "system_profiler" and err.message.startswith("unparseable output") and err.raw == "garbage\n"


@pytest.mark.parametrize("bug", [KeyError("SPPowerDataType"), TypeError("'NoneType' object is not subscriptable"),
                                 IndexError("list index out of range"), ZeroDivisionError("division by zero")],
                         ids=lambda e: type(e).__name__)
def test_a_parser_bug_is_our_error_not_the_nodes(monkeypatch: pytest.MonkeyPatch, bug: Exception) -> None:
    def broken(text: str) -> object:
        raise bug

    monkeypatch.setattr(macos, "parse_pmset", broken)
    sections = full_sections(MBP)
    facts = facts_from("n1", sections)
    (err,) = facts.errors
    assert err.kind == FactErrorKind.PARSER_BUG and err.source == "pmset" and err.raw == sections["pmset"].text
    assert err.message == f"parser bug: {type(bug).__name__}: {bug}" and "unparseable" not in err.message
    assert err.to_json()["kind"] == "parser_bug"
    assert facts.power is None and facts.hardware is not None  # the broken parser costs its fact only


def test_odd_output_is_the_nodes_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuses(text: str) -> object:
        raise ParseError("pmset: expected 'sleep N'")

    monkeypatch.setattr(macos, "parse_pmset", refuses)
    (err,) = facts_from("n1", full_sections(MBP)).errors
    assert err.kind == FactErrorKind.NODE and err.message == "unparseable output: pmset: expected 'sleep N'"
    assert err.to_json()["kind"] == "node"


def test_raw_evidence_is_clipped() -> None:
    text = "x" * 5000
    facts = facts_from("n1", full_sections(MBP, replace={"pmset": Section("pmset", text, 1)}))
    raw = facts.errors[0].to_json()["raw"]
    assert raw.startswith("x" * 2000) and raw.endswith("... [3000 more chars]")


# ------------------------------------------------------------------------------------------------- worker


def test_worker_answer_is_parsed() -> None:
    facts = facts_from("n1", full_sections(MBP))
    sw = facts.software
    assert sw is not None
    assert (sw.python, sw.python_version, sw.mlx_version, sw.mlx_lm_version, sw.errors) == \
        (PYTHON, "3.12.8", "0.32.1", "0.31.0", ())
    assert facts.hashes is not None
    assert [h.path for h in facts.hashes] == [MODEL_DIR, DATA_DIR]
    assert facts.hashes[1] == DirHashes(DATA_DIR, True, (
        FileHash("train.jsonl", 1011, hashes_answer()[1]["files"][0]["sha256"]),
        FileHash("valid.jsonl", 1011, hashes_answer()[1]["files"][1]["sha256"]),
    ), None, 0, 2022)
    assert facts.reach == (Reach("other", "192.168.10.2", True, 0.4, None),)
    assert facts.model_config == MODEL_CONFIG and facts.model_params == MODEL_PARAMS


def test_worker_without_a_playbook_has_no_hashes() -> None:
    facts = facts_from("n1", profile_sections(MBP, worker={"python": {"executable": PYTHON, "version": "3.12.8"},
                                                            "packages": {"mlx": "0.32.1", "mlx_lm": None},
                                                            "errors": ["mlx_lm: No module named 'mlx_lm'"]}))
    assert facts.errors == ()
    assert (facts.hashes, facts.reach, facts.model_config, facts.model_params) == (None, None, None, None)
    assert facts.software is not None and facts.software.mlx_lm_version is None
    assert facts.software.errors == ("mlx_lm: No module named 'mlx_lm'",)


def test_worker_python_not_found() -> None:
    text = "python interpreter not found: /opt/nope/bin/python3\n"
    facts = facts_from("n1", profile_sections(MBP, worker=text, worker_rc=127))
    assert facts.software is not None
    assert (facts.software.python, facts.software.python_version) == ("/opt/nope/bin/python3", None)
    assert facts.errors == (FactError("worker", text.strip(), text),)


WORKER_GARBAGE = [
    pytest.param("Traceback (most recent call last):\nSyntaxError: invalid syntax\n", 1, "did not answer JSON (exit 1)",
                 id="not-json"),
    pytest.param("[1, 2]", 0, "not a JSON object", id="array"),
    pytest.param(json.dumps({"hashes": [{"path": "/m"}]}), 0, "unparseable output", id="hash-without-exists"),
    pytest.param(json.dumps({"reach": [{"peer": "b"}]}), 0, "unparseable output", id="reach-without-ip"),
    pytest.param(json.dumps({"hashes": None}), 0, "unparseable output", id="hashes-null"),
    pytest.param(json.dumps({"errors": 3}), 0, "unparseable output", id="errors-not-a-list"),
    pytest.param(json.dumps({"hashes": [{"path": "/m", "exists": True, "files": [{"path": "a", "size": None,
                                                                                  "sha256": "0"}]}]}),
                 0, "unparseable output", id="size-null"),
    pytest.param(json.dumps({"reach": [3]}), 0, "unparseable output", id="reach-not-objects"),
]


@pytest.mark.parametrize(("text", "rc", "message"), WORKER_GARBAGE)
def test_worker_garbage_is_a_fact_error(text: str, rc: int, message: str) -> None:
    facts = facts_from("n1", profile_sections(MBP, worker=text, worker_rc=rc))
    (err,) = facts.errors
    assert err.source == "worker" and message in err.message and err.raw == text
    assert err.kind == FactErrorKind.NODE
    assert facts.software is None


@pytest.mark.parametrize("answer", [
    {"python": "3.12.8"},
    {"python": {"executable": PYTHON, "version": 3.12}, "packages": {"mlx": 0.32, "mlx_lm": "0.31.0"}},
], ids=["python-not-an-object", "numeric-versions"])
def test_worker_wrong_types_are_a_fact_error(answer: dict[str, Any]) -> None:
    facts = build_node_facts("n1", profile_sections(MBP, worker=answer), workdir="/Users/me")
    sw = facts.software
    assert facts.errors or sw is None or all(isinstance(v, str | None) for v in
                                             (sw.python_version, sw.mlx_version, sw.mlx_lm_version))


def test_parse_worker_is_pure_and_total_for_a_full_answer() -> None:
    out = parse_worker(worker_answer(hashes=hashes_answer(missing=(MODEL_DIR,)), reach=[]))
    assert out["hashes"][0] == DirHashes(MODEL_DIR, False, (), None, 0, 0)
    assert out["reach"] == ()


# ------------------------------------------------------------------------------------------------- env

ENV_CASES = [
    pytest.param("", {}, id="empty"),
    pytest.param(ENV_TEXT, {"HOME": "/Users/me", "PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "SHELL": "/bin/zsh",
                            "USER": "me"}, id="plain"),
    pytest.param("A=1\nB=x=y==\nC=\n", {"A": "1", "B": "x=y==", "C": ""}, id="equals-in-value-and-empty"),
    pytest.param("_=/usr/bin/env\n__CF_USER_TEXT_ENCODING=0x1F5:0x0:0x0\n",
                 {"_": "/usr/bin/env", "__CF_USER_TEXT_ENCODING": "0x1F5:0x0:0x0"}, id="underscore-names"),
    pytest.param("MSG=first line\nsecond line\n  third = indented\nNEXT=2\n",
                 {"MSG": "first line\nsecond line\n  third = indented", "NEXT": "2"}, id="multi-line-value"),
    pytest.param("CERT=-----BEGIN CERTIFICATE-----\nMIIB+zCCAaGgAwIBAgIU=\n-----END CERTIFICATE-----\nZ=1\n",
                 {"CERT": "-----BEGIN CERTIFICATE-----\nMIIB+zCCAaGgAwIBAgIU=\n-----END CERTIFICATE-----", "Z": "1"},
                 id="multi-line-with-equals-and-dashes"),
    pytest.param("A=1\n\nB=2\n", {"A": "1\n", "B": "2"}, id="value-ending-in-newline"),
    pytest.param("1X=no\nA=1\n2B=cont\n", {"A": "1\n2B=cont"}, id="digit-first-is-not-a-name"),
    pytest.param("junk before any name\nA=1\n", {"A": "1"}, id="leading-junk-ignored"),
    pytest.param("A=1\nA=2\n", {"A": "2"}, id="last-wins"),
]


@pytest.mark.parametrize(("text", "expected"), ENV_CASES)
def test_parse_env(text: str, expected: dict[str, str]) -> None:
    assert parse_env(text) == expected


def test_env_section_feeds_facts() -> None:
    facts = facts_from("n1", full_sections(MBP, env="MLX_RANK=0\nPS1=a\nb\n"))
    assert facts.env == {"MLX_RANK": "0", "PS1": "a\nb"}


def test_parse_env_exported_bash_functions_do_not_corrupt_the_previous_value() -> None:
    # bash exports functions as `BASH_FUNC_<name>%%=() {  body` (Lmod's `module`/`ml` on Linux nodes)
    text = "MLX_METAL_FAST_SYNCH=1\nBASH_FUNC_ml%%=() {  eval \"$($LMOD_DIR/ml_cmd \"$@\")\"\n}\nZ=1\n"
    env = parse_env(text)
    assert env["MLX_METAL_FAST_SYNCH"] == "1"
    assert env["Z"] == "1"


# ------------------------------------------------------------------------------------------------- load


def test_node_load_linux_from_the_recorded_proc_loadavg() -> None:
    facts = facts_from("lin", profile_sections(linux_sections(), worker=worker_answer()))
    assert node_load(facts) == ((0.27, 0.08, 0.03), None)


def test_node_load_linux_failed_read_is_unknown_not_a_problem() -> None:
    sections = linux_sections() | {"loadavg": Section("loadavg", "cat: /proc/loadavg: Permission denied\n", 1)}
    assert node_load(facts_from("lin", profile_sections(sections, worker=worker_answer()))) == (None, None)


def test_node_load_linux_malformed_is_a_named_problem() -> None:
    facts = facts_from("lin", profile_sections(linux_sections(), worker=worker_answer(),
                                               replace={"loadavg": "0.27 0.08\n"}))
    load, problem = node_load(facts)
    assert load is None and problem is not None and problem.startswith("loadavg: /proc/loadavg")


def test_node_load_mac_from_a_recorded_vm_loadavg() -> None:
    # The probe's sysctl (hw ...) plus the recorded `vm.loadavg` line of a Mac that reports it.
    vm = next(line for line in capture("sysctl/vm-loadavg-swapusage-mac-load.txt").splitlines(keepends=True)
              if line.startswith("vm.loadavg"))
    facts = facts_from("mac", full_sections(MBP, replace={"sysctl": load_profile(MBP)["sysctl"].text + vm}))
    assert node_load(facts) == ((4.38, 8.08, 15.92), None)


def test_node_load_mac_without_vm_loadavg_is_unknown() -> None:
    assert node_load(facts_from("mac", full_sections(MBP))) == (None, None)


def test_node_load_mac_malformed_is_a_named_problem() -> None:
    sysctl = load_profile(MBP)["sysctl"].text + "vm.loadavg: soon\n"
    load, problem = node_load(facts_from("mac", full_sections(MBP, replace={"sysctl": sysctl})))
    assert load is None and problem == "loadavg: vm.loadavg: expected '{ L1 L5 L15 }', got 'vm.loadavg: soon'"
