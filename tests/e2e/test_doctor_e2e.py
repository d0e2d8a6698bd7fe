"""`meshrun doctor` in the namespace world: healthy members, a node behind a cone NAT, a resolver that never
answers, an interface taken down, and variables that override meshrun's interface pinning (in the daemon and in
the shell)."""

from __future__ import annotations

import json
import re

import pytest
from support import joined_mesh

from meshrun.core.model import DEFAULT_IFACE
from meshrun.lab.testbed import DatacenterSpec, sh


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    dcs = [DatacenterSpec("dc1"), DatacenterSpec("dc2"), DatacenterSpec("dc3", nat="cone")]
    with joined_mesh(tmp_path_factory, dcs, "dc1-a", ("dc2-a", "dc3-a")) as m:
        ips = {n: m.overlay_ip(n) for n in ("dc1-a", "dc2-a", "dc3-a")}
        for a in ips:
            for b in ips:
                if a != b:
                    m.wait_ping(a, ips[b], timeout=60)
        yield m


def _lines(out: str) -> dict[str, list[str]]:
    """{check name: [level, ...]} from doctor's screen."""
    found: dict[str, list[str]] = {}
    for level, name in re.findall(r"^(ok|warn|FAIL|skip)\s+(peer \S+|\S+)\s{2,}", out, re.M):
        found.setdefault(name, []).append(level)
    return found


def test_a_healthy_node_and_the_coordinator_pass_every_check(mesh):
    res = mesh.meshrun("dc2-a", "doctor", check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    checks = _lines(res.stdout)
    assert {
        "daemon",
        "interface",
        "wireguard",
        "mtu",
        "coordinator",
        "peer coordinator",
        "peer dc3-a",
        "udp/51820",
        "clock",
        "disk",
        "torch",
        "environment",
        "resolver",
    } <= set(checks), res.stdout
    assert all(levels == ["ok"] for levels in checks.values()), res.stdout
    assert "reachable from outside: 3 of 3 probes" in res.stdout
    assert "everything meshrun checks is fine" in res.stdout
    coord = mesh.meshrun("dc1-a", "doctor", check=False)
    assert coord.returncode == 0, coord.stdout + coord.stderr
    assert "FAIL" not in coord.stdout, coord.stdout


def test_json_has_the_checks_and_leaves_no_probe_rule(mesh):
    res = mesh.meshrun("dc2-a", "doctor", "--json")
    data = json.loads(res.stdout)
    assert data["ok"] is True
    assert {c["level"] for c in data["checks"]} == {"ok"}, [c for c in data["checks"] if c["level"] != "ok"]
    assert data["facts"]["mtu_probe"]["full"] is True and data["facts"]["udp_probe"]["arrived"] == 3
    rules = mesh.world.node("dc2-a").run("iptables", "-t", "raw", "-S", "PREROUTING").stdout
    assert "meshrun-doctor" not in rules


def test_a_node_behind_a_cone_nat_is_told_its_port_is_not_reachable_from_outside(mesh):
    res = mesh.meshrun("dc3-a", "doctor", check=False)
    assert res.returncode == 0, res.stdout + res.stderr  # a warning, not a block: relays work
    assert _lines(res.stdout)["udp/51820"] == ["warn"], res.stdout
    assert re.search(r"not reachable from outside: none of 3 probes .*\n.*fix: forward UDP 51820", res.stdout), (
        res.stdout
    )


def test_variables_that_override_the_pinning_are_named(mesh):
    node = mesh.world.node("dc2-a")
    # in the agent's environment: jobs get meshrun's value back, so a warning
    mesh.meshrun(node, "leave")
    mesh.meshrun(node, "up", env={"NCCL_SOCKET_IFNAME": "eth0"})
    try:
        res = mesh.meshrun(node, "doctor", check=False)
        assert res.returncode == 0, res.stdout + res.stderr
        assert re.search(
            r"^warn\s+environment\s+NCCL_SOCKET_IFNAME=eth0 in the daemon's environment \(pid \d+\) "
            r"overrides meshrun's pinning",
            res.stdout,
            re.M,
        ), res.stdout
        # in the shell that submits jobs: `meshrun train` would pass it on, so it blocks
        res = mesh.meshrun(node, "doctor", env={"GLOO_SOCKET_IFNAME": "eth0"}, check=False)
        assert res.returncode == 1, res.stdout
        assert re.search(r"^FAIL\s+environment\s+GLOO_SOCKET_IFNAME=eth0 in this shell overrides", res.stdout, re.M)
    finally:
        mesh.meshrun(node, "leave")
        mesh.meshrun(node, "up")


def test_a_resolver_that_never_answers_is_named_with_what_it_costs_every_job(mesh, tmp_path):
    """dc2-a's resolver is a server whose DNS the internet drops (a firewall that eats DNS): torch would wait
    for it at every rank's start, so doctor warns and names the fix; with the resolver back, ok again."""
    node, world = mesh.world.node("dc2-a"), mesh.world
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {world.gateway_public_ip('dc1')}\n")
    drop = ["-p", "udp", "--dport", "53", "-j", "DROP"]
    sh(["ip", "netns", "exec", world.inet, "iptables", "-I", "FORWARD", *drop])
    node.run("mount", "--bind", str(resolv), "/etc/resolv.conf")
    try:
        res = mesh.meshrun(node, "doctor", "--json", check=False)
    finally:
        node.run("umount", "/etc/resolv.conf")
        sh(["ip", "netns", "exec", world.inet, "iptables", "-D", "FORWARD", *drop])
    data = json.loads(res.stdout)
    (check,) = [c for c in data["checks"] if c["name"] == "resolver"]
    assert check["level"] == "warn" and re.search(r"took [5-9]\.\d s|had not ended", check["detail"]), check
    assert "/etc/resolv.conf" in check["fix"] and res.returncode == 0, check  # a warning: jobs still run
    checks = json.loads(mesh.meshrun(node, "doctor", "--json").stdout)["checks"]
    (again,) = [c for c in checks if c["name"] == "resolver"]
    assert again["level"] == "ok", again


def test_an_interface_taken_down_is_named_and_fails(mesh):
    node = mesh.world.node("dc2-a")
    iface = DEFAULT_IFACE
    node.run("ip", "link", "set", iface, "down")
    try:
        res = mesh.meshrun(node, "doctor", check=False)
        assert res.returncode == 1, res.stdout + res.stderr
        assert re.search(rf"^FAIL\s+interface\s+{iface} exists but is down", res.stdout, re.M), res.stdout
        assert f"fix: ip link set {iface} up" in res.stdout
    finally:
        mesh.meshrun(node, "leave")
        mesh.meshrun(node, "up")
