"""Preflight checks, "facts in, verdicts out".

Every case builds NodeFacts from the recorded node profiles through `build_node_facts` (the real parsing
path), varies ONE thing (a profile section's text, the worker's JSON answer, the env text, the playbook, the
connection outcome), evaluates the whole fleet with `CheckContext.build` + `evaluate_preflight`, and asserts
each named verdict: its status, that its summary names the culprit (node, file, link, variable) and what its
remedy says. Every report of every case is also held to the result contract: a non-empty summary, a non-empty
remedy on every fail/warn/error, and `json.dumps(report.to_json())` working.

The base fleet is the recorded TB5 pair: `mbp` (m5max-mbp-tb5, data IP 192.168.10.1 on en1) and `studio`
(m3ultra-studio-tb5, 192.168.10.2 on en3), RDMA active between them, running a LoRA job under jaccl.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from coordinator.config.playbook import Playbook, parse_playbook
from coordinator.errors import HostKeyError, TransportError
from coordinator.facts import macos
from coordinator.facts.probe import Section
from coordinator.models import CHECK_IDS, CheckResult, ConnectInfo, Connection, LintResult, Node, PreflightReport, Status
from coordinator.preflight.checks import evaluate_node, evaluate_preflight
from coordinator.preflight.checks.context import CheckContext, majority
from coordinator.preflight.lint import lint_playbook
from tests.factsutil import (
    DATA_DIR,
    DATA_FILES,
    ENV_TEXT,
    MBP,
    MODEL_CONFIG,
    MODEL_DIR,
    MODEL_FILES,
    NODEV,
    OLD,
    PYTHON,
    STUDIO,
    WORKDIR,
    capture,
    data_answer,
    edit,
    edit_block,
    facts_from,
    hashes_answer,
    ibv_devinfo_state,
    linux_sections,
    load_profile,
    profile_sections,
    reach_answer,
    set_link_speed,
    sha,
    studio_mesh,
    worker_answer,
)

P, W, F, E, S = Status.PASS, Status.WARN, Status.FAIL, Status.ERROR, Status.SKIP

# --------------------------------------------------------------------------------------------------- fleet


@dataclass(frozen=True)
class M:
    """One fleet member: its OS sections and what its worker and env answer. Defaults: a healthy node."""

    name: str
    sections: Mapping[str, Section]
    ip: str
    worker: Mapping[str, Any] = field(default_factory=dict)  # worker_answer(...) keyword overrides
    worker_text: str | None = None  # the raw worker section instead (non-JSON, interpreter not found)
    worker_rc: int = 0
    env: str = ENV_TEXT
    down: Mapping[str, str] = field(default_factory=dict)  # peers whose data-plane IP it cannot reach
    node: Mapping[str, Any] = field(default_factory=dict)  # Node field overrides (env, connection, ...)

    def with_section(self, name: str, text: str | Section | None) -> M:
        sections = dict(self.sections)
        if text is None:
            del sections[name]
        else:
            sections[name] = text if isinstance(text, Section) else Section(name, text, 0)
        return dataclasses.replace(self, sections=sections)

    def edited(self, name: str, old: str, new: str, *, count: int = 1) -> M:
        return self.with_section(name, edit(self.sections[name].text, old, new, count=count))

    def but(self, **changes: Any) -> M:
        return dataclasses.replace(self, **changes)


def member(name: str, profile: str, ip: str, **kw: Any) -> M:
    return M(name, load_profile(profile), ip, **kw)


MBP_M = member("mbp", MBP, "192.168.10.1")
STUDIO_M = member("studio", STUDIO, "192.168.10.2")
PAIR = (MBP_M, STUDIO_M)

BASE_PB: dict[str, Any] = {"name": "job", "model": MODEL_DIR, "data": DATA_DIR, "backend": "jaccl",
                           "train": {"save_every": 50}}


def playbook(**changes: Any) -> Playbook:
    """BASE_PB with top-level keys replaced (`train` merged into the base train section)."""
    value = {**BASE_PB, **changes}
    if "train" in changes:
        value["train"] = {**BASE_PB["train"], **changes["train"]}
    return parse_playbook({k: v for k, v in value.items() if v is not None}, path="playbook.yaml")


def ok_connect(name: str) -> ConnectInfo:
    return ConnectInfo(name, connect_s=0.0512, rtt_ms=1.234, host_key="ssh-ed25519 SHA256:testkey")


def build_ctx(members: Sequence[M], pb: Playbook | None, *, connect: Mapping[str, Any] | None = None,
              probe_errors: Mapping[str, TransportError] | None = None,
              manifest: Mapping[str, str] | None = None) -> CheckContext:
    nodes = tuple(Node(m.name, f"{m.name}.local", ips=(m.ip,), python=PYTHON, workdir=WORKDIR, **m.node)
                  for m in members)
    outcome: dict[str, ConnectInfo | TransportError] = {n.name: ok_connect(n.name) for n in nodes}
    outcome.update(connect or {})
    errors = dict(probe_errors or {})
    facts = {}
    for m, node in zip(members, nodes, strict=True):
        if isinstance(outcome.get(m.name), TransportError) or m.name in errors or m.name not in outcome:
            continue
        if m.worker_text is not None:
            worker: Mapping[str, Any] | str = m.worker_text
        else:
            kw: dict[str, Any] = {"reach": reach_answer(node, nodes, down=m.down)}
            if pb is not None:
                kw["hashes"] = hashes_answer(data_dir=pb.data)
            worker = worker_answer(**{**kw, **m.worker})
        sections = profile_sections(m.sections, env=m.env, worker=worker, worker_rc=m.worker_rc)
        facts[m.name] = facts_from(m.name, sections)
    return CheckContext.build(nodes, outcome, facts, pb, manifest, errors)


def assert_contract(report: PreflightReport) -> None:
    for _, checks in report.nodes:
        for c in checks:
            assert c.summary.strip(), c
            if c.status in (F, W, E):
                assert c.remedy.strip(), f"{c.node}/{c.id} {c.status} has no remedy: {c.summary}"
    for lint in report.lint:
        assert lint.summary.strip(), lint
        if lint.status in (F, W, E):
            assert lint.remedy.strip(), lint
    json.dumps(report.to_json())


def preflight(members: Sequence[M], pb: Playbook | None = None, *, lint: Sequence[LintResult] = (),
              **kw: Any) -> tuple[PreflightReport, dict[tuple[str, str], CheckResult]]:
    ctx = build_ctx(members, pb, **kw)
    report = evaluate_preflight(ctx, tuple(lint))
    assert_contract(report)
    assert [name for name, _ in report.nodes] == [m.name for m in members]
    for _, checks in report.nodes:
        assert tuple(c.id for c in checks) == CHECK_IDS
    return report, {(c.node, c.id): c for _, checks in report.nodes for c in checks}


# An expectation: (node, check id, status, substrings of the summary, substrings of the remedy).
Expect = tuple[str, str, Status, tuple[str, ...], tuple[str, ...]]


def check_expectations(results: Mapping[tuple[str, str], CheckResult], expects: Sequence[Expect]) -> None:
    for node, check_id, status, in_summary, in_remedy in expects:
        r = results[(node, check_id)]
        assert r.status == status, f"{node}/{check_id}: {r.status} {r.summary!r} (remedy {r.remedy!r})"
        for text in in_summary:
            assert text in r.summary, f"{node}/{check_id}: {text!r} not in summary {r.summary!r}"
        for text in in_remedy:
            assert text in r.remedy, f"{node}/{check_id}: {text!r} not in remedy {r.remedy!r}"


def run_case(members: Sequence[M], pb: Playbook | None, expects: Sequence[Expect], **kw: Any) -> PreflightReport:
    report, results = preflight(members, pb, **kw)
    check_expectations(results, expects)
    return report


# --------------------------------------------------------------------------------------------------- variations

MBP_BUS = "817DCFA4-B481-4100-80FC-91C7AA969F0B"
STUDIO_BUS = "28CA4C30-A263-4C55-B302-953416D0B209"
NODEV_BUS = "817DCFA4-B481-4100-80FC-91C7AA969F4B"

MBP_EN1_IP = "\tinet 192.168.10.1 netmask 0xfffffffc broadcast 192.168.10.3\n"
BRIDGE_DOWN = "bridge0: flags=8822<BROADCAST,SMART,SIMPLEX,MULTICAST>"
BRIDGE_UP = "bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST>"
HEADER_ONLY_IBV = "    device          \t   node GUID\n    ------          \t----------------\n"


def at_40(m: M) -> M:
    """The pair's cable negotiated 40 Gb/s (a Thunderbolt 4 cable): the connected receptacle says so."""
    bus = {"mbp": MBP_BUS, "studio": STUDIO_BUS}[m.name]
    return m.with_section("system_profiler", set_link_speed(m.sections["system_profiler"].text, bus, "40 Gb/s"))


def tb4_pair() -> tuple[M, M]:
    """The nodev MacBook (rdma enabled, no device) cabled at 40 Gb/s to the TB5 MacBook instead of its Air:
    each end's connected receptacle names the other's bus, at 40 Gb/s."""
    nodev = member("m4", NODEV, "192.168.20.1")
    nodev = nodev.with_section("system_profiler", set_link_speed(nodev.sections["system_profiler"].text, NODEV_BUS,
                                                                 "40 Gb/s", peer=MBP_BUS))
    mbp = MBP_M.with_section("system_profiler", set_link_speed(MBP_M.sections["system_profiler"].text, MBP_BUS,
                                                               "40 Gb/s", peer=NODEV_BUS))
    return mbp, nodev


def trio() -> list[M]:
    """Three identical Mac Studios (no cables between them), on Ethernet 192.168.2.50-52: for fleet-wide
    comparisons (majority) that do not need Thunderbolt."""
    return mesh(3, [])


def mesh(count: int, cables: Sequence[tuple[int, int, int, int]]) -> list[M]:
    return [M(f"s{i}", secs, f"192.168.2.{50 + i}") for i, secs in enumerate(studio_mesh(count, cables))]


RING4 = [(0, 1, 1, 2), (1, 1, 2, 2), (2, 1, 3, 2), (3, 1, 0, 2)]  # s0-s1-s2-s3-s0, receptacle 1 -> next's 2
MESH3 = [(0, 1, 1, 2), (1, 1, 2, 2), (2, 1, 0, 2)]


# =================================================================================================== all pass


def test_tb5_pair_passes_every_check_under_jaccl() -> None:
    report = run_case(PAIR, playbook(), [
        ("mbp", "ssh", P, ("mbp.local reachable", "host key verified", "1.2 ms"), ()),
        ("mbp", "os", P, ("macOS 26.5 (25F71) on arm64",), ()),
        ("mbp", "rdma", P, ("rdma_en1 -> studio",), ()),
        ("studio", "rdma", P, ("rdma_en3 -> mbp",), ()),
        ("mbp", "thunderbolt", P, ("Thunderbolt 5", "1 peer"), ()),
        ("studio", "thunderbolt", P, ("Thunderbolt 5", "1 peer"), ()),
        ("mbp", "software", P, ("python 3.12.8", "mlx 0.32.1", "mlx-lm 0.31.0"), ()),
        ("studio", "model", P, ("5 files", "identical on 2/2 nodes"), ()),
        ("studio", "env", P, ("TOKENIZERS_PARALLELISM=false",), ()),
        ("mbp", "resources", P, ("lora", "96.0 GiB usable", "free disk"), ()),
        ("studio", "resources", P, ("384.0 GiB usable",), ()),
    ])
    assert all(c.status is P for _, checks in report.nodes for c in checks)
    assert report.ok() and report.ok(strict=True)
    assert report.counts() == {"pass": 16, "warn": 0, "fail": 0, "error": 0, "skip": 0}


# =================================================================================================== backends

BACKEND_PAIR_CASES = [
    # backend, (mbp rdma, studio rdma), thunderbolt status, thunderbolt summary
    ("ring", (S, S), P, "data plane reaches all 1 peer"),
    ("nccl", (S, S), P, "data plane reaches all 1 peer"),
    ("jaccl", (P, P), P, "Thunderbolt 5 links"),
    ("jaccl-ring", (P, P), P, "Thunderbolt 5 links"),
    ("auto", (P, P), P, "data plane reaches all 1 peer"),
]


@pytest.mark.parametrize(("backend", "rdma", "tb", "tb_summary"), BACKEND_PAIR_CASES, ids=[c[0] for c in BACKEND_PAIR_CASES])
def test_tb5_pair_rdma_and_thunderbolt_by_backend(backend: str, rdma: tuple[Status, Status], tb: Status,
                                                  tb_summary: str) -> None:
    rdma_summary = "does not use RDMA" if rdma[0] is S else "RDMA enabled"
    run_case(PAIR, playbook(backend=backend), [
        ("mbp", "rdma", rdma[0], (rdma_summary,), ()),
        ("studio", "rdma", rdma[1], (rdma_summary,), ()),
        ("mbp", "thunderbolt", tb, (tb_summary,), ()),
        ("studio", "thunderbolt", tb, (tb_summary,), ()),
    ])


TB4_REMEDY = ("Thunderbolt 5", "TB5 cable", "reboot", "Recovery OS")

TB4_PAIR_CASES = [
    # backend, m4 rdma, thunderbolt expectations for both ends
    ("ring", (S, ("does not use RDMA",), ()),
     (W, ("40 Gb/s Thunderbolt link (en1)", "Thunderbolt 4"), ("Thunderbolt 5",))),
    ("jaccl", (F, ("enabled but `ibv_devices` lists no rdma_* device",), TB4_REMEDY),
     (F, ("negotiated 40 Gb/s",), ("Thunderbolt 5 cable",))),
    ("jaccl-ring", (F, ("enabled but `ibv_devices` lists no rdma_* device",), TB4_REMEDY),
     (F, ("negotiated 40 Gb/s",), ("Thunderbolt 5 cable",))),
    # auto falls back to ring: missing RDMA is a warning, and the link is judged as ring's data plane
    ("auto", (W, ("enabled but `ibv_devices` lists no rdma_* device",), TB4_REMEDY),
     (W, ("40 Gb/s Thunderbolt link (en1)",), ("Thunderbolt 5",))),
]


@pytest.mark.parametrize(("backend", "rdma", "tb"), TB4_PAIR_CASES, ids=[c[0] for c in TB4_PAIR_CASES])
def test_tb4_link_and_rdma_without_devices_by_backend(backend: str, rdma: tuple[Status, tuple[str, ...], tuple[str, ...]],
                                                      tb: tuple[Status, tuple[str, ...], tuple[str, ...]]) -> None:
    mbp, m4 = tb4_pair()
    tb_status, tb_summary, tb_remedy = tb
    peer_named = tb_status is F
    run_case((mbp, m4), playbook(backend=backend), [
        ("m4", "rdma", *rdma),
        ("m4", "thunderbolt", tb_status, (*tb_summary, *(("link to mbp",) if peer_named else ())), tb_remedy),
        ("mbp", "thunderbolt", tb_status, (*tb_summary, *(("link to m4",) if peer_named else ())), tb_remedy),
    ])


# =================================================================================================== rdma


RDMA_CASES = [
    pytest.param(MBP_M, STUDIO_M.with_section("rdma_ctl", "disabled\n"),
                 ("studio", F, ("RDMA is disabled",), ("Recovery", "rdma_ctl enable")), id="rdma_ctl-disabled"),
    pytest.param(MBP_M, STUDIO_M.with_section("rdma_ctl", "pending\n"),
                 ("studio", F, ("RDMA is unknown",), ("Recovery",)), id="rdma_ctl-unknown-word"),
    pytest.param(MBP_M, STUDIO_M.with_section("rdma_ctl", Section("rdma_ctl", "sh: rdma_ctl: command not found\n", 127)),
                 ("studio", F, ("rdma_ctl not found",), ("macOS 26.2",)), id="rdma_ctl-not-found"),
    pytest.param(MBP_M, STUDIO_M.with_section("ibv_devices", HEADER_ONLY_IBV),
                 ("studio", F, ("enabled but `ibv_devices` lists no rdma_* device",), TB4_REMEDY),
                 id="enabled-but-no-devices"),
    pytest.param(MBP_M.with_section("ibv_devinfo", ibv_devinfo_state(MBP_M.sections["ibv_devinfo"].text, "rdma_en1",
                                                                     "PORT_DOWN (1)")), STUDIO_M,
                 ("mbp", F, ("rdma_en1 (to studio) is PORT_DOWN",), ("BOTH Macs", "reseat")), id="peer-port-down"),
    pytest.param(MBP_M.edited("ibv_devices", "    rdma_en1        \t0000000000000001\n", ""), STUDIO_M,
                 ("mbp", F, ("no rdma_en1 for the link to studio",), ("TB5 cable",)), id="no-device-for-link"),
    pytest.param(MBP_M.edited("networksetup", "Hardware Port: Thunderbolt 1\nDevice: en1\n",
                              "Hardware Port: USB LAN\nDevice: en1\n"), STUDIO_M,
                 ("mbp", F, ("link to studio (receptacle 1) has no enX in networksetup",), ("Recovery",)),
                 id="receptacle-not-in-networksetup"),
]


@pytest.mark.parametrize(("mbp", "studio", "expect"), RDMA_CASES)
@pytest.mark.parametrize("backend", ["jaccl", "jaccl-ring", "auto"])
def test_rdma_failures(backend: str, mbp: M, studio: M,
                       expect: tuple[str, Status, tuple[str, ...], tuple[str, ...]]) -> None:
    node, status, in_summary, in_remedy = expect
    status = W if backend == "auto" and status is F else status  # auto falls back to ring
    run_case((mbp, studio), playbook(backend=backend), [(node, "rdma", status, in_summary, in_remedy)])


def test_rdma_is_not_evaluated_for_ring_even_when_broken() -> None:
    run_case((MBP_M, STUDIO_M.with_section("rdma_ctl", "disabled\n")), playbook(backend="ring"), [
        ("studio", "rdma", S, ("backend ring does not use RDMA",), ()),
    ])


def test_rdma_ctl_error_exit_is_an_error_with_the_raw_text() -> None:
    studio = STUDIO_M.with_section("rdma_ctl", Section("rdma_ctl", "rdma_ctl: operation not permitted\n", 1))
    _, results = preflight((MBP_M, studio), playbook())
    r = results[("studio", "rdma")]
    assert r.status is E and "exited with status 1" in r.summary
    assert r.evidence["errors"][0]["source"] == "rdma_ctl"
    assert "operation not permitted" in r.evidence["errors"][0]["raw"]


def test_linux_rdma_needs_infiniband_devices() -> None:
    linux = M("gpu1", linux_sections(), "192.0.2.2")
    with_ib = linux.with_section("infiniband", "mlx5_0\n")
    _, results = preflight((MBP_M, linux), playbook(backend="jaccl"))
    assert results[("gpu1", "rdma")].status is F and "/sys/class/infiniband" in results[("gpu1", "rdma")].summary
    _, results = preflight((MBP_M, with_ib), playbook(backend="jaccl"))
    assert results[("gpu1", "rdma")].status is P and "mlx5_0" in results[("gpu1", "rdma")].summary


# =================================================================================================== thunderbolt


TB_CASES = [
    pytest.param((at_40(MBP_M), at_40(STUDIO_M)), "jaccl", [
        ("mbp", "thunderbolt", F, ("link to studio negotiated 40 Gb/s", "Thunderbolt 4"), ("Thunderbolt 5 cable",)),
        ("studio", "thunderbolt", F, ("link to mbp negotiated 40 Gb/s",), ("Thunderbolt 5 cable",)),
    ], id="jaccl-40gbps-fails"),
    pytest.param((at_40(MBP_M), at_40(STUDIO_M)), "ring", [
        ("mbp", "thunderbolt", W, ("40 Gb/s Thunderbolt link (en1)",), ("Thunderbolt 5",)),
        ("studio", "thunderbolt", W, ("40 Gb/s Thunderbolt link (en3)",), ("Thunderbolt 5",)),
    ], id="ring-40gbps-warns"),
    pytest.param((MBP_M.edited("ifconfig", MBP_EN1_IP, ""), STUDIO_M), "jaccl", [
        ("mbp", "thunderbolt", F, ("en1 (to studio) has no IPv4",), ("ifconfig en1 inet",)),
        ("studio", "thunderbolt", P, (), ()),
    ], id="jaccl-no-ipv4-behind-rdma-device"),
    pytest.param((MBP_M, STUDIO_M.with_section("ifconfig", edit_block(edit(
        STUDIO_M.sections["ifconfig"].text, BRIDGE_DOWN, BRIDGE_UP), "bridge0", "status: inactive", "status: active"))),
        "jaccl", [
        ("studio", "thunderbolt", F, ("Thunderbolt Bridge (bridge0) is active over en3",), ("Thunderbolt Bridge",)),
        ("mbp", "thunderbolt", P, (), ()),
    ], id="jaccl-thunderbolt-bridge-active"),
    pytest.param((MBP_M.but(down={"studio": "timed out after 2.0 s"}), STUDIO_M), "jaccl", [
        ("mbp", "thunderbolt", F, ("cannot reach studio (192.168.10.2): timed out",), ("`ips:`",)),
        ("studio", "thunderbolt", P, (), ()),
    ], id="jaccl-unreachable-data-ip"),
    pytest.param((MBP_M.but(down={"studio": "connection refused"}), STUDIO_M), "ring", [
        ("mbp", "thunderbolt", F, ("cannot reach studio (192.168.10.2): connection refused",), ("`ips:`",)),
    ], id="ring-unreachable-data-ip"),
    pytest.param((MBP_M.but(ip="192.168.2.46"), STUDIO_M), "ring", [
        ("mbp", "thunderbolt", W, ("192.168.2.46 is on Wi-Fi (en0)",), ("Thunderbolt or Ethernet",)),
        ("studio", "thunderbolt", P, (), ()),
    ], id="ring-wifi-data-plane-warns"),
    pytest.param((MBP_M.but(ip="192.168.2.46"), STUDIO_M), "auto", [
        ("mbp", "thunderbolt", W, ("on Wi-Fi (en0)",), ()),
    ], id="auto-wifi-data-plane-warns"),
]


@pytest.mark.parametrize(("members", "backend", "expects"), TB_CASES)
def test_thunderbolt(members: tuple[M, M], backend: str, expects: list[Expect]) -> None:
    run_case(members, playbook(backend=backend), expects)


def test_linux_thunderbolt_is_reachability_only() -> None:
    linux = M("gpu1", linux_sections(), "192.0.2.2")
    run_case((linux, MBP_M.but(ip="192.168.2.46")), playbook(backend="ring"), [
        ("gpu1", "thunderbolt", P, ("data plane reaches all 1 peer",), ()),
        ("gpu1", "os", P, ("Debian GNU/Linux 12 (bookworm)", "6.18.44-fc-v657", "x86_64"), ()),
    ])
    run_case((linux.but(down={"mbp": "no route to host"}), MBP_M), playbook(backend="ring"), [
        ("gpu1", "thunderbolt", F, ("cannot reach mbp (192.168.10.1): no route to host",), ("`ips:`",)),
    ])
    # under jaccl the Linux node is still judged on reachability alone; the Mac has no Thunderbolt link to it
    run_case((linux, MBP_M), playbook(backend="jaccl"), [
        ("gpu1", "thunderbolt", P, ("data plane reaches all 1 peer",), ()),
        ("mbp", "thunderbolt", F, ("no Thunderbolt link to gpu1",), ()),
    ])


def test_mesh_of_three_studios_passes_jaccl() -> None:
    run_case(mesh(3, MESH3), playbook(backend="jaccl"), [
        (f"s{i}", check, P, (), ()) for i in range(3) for check in ("rdma", "thunderbolt")
    ] + [("s0", "rdma", P, ("rdma_en2 -> s1", "rdma_en3 -> s2"), ())])


def test_mesh_missing_cable_fails_both_ends_under_jaccl() -> None:
    run_case(mesh(3, MESH3[:2]), playbook(backend="jaccl"), [
        ("s0", "thunderbolt", F, ("no Thunderbolt link to s2",), ("connect s0 and s2 with a Thunderbolt 5 cable",)),
        ("s2", "thunderbolt", F, ("no Thunderbolt link to s0",), ("Thunderbolt 5 cable",)),
        ("s1", "thunderbolt", P, (), ()),
    ])


def test_ring_of_four_is_enough_for_jaccl_ring_but_not_for_jaccl() -> None:
    members = mesh(4, RING4)
    run_case(members, playbook(backend="jaccl-ring"), [
        (f"s{i}", check, P, (), ()) for i in range(4) for check in ("rdma", "thunderbolt")
    ])
    # a jaccl mesh needs the diagonals s0-s2 and s1-s3 too
    run_case(members, playbook(backend="jaccl"), [
        ("s0", "thunderbolt", F, ("no Thunderbolt link to s2",), ()),
        ("s1", "thunderbolt", F, ("no Thunderbolt link to s3",), ()),
        ("s2", "thunderbolt", F, ("no Thunderbolt link to s0",), ()),
        ("s3", "thunderbolt", F, ("no Thunderbolt link to s1",), ()),
    ])


def test_jaccl_ring_needs_every_ring_neighbour() -> None:
    run_case(mesh(4, [c for c in RING4 if c != (2, 1, 3, 2)]), playbook(backend="jaccl-ring"), [
        ("s2", "thunderbolt", F, ("no Thunderbolt link to s3",), ()),
        ("s3", "thunderbolt", F, ("no Thunderbolt link to s2",), ()),
        ("s0", "thunderbolt", P, (), ()),
        ("s1", "thunderbolt", P, (), ()),
    ])


@pytest.mark.parametrize("peer_unknown", ["garbage-system_profiler", "peer-unreachable"])
def test_unknown_peer_topology_is_not_a_missing_cable(peer_unknown: str) -> None:
    # The mbp's own port lists the studio's bus as its peer; only the studio's facts are missing.
    if peer_unknown == "garbage-system_profiler":
        members = (MBP_M, STUDIO_M.with_section("system_profiler", "garbage\n"))
        kw: dict[str, Any] = {}
    else:
        members = PAIR
        kw = {"connect": {"studio": TransportError("studio", "timed out", kind="timeout")}}
    _, results = preflight(members, playbook(), **kw)
    r = results[("mbp", "thunderbolt")]
    assert "no Thunderbolt link to studio" not in r.summary, r.summary


# =================================================================================================== ssh


SSH_FAILURES = [
    (HostKeyError("studio", "host key changed"), ("host key changed",), ("ssh-keygen -R studio.local",)),
    (TransportError("studio", "permission denied (publickey)", kind="auth"), ("permission denied",),
     ("ssh-copy-id",)),
    (TransportError("studio", "connect timed out after 10 s", kind="timeout"), ("timed out",), ("pmset -g",)),
    (TransportError("studio", "connection refused", kind="connect"), ("connection refused",), ("Remote Login",)),
    (TransportError("studio", "weird failure"), ("weird failure",), ("Remote Login",)),
]


@pytest.mark.parametrize(("error", "in_summary", "in_remedy"), SSH_FAILURES, ids=[e[0].kind for e in SSH_FAILURES])
def test_unreachable_node_fails_ssh_and_skips_the_rest(error: TransportError, in_summary: tuple[str, ...],
                                                       in_remedy: tuple[str, ...]) -> None:
    report = run_case(PAIR, playbook(), [
        ("studio", "ssh", F, ("studio:", *in_summary), in_remedy),
        *[("studio", check, S, ("node unreachable",), ()) for check in CHECK_IDS[1:]],
        ("mbp", "ssh", P, (), ()),
        ("mbp", "software", P, (), ()),
    ], connect={"studio": error})
    assert not report.ok()
    assert report.to_json()["nodes"][1]["checks"][0]["evidence"]["kind"] == error.kind


def test_probe_failure_is_an_error_with_evidence_on_every_fact_check() -> None:
    err = TransportError("studio", "probe timed out after 600 s", kind="timeout")
    _, results = preflight(PAIR, playbook(), probe_errors={"studio": err})
    assert results[("studio", "ssh")].status is P
    for check in CHECK_IDS[1:]:
        r = results[("studio", check)]
        assert r.status is E, r
        assert "probe timed out after 600 s" in r.summary
        assert r.evidence == {"probe_error": "studio: probe timed out after 600 s"}
        assert "coordinator facts --limit studio" in r.remedy


def test_local_node_passes_ssh_without_a_host_key() -> None:
    mbp = MBP_M.but(node={"connection": Connection.LOCAL})
    run_case((mbp, STUDIO_M), playbook(), [("mbp", "ssh", P, ("local node",), ())],
             connect={"mbp": ConnectInfo("mbp", 0.0, 0.1, None)})


def test_node_without_a_connection_attempt_has_a_remedy() -> None:
    ctx = build_ctx(PAIR, playbook())
    ctx = dataclasses.replace(ctx, connect={"mbp": ctx.connect["mbp"]})  # nothing recorded for the studio
    assert_contract(evaluate_preflight(ctx))


# =================================================================================================== os


def _sw_vers(version: str, build: str = "25F71") -> str:
    return f"ProductName:\t\tmacOS\nProductVersion:\t\t{version}\nBuildVersion:\t\t{build}\n"


OS_CASES = [
    pytest.param(MBP_M.edited("uname", "arm64", "x86_64"), "ring",
                 (F, ("macOS on x86_64",), ("Apple silicon",)), id="intel-mac"),
    pytest.param(MBP_M.with_section("sw_vers", _sw_vers("13.6.7")), "ring",
                 (F, ("macOS 13.6.7 is older than 14.0",), ("Software Update",)), id="macos-13-ring"),
    pytest.param(MBP_M.with_section("sw_vers", _sw_vers("14.0")), "ring", (P, ("macOS 14.0",), ()), id="macos-14.0-ring"),
    pytest.param(MBP_M.with_section("sw_vers", _sw_vers("26.1")), "jaccl",
                 (F, ("macOS 26.1", "needs macOS 26.2+"), ("26.2 or later", "backend: ring")), id="macos-26.1-jaccl"),
    pytest.param(MBP_M.with_section("sw_vers", _sw_vers("26.1")), "jaccl-ring",
                 (F, ("(jaccl-ring) needs macOS 26.2+",), ()), id="macos-26.1-jaccl-ring"),
    pytest.param(MBP_M.with_section("sw_vers", _sw_vers("26.2")), "jaccl", (P, ("macOS 26.2",), ()), id="macos-26.2-jaccl"),
    pytest.param(MBP_M.with_section("sw_vers", _sw_vers("26.1")), "auto",
                 (W, ("no RDMA before 26.2; auto uses ring",), ("26.2",)), id="macos-26.1-auto"),
    pytest.param(MBP_M.with_section("sw_vers", _sw_vers("26.1")), "ring", (P, ("macOS 26.1",), ()), id="macos-26.1-ring"),
    pytest.param(MBP_M.with_section("sw_vers", _sw_vers("26.5", "25F80")), "ring",
                 (W, ("nodes run different builds: mbp=25F80, studio=25F71",), ("same macOS build",)),
                 id="builds-differ"),
    pytest.param(MBP_M.with_section("sw_vers", "garbage\n"), "ring",
                 (E, ("could not read the OS", "sw_vers"), ("coordinator facts --record",)), id="sw_vers-garbage"),
]


@pytest.mark.parametrize(("mbp", "backend", "expect"), OS_CASES)
def test_os(mbp: M, backend: str, expect: tuple[Status, tuple[str, ...], tuple[str, ...]]) -> None:
    status, in_summary, in_remedy = expect
    run_case((mbp, STUDIO_M), playbook(backend=backend), [("mbp", "os", status, in_summary, in_remedy)])


def test_os_builds_differ_warns_on_every_node() -> None:
    old = member("m1", OLD, "192.168.2.46")
    run_case((MBP_M, old), playbook(backend="ring"), [
        ("mbp", "os", W, ("m1=23G93, mbp=25F71",), ()),
        ("m1", "os", W, ("macOS 14.6.1 (23G93)", "m1=23G93, mbp=25F71"), ()),
    ])


def test_old_macos_fails_jaccl_in_os_and_rdma() -> None:
    old = member("m1", OLD, "192.168.2.46")
    run_case((MBP_M, old), playbook(backend="jaccl"), [
        ("m1", "os", F, ("macOS 14.6.1", "26.2+"), ()),
        ("m1", "rdma", F, ("rdma_ctl not found",), ("macOS 26.2+",)),
    ])


def test_os_error_keeps_the_raw_output_as_evidence() -> None:
    _, results = preflight((MBP_M.with_section("sw_vers", "garbage\n"), STUDIO_M), playbook())
    (err,) = results[("mbp", "os")].evidence["errors"]
    assert err["source"] == "sw_vers" and err["raw"] == "garbage\n"


# =================================================================================================== software


SOFTWARE_CASES = [
    pytest.param(MBP_M.but(worker_text="python interpreter not found: /opt/nope/python", worker_rc=127),
                 (F, ("python not found at /opt/nope/python",), ("`python:`", "pip install")), id="python-missing"),
    pytest.param(MBP_M.but(worker_text="  File \"<stdin>\", line 1\nSyntaxError: invalid syntax\n", worker_rc=1),
                 (E, ("could not read python at", "did not answer JSON"), ("`python:` for mbp",)), id="worker-not-json"),
    pytest.param(MBP_M.but(worker={"mlx": None}), (F, ("mlx not installed for " + PYTHON,), ("pip install",)),
                 id="mlx-missing"),
    pytest.param(MBP_M.but(worker={"mlx_lm": None}), (F, ("mlx-lm not installed",), ("mlx-lm",)), id="mlx-lm-missing"),
    pytest.param(MBP_M.but(worker={"mlx": None, "mlx_lm": None}), (F, ("mlx and mlx-lm not installed",), ()),
                 id="both-missing"),
    pytest.param(MBP_M.but(worker={"mlx": "0.32.0"}), (F, ("mlx 0.32.0 < 0.32.1",), ('"mlx>=0.32.1"',)), id="mlx-0.32.0"),
    pytest.param(MBP_M.but(worker={"mlx": "0.29.3"}), (F, ("mlx 0.29.3 < 0.32.1",), ()), id="mlx-0.29"),
    pytest.param(MBP_M.but(worker={"version": "3.11.9"}),
                 (W, ("python minor versions differ: mbp=3.11, studio=3.12",), ("same python minor",)),
                 id="python-minor-differs"),
    pytest.param(MBP_M.but(worker={"version": "3.12.1"}), (P, ("python 3.12.1",), ()), id="python-patch-differs"),
    pytest.param(MBP_M.but(worker={"mlx_lm": "0.30.0"}),
                 (F, ("mlx 0.32.1 / mlx-lm 0.30.0 differ from the fleet (studio: mlx 0.32.1 / mlx-lm 0.31.0)",),
                  ("the same mlx and mlx-lm versions on every node",)), id="two-nodes-disagree"),
]


@pytest.mark.parametrize(("mbp", "expect"), SOFTWARE_CASES)
def test_software(mbp: M, expect: tuple[Status, tuple[str, ...], tuple[str, ...]]) -> None:
    status, in_summary, in_remedy = expect
    run_case((mbp, STUDIO_M), playbook(), [("mbp", "software", status, in_summary, in_remedy)])


def test_software_two_nodes_disagreeing_both_fail() -> None:
    run_case((MBP_M.but(worker={"mlx": "0.33.0"}), STUDIO_M), playbook(), [
        ("mbp", "software", F, ("mlx 0.33.0", "studio: mlx 0.32.1"), ()),
        ("studio", "software", F, ("mlx 0.32.1", "mbp: mlx 0.33.0"), ()),
    ])


@pytest.mark.parametrize("odd", ["s0", "s1", "s2"])
@pytest.mark.parametrize(("key", "value"), [("mlx", "0.33.0"), ("mlx_lm", "0.29.0")])
def test_software_version_drift_fails_the_odd_node_by_majority(odd: str, key: str, value: str) -> None:
    members = [m.but(worker={key: value}) if m.name == odd else m for m in trio()]
    run_case(members, playbook(backend="ring"), [
        (odd, "software", F, ("differ from the fleet",), (f"{PYTHON} -m pip install mlx==0.32.1 mlx-lm==0.31.0",)),
        *[(m.name, "software", P, (), ()) for m in members if m.name != odd],
    ])


# A Linux node with one H100 (the constructed nvidia-smi capture) next to the Mac, under ring.
GPU_M = M("gpu1", linux_sections(), "192.0.2.2").with_section(
    "nvidia_smi", capture("nvidia_smi/h100-x1-driver-580.txt"))
CPU_M = M("cpu1", linux_sections(), "192.0.2.2")
A100_M = GPU_M.with_section("nvidia_smi", capture("nvidia_smi/constructed-a100-x2.txt"))  # driver 535
SMI_DOWN = Section("nvidia_smi", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                   "Make sure that the latest NVIDIA driver is installed and running.\n", 9)
PIP = f"{PYTHON} -m pip install"

BACKEND_CASES = [
    pytest.param(GPU_M.but(worker={"backends": {"mlx-cpu": "0.32.1"}}),
                 (F, ("NVIDIA H100 80GB HBM3 but mlx has no CUDA backend", "training would run on the CPU"),
                  (f'{PIP} "mlx[cuda13]==0.32.1"',)), id="gpu-without-mlx-cuda"),
    pytest.param(GPU_M.but(worker={"backends": {"mlx-cuda-13": "0.32.0"}}),
                 (F, ("mlx-cuda-13 0.32.0 differs from mlx 0.32.1",), (f'{PIP} "mlx[cuda13]==0.32.1"',)),
                 id="gpu-backend-version-mismatch"),
    pytest.param(A100_M.but(worker={"backends": {"mlx-cuda-13": "0.32.1"}}),
                 (F, ("mlx-cuda-13 needs NVIDIA driver 580+, the node has 535",),
                  ("pip uninstall -y mlx-cuda-13", f'{PIP} "mlx[cuda12]==0.32.1"')), id="cuda13-on-old-driver"),
    pytest.param(A100_M.but(worker={"backends": {"mlx-cuda-12": "0.32.1", "mlx-cuda-13": "0.32.1"}}),
                 (W, ("both mlx-cuda-12 and mlx-cuda-13 installed",), ("pip uninstall -y mlx-cuda-13",)),
                 id="both-cuda-backends"),
    pytest.param(GPU_M.but(worker={"backends": {"mlx-cuda-13": "0.32.1"}}),
                 (P, ("mlx 0.32.1 on mlx-cuda-13",), ()), id="gpu-ok"),
    pytest.param(CPU_M.but(worker={"backends": {}}),
                 (F, ("no mlx backend installed", "libmlx.so missing"), (f'{PIP} "mlx[cpu]==0.32.1"',)),
                 id="cpu-no-backend"),
    pytest.param(CPU_M.but(worker={"backends": {"mlx-cpu": "0.31.0"}}),
                 (F, ("mlx-cpu 0.31.0 differs from mlx 0.32.1",), (f'{PIP} "mlx[cpu]==0.32.1"',)),
                 id="cpu-backend-version-mismatch"),
    pytest.param(CPU_M.but(worker={"backends": {"mlx-cpu": "0.32.1"}}), (P, ("mlx 0.32.1 (mlx-cpu)",), ()),
                 id="cpu-ok"),
    pytest.param(CPU_M.but(worker={"backends": {"mlx-cuda-13": "0.32.1"}}),
                 (W, ("only mlx's CUDA backend is installed but no NVIDIA GPU",), (f'{PIP} "mlx[cpu]==0.32.1"',)),
                 id="cuda-backend-without-gpu"),
    pytest.param(CPU_M.with_section("nvidia_smi", SMI_DOWN).but(worker={"backends": {"mlx-cpu": "0.32.1"}}),
                 (W, ("nvidia-smi is installed but failed (nvidia-smi exited with status 9)",),
                  ("fix the NVIDIA driver",)), id="nvidia-smi-failing"),
    pytest.param(GPU_M, (P, ("mlx 0.32.1, mlx-lm",), ()), id="backends-not-reported"),
]


@pytest.mark.parametrize(("node", "expect"), BACKEND_CASES)
def test_software_mlx_backend_on_linux(node: M, expect: tuple[Status, tuple[str, ...], tuple[str, ...]]) -> None:
    status, in_summary, in_remedy = expect
    run_case((node, MBP_M.but(ip="192.168.2.46")), playbook(backend="ring"),
             [(node.name, "software", status, in_summary, in_remedy)])


def test_nccl_needs_an_nvidia_gpu_on_every_node() -> None:
    gpu = GPU_M.but(worker={"backends": {"mlx-cuda-13": "0.32.1"}})
    run_case((gpu, MBP_M.but(ip="192.168.2.46")), playbook(backend="nccl"), [
        ("gpu1", "software", P, ("on mlx-cuda-13",), ()),
        ("mbp", "software", F, ("backend nccl needs an NVIDIA GPU", "no nvidia-smi"), ("use `backend: ring`",)),
    ])
    smi_down = CPU_M.with_section("nvidia_smi", SMI_DOWN)
    run_case((gpu, smi_down), playbook(backend="nccl"), [
        ("cpu1", "software", F, ("nvidia-smi failed: NVIDIA-SMI has failed",), ()),
    ])


# =================================================================================================== env


ENV_CASES = [
    pytest.param(MBP_M.but(env=ENV_TEXT + "MLX_RANK=0\n"), playbook(),
                 (F, ("MLX_RANK=0 preset in the ssh env",), ("remove MLX_RANK", "~/.zshenv")), id="rank-in-ssh-env"),
    pytest.param(MBP_M.but(env=ENV_TEXT + "MLX_HOSTFILE=/tmp/h.json\n"), playbook(),
                 (F, ("MLX_HOSTFILE=/tmp/h.json preset in the ssh env",), ("remove MLX_HOSTFILE",)),
                 id="hostfile-in-ssh-env"),
    pytest.param(MBP_M, playbook(env={"MLX_WORLD_SIZE": "2"}),
                 (F, ("MLX_WORLD_SIZE=2 preset in the job env",), ("remove MLX_WORLD_SIZE",)), id="world-size-in-playbook"),
    pytest.param(MBP_M.but(node={"env": (("MLX_RANK", "1"),)}), playbook(),
                 (F, ("MLX_RANK=1 preset in the job env",), ("inventory",)), id="rank-in-inventory-env"),
    pytest.param(MBP_M.but(env=ENV_TEXT + "MLX_METAL_FAST_SYNCH=1\n"), playbook(),
                 (W, ("MLX_METAL_FAST_SYNCH=1 in the ssh env",), ("unset MLX_METAL_FAST_SYNCH",)),
                 id="fast-synch-ssh-env"),
    pytest.param(MBP_M, playbook(env={"MLX_METAL_FAST_SYNCH": "1"}),
                 (W, ("MLX_METAL_FAST_SYNCH=1 in the job env",), ()), id="fast-synch-playbook"),
    pytest.param(MBP_M.but(env=ENV_TEXT + "MLX_METAL_FAST_SYNCH=0\n"), playbook(), (P, (), ()), id="fast-synch-0"),
    pytest.param(MBP_M.but(env=ENV_TEXT + "MLX_RING_VERBSE=1\n"), playbook(),
                 (W, ("unknown MLX_RING_VERBSE in the ssh env",), ("unknown MLX_*",)), id="unknown-mlx-name"),
    pytest.param(MBP_M, playbook(env={"MLX_RING_VERBOSE": "1", "MLX_IBV_DEVICES": "/tmp/d.json"}), (P, (), ()),
                 id="known-mlx-names"),
    pytest.param(MBP_M, playbook(env={"TOKENIZERS_PARALLELISM": "true"}),
                 (F, ("TOKENIZERS_PARALLELISM=true in the job env",), ("TOKENIZERS_PARALLELISM",)),
                 id="tokenizers-true-in-playbook"),
    pytest.param(MBP_M, playbook(env={"TOKENIZERS_PARALLELISM": "False"}), (P, (), ()), id="tokenizers-False"),
    # the job env sets it to false for every rank, whatever the login shell exports
    pytest.param(MBP_M.but(env=ENV_TEXT + "TOKENIZERS_PARALLELISM=true\n"), playbook(), (P, (), ()),
                 id="tokenizers-true-in-ssh-env-is-overridden"),
    pytest.param(MBP_M.but(env=ENV_TEXT + "MLX_RANK=0\nMLX_METAL_FAST_SYNCH=1\n"), playbook(),
                 (F, ("MLX_RANK=0 preset", "MLX_METAL_FAST_SYNCH=1"), ("remove MLX_RANK", "unset MLX_METAL_FAST_SYNCH")),
                 id="fail-and-warn-together"),
    pytest.param(MBP_M.but(env=None), playbook(), (E, ("could not read the SSH environment",), ()), id="env-missing"),
]


@pytest.mark.parametrize(("mbp", "pb", "expect"), ENV_CASES)
def test_env(mbp: M, pb: Playbook, expect: tuple[Status, tuple[str, ...], tuple[str, ...]]) -> None:
    status, in_summary, in_remedy = expect
    studio = status if pb.env else P  # the playbook's env reaches every node; the rest was mbp's alone
    run_case((mbp, STUDIO_M), pb, [("mbp", "env", status, in_summary, in_remedy), ("studio", "env", studio, (), ())])


# =================================================================================================== model

BAD = sha("corrupted")


def _hashes(**kw: Any) -> dict[str, Any]:
    return {"hashes": hashes_answer(**kw)}


def test_model_three_nodes_majority_names_the_odd_file() -> None:
    members = trio()
    members[1] = members[1].but(worker=_hashes(model={**MODEL_FILES, "model.safetensors": BAD}))
    run_case(members, playbook(backend="ring"), [
        ("s1", "model", F, ("differs from the majority (s0, s2)", "differ: model/model.safetensors"),
         # rsync copies between two remote hosts only when run on one of them: on the good node, over ssh
         (f"ssh s0.local rsync -a --delete {MODEL_DIR}/ s1.local:{MODEL_DIR}/",)),
        ("s0", "model", P, ("identical on 2/3 nodes",), ()),
        ("s2", "model", P, ("identical on 2/3 nodes",), ()),
    ])
    _, results = preflight(members, playbook(backend="ring"))
    r = results[("s1", "model")]
    assert r.evidence["diff"] == {"differ": ["model/model.safetensors"], "missing": [], "extra": []}
    assert DATA_DIR not in r.remedy  # only the dir holding the bad file is copied


@pytest.mark.parametrize(("change", "in_summary", "in_remedy"), [
    ({"data": {"train.jsonl": DATA_FILES["train.jsonl"]}}, "missing: data/valid.jsonl",
     f"ssh s0.local rsync -a --delete {DATA_DIR}/ s2.local:{DATA_DIR}/"),
    ({"model": {**MODEL_FILES, "extra.bin": sha("x")}}, "extra: model/extra.bin", f"{MODEL_DIR}/ s2.local:"),
    ({"data": {**DATA_FILES, "train.jsonl": BAD}}, "differ: data/train.jsonl", f"{DATA_DIR}/ s2.local:"),
])
def test_model_majority_diff_kinds(change: dict[str, Any], in_summary: str, in_remedy: str) -> None:
    members = trio()
    members[2] = members[2].but(worker=_hashes(**change))
    run_case(members, playbook(backend="ring"), [("s2", "model", F, (in_summary,), (in_remedy,))])


def test_model_two_node_tie_fails_both_and_asks_for_a_manifest() -> None:
    mbp = MBP_M.but(worker=_hashes(model={**MODEL_FILES, "model.safetensors": BAD}))
    run_case((mbp, STUDIO_M), playbook(), [
        ("mbp", "model", F, ("no majority", "vs studio: differ: model/model.safetensors"), ("manifest",)),
        ("studio", "model", F, ("no majority", "vs mbp: differ: model/model.safetensors"), ("manifest",)),
    ])


def test_model_three_way_disagreement_fails_all() -> None:
    members = [m.but(worker=_hashes(model={**MODEL_FILES, "config.json": sha(m.name)})) for m in trio()]
    run_case(members, playbook(backend="ring"), [
        (m.name, "model", F, ("no majority", "differ: model/config.json"), ("manifest",)) for m in members
    ])


@pytest.mark.parametrize(("worker", "status", "in_summary"), [
    ({"data": data_answer(train={"rows": 2, "error": "line 3: not UTF-8 (byte 0xff at column 11)"}, valid={})},
     F, f"{DATA_DIR}/train.jsonl line 3: not UTF-8 (byte 0xff at column 11)"),
    ({"data": data_answer(train={"exists": False, "rows": 0}, valid={})},
     F, f"{DATA_DIR}/train.jsonl is missing (the trainer needs it)"),
    ({"data": data_answer(train={}, valid={}, test={"error": "no rows (an empty file fails the loader)"})},
     F, f"{DATA_DIR}/test.jsonl no rows"),
    ({"model_error": "no *.safetensors weights"}, F, f"model {MODEL_DIR}: no *.safetensors weights"),
    ({"data": data_answer(train={}, valid={"exists": False})}, W, f"{DATA_DIR}/valid.jsonl is missing: the run "
                                                                  "will have no eval events"),
    ({"data": data_answer(train={"checked_bytes": 100}, valid={})}, P, "train.jsonl: the first 10 rows (0 of 0 MB) parsed"),
    ({"data": data_answer(train={}, valid={})}, P, "identical on 3/3 nodes"),
])
def test_model_check_proves_the_trainer_can_load_model_and_data(worker: dict[str, Any], status: Status,
                                                               in_summary: str) -> None:
    """The same on every node, so every node fails (launched, every rank would fail the same way)."""
    members = [m.but(worker={**_hashes(), **worker}) for m in trio()]
    remedy = ("every rank would fail",) if status is F else ()
    report, results = preflight(members, playbook(backend="ring"))
    check_expectations(results, [(m.name, "model", status, (in_summary,), remedy) for m in members])
    assert report.ok() is (status is not F)
    if "data" in worker:
        assert [f["name"] for f in results[("s0", "model")].evidence["data_files"]] == \
            [f["name"] for f in worker["data"]["files"]]


def _manifest(model: Mapping[str, str] = MODEL_FILES, data: Mapping[str, str] = DATA_FILES) -> dict[str, str]:
    return {**{f"model/{k}": v for k, v in model.items()}, **{f"data/{k}": v for k, v in data.items()}}


def test_model_manifest_is_the_reference() -> None:
    mbp = MBP_M.but(worker=_hashes(model={**MODEL_FILES, "tokenizer.json": BAD}))
    run_case((mbp, STUDIO_M), playbook(), [
        ("mbp", "model", F, ("differs from the reference manifest", "differ: model/tokenizer.json"), ("rsync",)),
        ("studio", "model", P, ("5 files", "match the reference manifest"), ()),
    ], manifest=_manifest())


def test_model_manifest_beats_the_majority() -> None:
    # two nodes agree with each other but not with the manifest: both fail, the third (right) one passes
    members = trio()
    members = [m.but(worker=_hashes(model={**MODEL_FILES, "config.json": BAD})) if m.name != "s2" else m for m in members]
    run_case(members, playbook(backend="ring"), [
        ("s0", "model", F, ("reference manifest", "model/config.json"), ()),
        ("s1", "model", F, ("reference manifest",), ()),
        ("s2", "model", P, ("match the reference manifest",), ()),
    ], manifest=_manifest())


def test_model_manifest_names_missing_and_extra_files() -> None:
    ref = _manifest(data={**DATA_FILES, "test.jsonl": sha("test")})
    mbp = MBP_M.but(worker=_hashes(model={**MODEL_FILES, "junk.txt": sha("junk")}))
    run_case((mbp, STUDIO_M), playbook(), [
        ("mbp", "model", F, ("missing: data/test.jsonl", "extra: model/junk.txt"), ()),
        ("studio", "model", F, ("missing: data/test.jsonl",), ()),
    ], manifest=ref)


MODEL_PROBLEMS = [
    pytest.param(_hashes(missing=(MODEL_DIR,)), f"model dir {MODEL_DIR} is missing", id="model-dir-missing"),
    pytest.param(_hashes(missing=(DATA_DIR,)), f"data dir {DATA_DIR} is missing", id="data-dir-missing"),
    pytest.param(_hashes(data={}), f"data dir {DATA_DIR} is empty", id="data-dir-empty"),
]


@pytest.mark.parametrize(("worker", "problem"), MODEL_PROBLEMS)
@pytest.mark.parametrize("manifest", [None, _manifest()], ids=["majority", "manifest"])
def test_model_missing_or_empty_dir_fails(worker: dict[str, Any], problem: str, manifest: dict[str, str] | None) -> None:
    pass_summary = "identical on 1/1" if manifest is None else "match the reference manifest"
    run_case((MBP_M, STUDIO_M.but(worker=worker)), playbook(), [
        ("studio", "model", F, (problem,), ("rsync -a --delete",)),
        ("mbp", "model", P, (pass_summary,), ()),
    ], manifest=manifest)


def test_model_without_hashes_is_an_error_and_without_playbook_a_skip() -> None:
    no_hashes = STUDIO_M.but(worker_text=json.dumps(worker_answer(reach=[])))
    _, results = preflight((MBP_M, no_hashes), playbook())
    assert results[("studio", "model")].status is E and "file hashes" in results[("studio", "model")].summary
    _, results = preflight(PAIR, None)
    assert results[("mbp", "model")].status is S and "no playbook" in results[("mbp", "model")].summary


def test_model_of_a_map_job_hashes_the_model_and_the_data_that_holds_its_input() -> None:
    pb = parse_playbook({"name": "embed", "kind": "map", "model": MODEL_DIR, "data": DATA_DIR, "backend": "ring"},
                        path="p.yaml")
    assert [label for label, _ in pb.hashed_dirs()] == ["model", "data"]
    run_case(PAIR, pb, [("mbp", "model", P, ("5 files",), ()), ("mbp", "resources", P, (), ())])


def test_a_dpo_reference_model_is_hashed_as_a_third_dir() -> None:
    pb = parse_playbook({"name": "p", "model": MODEL_DIR, "data": DATA_DIR,
                         "train": {"method": "dpo", "dpo": {"reference": "/srv/ref"}}}, path="p.yaml")
    assert pb.hashed_dirs() == (("model", MODEL_DIR), ("data", DATA_DIR), ("reference", "/srv/ref"))
    same = parse_playbook({"name": "p", "model": MODEL_DIR, "data": DATA_DIR, "train": {"method": "dpo"}},
                          path="p.yaml")
    assert [label for label, _ in same.hashed_dirs()] == ["model", "data"]  # the reference is the model itself


# =================================================================================================== resources

DF_AVAILABLE = "93317752"  # KiB available in the recorded df


def _df(kib: int) -> tuple[str, str, str]:
    return ("df", f" {DF_AVAILABLE} ", f" {kib} ")


RESOURCE_CASES = [
    pytest.param(MBP_M.but(worker={"params": 30_000_000_000}), {},
                 (P, ("~65.4 GiB needed (30.00B params, lora", "of 96.0 GiB usable"), ()), id="lora-30b-fits"),
    pytest.param(MBP_M.but(worker={"params": 42_000_000_000}), {},
                 (W, ("~87.7 GiB needed", "96.0 GiB usable (little headroom)"), ("grad_checkpoint",)),
                 id="lora-42b-little-headroom"),
    pytest.param(MBP_M.but(worker={"params": 50_000_000_000}), {"strategy": "dp"},
                 (F, ("~102.6 GiB needed (50.00B params", "of 96.0 GiB usable"), ("grad_checkpoint: true",)),
                 id="lora-50b-does-not-fit"),
    # auto: a pipeline over the fleet holds what this node's replica cannot: judged by its stage's need.
    pytest.param(MBP_M.but(worker={"params": 50_000_000_000}), {},
                 (P, ("of 96.0 GiB usable; as pipeline stage of blocks 0-",), ()),
                 id="lora-50b-a-pipeline-stage-by-auto"),
    pytest.param(member("m4", NODEV, "192.168.20.1", worker={"params": 8_000_000_000}),
                 {"method": "full", "strategy": "dp"},
                 (F, ("~64.9 GiB needed (8.00B params, full", "of 36.0 GiB usable", "GPU watchdog"),
                  ("use LoRA", "on an Ultra")), id="full-8b-on-48gb"),
    # keep_checkpoints 1: two 40 GB full checkpoints (the kept one + the one being written) fit the 89 GB free.
    pytest.param(MBP_M.but(worker={"params": 4_000_000_000}), {"method": "full", "keep_checkpoints": 1},
                 (W, ("full fine-tune of 4.0B params on Apple M5 Max", "GPU watchdog"), ("on an Ultra",)),
                 id="full-4b-on-max-watchdog"),
    pytest.param(MBP_M.but(worker={"params": 4_000_000_000}), {"method": "full"},
                 (F, ("checkpoints need 111.8 GiB",), ("free disk space",)), id="full-4b-three-checkpoints-no-disk"),
    pytest.param(member("m4", NODEV, "192.168.20.1"), {},
                 (W, ("system sleep after 1 min (now prevented by powerd, sharingd)", "on battery (91%)"),
                  ("pmset -a sleep 0", "AC power")), id="sleep-and-battery"),
    pytest.param(MBP_M.edited("pmset", "sleep                0 (sleep", "sleep                10 (sleep"), {},
                 (W, ("system sleep after 10 min",), ("pmset -a sleep 0",)), id="sleep-enabled"),
    pytest.param(MBP_M.edited("pmset_batt", "'AC Power'", "'Battery Power'"), {},
                 (W, ("on battery (100%)",), ("AC power",)), id="on-battery"),
    pytest.param(MBP_M.edited(*_df(100_000)), {},
                 (F, ("97.7 MiB free under /Users/me/mlx-work", "checkpoints need 314.7 MiB"),
                  ("free disk space on /System/Volumes/Data",)), id="disk-too-small-for-checkpoints"),
    # keep_checkpoints (2) + the one being written: 3 x ~0.1 GiB; under twice that is tight.
    pytest.param(MBP_M.edited(*_df(500_000)), {},
                 (W, ("only 488.3 MiB free under /Users/me/mlx-work",), ("free disk space",)), id="disk-tight"),
    pytest.param(MBP_M.but(worker={"config": {}}), {},
                 (W, ("model size unknown",), ("config.json",)), id="model-size-unknown"),
]


@pytest.mark.parametrize(("mbp", "train", "expect"), RESOURCE_CASES)
def test_resources(mbp: M, train: dict[str, Any], expect: tuple[Status, tuple[str, ...], tuple[str, ...]]) -> None:
    status, in_summary, in_remedy = expect
    run_case((mbp, STUDIO_M), playbook(train=train), [(mbp.name, "resources", status, in_summary, in_remedy)])


@pytest.mark.parametrize(("params", "watchdog"), [(3_999_999_999, False), (4_000_000_000, True)])
def test_resources_watchdog_warning_is_for_full_fine_tunes_of_4b_on_non_ultra(params: int, watchdog: bool) -> None:
    members = (MBP_M.but(worker={"params": params}), STUDIO_M.but(worker={"params": params}))
    _, results = preflight(members, playbook(train={"method": "full"}))
    assert ("GPU watchdog" in results[("mbp", "resources")].summary) is watchdog
    assert "GPU watchdog" not in results[("studio", "resources")].summary  # an Ultra
    _, results = preflight(members, playbook(train={"method": "lora"}))
    assert "GPU watchdog" not in results[("mbp", "resources")].summary


def test_resources_estimate_is_in_the_evidence() -> None:
    _, results = preflight((MBP_M.but(worker={"params": 8_000_000_000}), STUDIO_M), playbook(train={"method": "full"}))
    ev = results[("mbp", "resources")].evidence
    assert ev["params"] == 8_000_000_000
    parts = ev["breakdown"]
    # full fine-tune of bf16 weights with Adam, whose state is in the parameters' dtype (measured: mlx's Adam
    # allocates m and v like the parameter): 2 + 2 + 4 bytes per parameter, plus activations
    assert (parts["weights"], parts["grads"], parts["optimizer"]) == (16_000_000_000, 16_000_000_000, 32_000_000_000)
    assert ev["estimate"] == sum(parts.values())


def test_resources_memory_unreadable_is_an_error() -> None:
    mbp = MBP_M.with_section("sysctl", "garbage\n").with_section("memory_pressure", "garbage\n") \
        .with_section("system_profiler", "garbage\n")
    _, results = preflight((mbp, STUDIO_M), playbook())
    r = results[("mbp", "resources")]
    assert r.status is E and "memory size" in r.summary
    assert {e["source"] for e in r.evidence["errors"]} == {"sysctl", "system_profiler"}


def test_resources_free_disk_unknown_has_a_remedy() -> None:
    mbp = MBP_M.with_section("df", Section("df", "df: /Users/me: Operation not permitted\n", 1))
    preflight((mbp, STUDIO_M), playbook())


def test_resources_sleep_disabled_system_wide_does_not_warn() -> None:
    # with sleep disabled system-wide the idle-sleep timer never fires: nothing to warn about
    mbp = MBP_M.edited("pmset", "SleepDisabled\t\t0", "SleepDisabled\t\t1") \
        .edited("pmset", "sleep                0 (sleep", "sleep                10 (sleep")
    run_case((mbp, STUDIO_M), playbook(), [("mbp", "resources", P, (), ())])


def test_resources_on_an_nvidia_node_budget_the_gpus_memory_not_host_ram() -> None:
    """The H100 node has 24 GiB of host RAM and an 80 GB GPU: an 8B LoRA fits the GPU (what mlx trains in)."""
    gpu = GPU_M.but(worker={"params": 8_000_000_000, "backends": {"mlx-cuda-13": "0.32.1"}})
    mac = MBP_M.but(ip="192.168.2.46")
    run_case((gpu, mac), playbook(backend="ring"), [
        ("gpu1", "resources", P, ("of 71.7 GiB usable GPU memory (NVIDIA H100 80GB HBM3)",), ()),
    ])
    # The same node without nvidia-smi trains on the CPU, in host RAM: it does not fit.
    cpu = gpu.with_section("nvidia_smi", None)
    run_case((cpu, mac), playbook(backend="ring", train={"strategy": "dp"}),
             [("gpu1", "resources", F, ("of 21.2 GiB usable",), ())])
    busy = gpu.edited("nvidia_smi", "81559, 0, 0,", "81559, 60000, 100,")
    run_case((busy, mac), playbook(backend="ring"), [
        ("gpu1", "resources", W, ("58.6 GiB of GPU 0's 79.6 GiB already in use by other processes",), ("nvidia-smi",)),
    ])


def test_resources_on_linux() -> None:
    linux = M("gpu1", linux_sections(), "192.0.2.2")
    run_case((linux, MBP_M.but(ip="192.168.2.46")), playbook(backend="ring"), [
        ("gpu1", "resources", P, ("of 21.2 GiB usable", "79.4 GiB free disk"), ()),
    ])


# =================================================================================================== parse errors


def test_garbage_system_profiler_is_an_error_not_a_crash() -> None:
    mbp = MBP_M.with_section("system_profiler", "garbage\n")
    _, results = preflight((mbp, STUDIO_M), playbook())
    r = results[("mbp", "thunderbolt")]
    assert r.status is E and "could not read the Thunderbolt topology" in r.summary
    assert r.remedy
    (err,) = r.evidence["errors"]
    assert err["source"] == "system_profiler" and err["raw"] == "garbage\n" and "unparseable" in err["message"]
    assert err["kind"] == "node"
    # the other facts of the node still count: memory comes from sysctl
    assert results[("mbp", "resources")].status is P
    assert results[("mbp", "os")].status is P


def test_a_parser_bug_is_the_coordinators_error_not_the_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(sp: Any) -> Any:
        raise KeyError("_items")

    monkeypatch.setattr(macos, "parse_thunderbolt", broken)
    _, results = preflight((MBP_M, STUDIO_M), playbook())
    r = results[("mbp", "thunderbolt")]
    assert r.status is E and "a bug in the coordinator's system_profiler parser" in r.summary
    assert "KeyError" in r.summary and "not a fault of the node" in r.remedy
    (err,) = r.evidence["errors"]
    assert err["kind"] == "parser_bug" and err["source"] == "system_profiler"
    assert "unparseable" not in err["message"]
    assert results[("mbp", "os")].status is P


def test_missing_worker_reach_is_a_thunderbolt_error() -> None:
    answer = worker_answer(hashes=hashes_answer())
    _, results = preflight((MBP_M.but(worker_text=json.dumps(answer)), STUDIO_M), playbook())
    assert results[("mbp", "thunderbolt")].status is E
    assert "data-plane reachability" in results[("mbp", "thunderbolt")].summary


# =================================================================================================== skip, report


def test_checks_skip_skips_those_checks_only() -> None:
    mbp, m4 = tb4_pair()
    pb = playbook(checks={"skip": ["rdma", "thunderbolt", "resources"]})
    report = run_case((mbp, m4), pb, [
        *[(n, c, S, ("skipped by the playbook (checks.skip)",), ()) for n in ("mbp", "m4")
          for c in ("rdma", "thunderbolt", "resources")],
        ("m4", "os", W, ("different builds",), ()),
        ("m4", "ssh", P, (), ()),
    ])
    assert report.ok() and not report.ok(strict=True)  # only the os warning is left


def test_checks_skip_ssh_still_evaluates_the_facts() -> None:
    run_case(PAIR, playbook(checks={"skip": "ssh"}), [
        ("mbp", "ssh", S, ("checks.skip",), ()),
        ("mbp", "rdma", P, (), ()),
    ])


def test_no_playbook_checks_what_it_can() -> None:
    report = run_case(PAIR, None, [
        ("mbp", "rdma", S, ("backend ring",), ()),  # no playbook: ring
        ("mbp", "model", S, ("no playbook",), ()),
        ("mbp", "resources", P, ("128.0 GiB memory", "free disk"), ()),
        ("mbp", "env", P, (), ()),
    ])
    assert report.ok(strict=True)


def test_report_json_shape() -> None:
    pb = playbook(train={"save_every": 100})  # one lint warning
    lint = lint_playbook(pb, MODEL_CONFIG)
    report, _ = preflight((MBP_M, member("m4", NODEV, "192.168.20.1")), pb, lint=lint)
    doc = json.loads(json.dumps(report.to_json()))
    assert list(doc) == ["ok", "summary", "nodes", "lint"]
    assert list(doc["summary"]) == ["pass", "warn", "fail", "error", "skip"]
    assert [n["node"] for n in doc["nodes"]] == ["mbp", "m4"]
    for node in doc["nodes"]:
        assert list(node) == ["node", "checks"]
        assert [c["id"] for c in node["checks"]] == list(CHECK_IDS)
        for c in node["checks"]:
            assert list(c) == ["id", "status", "summary", "remedy", "evidence"]
            assert c["status"] in ("pass", "warn", "fail", "error", "skip")
            assert isinstance(c["evidence"], dict)
    assert [lint_["id"] for lint_ in doc["lint"]] == ["num_layers", "save_every", "eval_cost"]
    for lint_ in doc["lint"]:
        assert list(lint_) == ["id", "status", "summary", "remedy"]
    total = sum(len(n["checks"]) for n in doc["nodes"]) + len(doc["lint"])
    assert sum(doc["summary"].values()) == total
    statuses = [c["status"] for n in doc["nodes"] for c in n["checks"]] + [x["status"] for x in doc["lint"]]
    assert doc["summary"] == {s: statuses.count(s) for s in ("pass", "warn", "fail", "error", "skip")}
    assert doc["ok"] is (doc["summary"]["fail"] == 0 and doc["summary"]["error"] == 0)


OK_CASES = [
    # statuses present besides passes -> (ok, ok strict)
    ((), (True, True)),
    ((S,), (True, True)),
    ((W,), (True, False)),
    ((W, S), (True, False)),
    ((F,), (False, False)),
    ((E,), (False, False)),
]


@pytest.mark.parametrize(("extra", "expected"), OK_CASES)
@pytest.mark.parametrize("where", ["check", "lint"])
def test_report_ok_semantics(extra: tuple[Status, ...], expected: tuple[bool, bool], where: str) -> None:
    base = evaluate_preflight(build_ctx(PAIR, playbook()))
    if where == "check":
        extra_checks = tuple(CheckResult("env", "mbp", s, "x", "y") for s in extra)
        report = PreflightReport(((base.nodes[0][0], base.nodes[0][1] + extra_checks), *base.nodes[1:]), ())
    else:
        report = PreflightReport(base.nodes, tuple(LintResult("save_every", s, "x", "y") for s in extra))
    assert (report.ok(), report.ok(strict=True)) == expected
    assert report.to_json()["ok"] is expected[0]
    assert report.to_json(strict=True)["ok"] is expected[1]


def test_preflight_of_real_profiles_reports_expected_verdicts_end_to_end() -> None:
    """The four profiles together under jaccl: every problem of each shows up on its node."""
    members = (MBP_M, STUDIO_M, member("m4", NODEV, "192.168.20.1"), member("m1", OLD, "192.168.2.46"))
    report = run_case(members, playbook(), [
        ("m4", "rdma", F, ("no rdma_* device",), ()),
        ("m1", "rdma", F, ("rdma_ctl not found",), ()),
        ("m1", "os", F, ("14.6.1",), ()),
        ("m4", "resources", W, ("on battery",), ()),
        ("mbp", "rdma", P, ("rdma_en1 -> studio",), ()),
        ("mbp", "thunderbolt", F, ("no Thunderbolt link to m4", "no Thunderbolt link to m1"), ()),
    ])
    assert not report.ok()


# =================================================================================================== majority

MAJORITY_CASES = [
    ({}, (None, [])),
    ({"a": 1}, (1, [])),
    ({"a": 1, "b": 1}, (1, [])),
    ({"a": 1, "b": 2}, (None, ["a", "b"])),
    ({"a": 1, "b": 1, "c": 2}, (1, ["c"])),
    ({"a": 1, "b": 2, "c": 3}, (None, ["a", "b", "c"])),
    ({"a": 1, "b": 1, "c": 2, "d": 2}, (None, ["a", "b", "c", "d"])),
    ({"a": 1, "b": 1, "c": 2, "d": 3}, (1, ["c", "d"])),
]


@pytest.mark.parametrize(("values", "expected"), MAJORITY_CASES)
def test_majority(values: dict[str, int], expected: tuple[int | None, list[str]]) -> None:
    assert majority(values) == expected


def test_evaluate_node_matches_the_report() -> None:
    ctx = build_ctx(PAIR, playbook())
    report = evaluate_preflight(ctx)
    assert evaluate_node(ctx, "studio") == report.nodes[1][1]


def test_reach_evidence_of_a_large_mesh_is_a_summary_with_the_failures_in_full() -> None:
    from coordinator.facts.model import Reach
    from coordinator.preflight.checks.context import CheckContext
    from coordinator.preflight.checks.network import REACH_DETAIL_PEERS, _reachability

    n = REACH_DETAIL_PEERS + 8
    nodes = tuple(Node(name=f"n{i}", host=f"10.9.0.{i + 1}") for i in range(n))
    reach = tuple(Reach(peer=f"n{i}", ip=f"10.9.0.{i + 1}", ok=i != 5, rtt_ms=0.2 + i / 100 if i != 5 else None,
                        error=None if i != 5 else "timed out") for i in range(1, n))
    facts = type("F", (), {"reach": reach})()
    ctx = CheckContext(nodes, {}, {}, playbook(backend="jaccl"))  # a mesh: every node probes every other
    unreachable, ev = _reachability(ctx, nodes[0], facts)  # type: ignore[arg-type]
    assert unreachable == ["n5 (10.9.0.6): timed out"]
    assert ev["peers"] == n - 1 and ev["reached"] == n - 2 and set(ev["unreachable"]) == {"n5"}
    assert ev["rtt_ms_median"] is not None and ev["rtt_ms_max"] == pytest.approx(0.2 + (n - 1) / 100)


def test_a_large_ring_fleet_is_judged_on_its_ring_neighbours_only() -> None:
    from coordinator.facts.model import Reach
    from coordinator.preflight.checks.context import CheckContext
    from coordinator.preflight.checks.network import _reachability

    nodes = tuple(Node(name=f"n{i}", host=f"10.9.{i // 200}.{i % 200 + 1}") for i in range(100))
    # n0 was asked to reach n98, n99, n1, n2; n2 is down. Far peers are neither probed nor required.
    reach = tuple(Reach(peer=p, ip=nodes[int(p[1:])].data_ip, ok=p != "n2", rtt_ms=0.3 if p != "n2" else None,
                        error=None if p != "n2" else "timed out") for p in ("n98", "n99", "n1", "n2"))
    facts = type("F", (), {"reach": reach})()
    ctx = CheckContext(nodes, {}, {}, playbook(backend="ring"))
    unreachable, ev = _reachability(ctx, nodes[0], facts)  # type: ignore[arg-type]
    assert unreachable == [f"n2 ({nodes[2].data_ip}): timed out"]
    assert set(ev) == {"n98", "n99", "n1", "n2"}


# =================================================================================================== remedies


def test_remedies_quote_every_value_they_paste_into_a_shell_line() -> None:
    """Paths from the playbook and inventory, and what a node reports (its python), may hold spaces or `;`: a
    remedy is copied into a shell, so each value is one quoted word (a leading `~/` still means the home)."""
    hostile = "/Users/me/my models/llama;id"
    members = trio()
    members[1] = members[1].but(worker=_hashes(model={**MODEL_FILES, "model.safetensors": BAD}))
    _, results = preflight(members, playbook(backend="ring", model=hostile))
    assert results[("s1", "model")].remedy == (
        "copy the good files: coordinator sync -i INVENTORY -p playbook.yaml --from s0 --limit s1 "
        f"(or: ssh s0.local rsync -a --delete '{hostile}/' 's1.local:{hostile}/')")
    _, results = preflight((MBP_M, STUDIO_M.but(node={"identity": "~/.ssh/my key"})), playbook(),
                           connect={"studio": TransportError("studio", "denied", kind="auth")})
    assert "`ssh-copy-id -i \"$HOME\"/'.ssh/my key' studio.local`" in results[("studio", "ssh")].remedy
    _, results = preflight((MBP_M.but(worker={"python": "/opt/my venv/python;id", "mlx": None}), STUDIO_M), playbook())
    assert results[("mbp", "software")].remedy.endswith(", or by hand: '/opt/my venv/python;id' -m pip install "
                                                        "\"mlx>=0.32.1\" mlx-lm")
    assert results[("mbp", "software")].remedy.startswith("`coordinator setup -i ")
    _, results = preflight((MBP_M.but(worker={"python": "/opt/py;id", "mlx_lm": "0.30.0"}), STUDIO_M, STUDIO_M.but(name="s3")),
                           playbook())
    assert results[("mbp", "software")].remedy.endswith(", or by hand: '/opt/py;id' -m pip install mlx==0.32.1 "
                                                        "mlx-lm==0.31.0")


def test_resources_judges_a_pipeline_stage_not_a_replica() -> None:
    # A node that cannot hold a replica passes when the strategy gives it a stage.
    members = (MBP_M.but(worker={"params": 50_000_000_000}), STUDIO_M.but(worker={"params": 50_000_000_000}))
    _, results = preflight(members, playbook(train={"method": "lora"}))
    r = results[("mbp", "resources")]
    assert r.status is Status.PASS and "of 96.0 GiB usable; as pipeline stage of blocks 0-" in r.summary
    assert r.evidence["pipeline_stage"]["need"] <= r.evidence["pipeline_stage"]["budget"]
    _, results = preflight(members, playbook(train={"method": "lora", "strategy": "dp"}))
    assert results[("mbp", "resources")].status is F  # dp forced: a replica it is


def test_thunderbolt_on_the_loopback_is_not_applicable() -> None:
    """The local demo: two Linux nodes of one machine at 127.0.0.1. A pass would vouch for a cable that does not
    exist; the check says it does not apply, and why. A loopback that does not answer still fails."""
    a = M("a", linux_sections(), "127.0.0.1")
    b = M("b", linux_sections(), "127.0.0.1")
    run_case((a, b), playbook(backend="ring"), [
        ("a", "thunderbolt", S, ("not applicable", "loopback (127.0.0.1)"), ()),
        ("b", "thunderbolt", S, ("not applicable",), ()),
    ])
    run_case((a.but(down={"b": "connection refused"}), b), playbook(backend="ring"), [
        ("a", "thunderbolt", F, ("cannot reach b",), ("`ips:`",)),
    ])


def test_model_absent_from_every_node_offers_a_source_that_can_work() -> None:
    """Nobody has the model: `sync --from GOOD_NODE` (no such node) and an rsync to a local node (not an SSH host)
    cannot work; the remedy is a dir on this machine for `launch --fix --fix-source DIR`, or getting the model."""
    nothing = _hashes(missing=(MODEL_DIR,))
    _, results = preflight((MBP_M.but(worker=nothing), STUDIO_M.but(worker=nothing)), playbook())
    for node in ("mbp", "studio"):
        r = results[(node, "model")]
        assert r.status == F and f"model dir {MODEL_DIR} is missing" in r.summary
        assert "no node has a complete copy" in r.remedy
        assert "--fix --fix-source DIR" in r.remedy and "holding model/ and data/" in r.remedy
        assert f"--local-dir {MODEL_DIR}" in r.remedy
        assert "GOOD_NODE" not in r.remedy and "rsync" not in r.remedy


def test_model_missing_on_one_node_names_the_node_that_has_it() -> None:
    _, results = preflight((MBP_M, STUDIO_M.but(worker=_hashes(missing=(MODEL_DIR,)))), playbook())
    remedy = results[("studio", "model")].remedy
    assert remedy.startswith("coordinator sync -i INVENTORY -p playbook.yaml --from mbp --limit studio")
    assert f"ssh mbp.local rsync -a --delete {MODEL_DIR}/ studio.local:{MODEL_DIR}/" in remedy
    assert "GOOD_NODE" not in remedy


def test_model_rsync_between_local_nodes_is_not_offered_and_a_local_end_has_no_host() -> None:
    """Two `connection: local` nodes are one machine (one dir): sync alone. A local good node and an SSH one: the
    rsync runs here, the local end a plain path."""
    a = MBP_M.but(node={"connection": "local"})
    b = STUDIO_M.but(node={"connection": "local"}, worker=_hashes(missing=(MODEL_DIR,)))
    _, results = preflight((a, b), playbook())
    assert results[("studio", "model")].remedy == (
        "coordinator sync -i INVENTORY -p playbook.yaml --from mbp --limit studio")
    _, results = preflight((a, STUDIO_M.but(worker=_hashes(missing=(MODEL_DIR,)))), playbook())
    assert f"(or: rsync -a --delete {MODEL_DIR}/ studio.local:{MODEL_DIR}/; " in results[("studio", "model")].remedy
