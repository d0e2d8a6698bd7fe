"""meshrun.mesh.node.lan: one member's site LAN path, planned from member lists and moved by probes.

LanPaths runs on a FakeLanLink (meshrun.system.kernel.lanlink, the kernel state in memory) with a scripted probe,
on a state directory in tmp_path: no root, no kernel.
"""

from __future__ import annotations

import pytest
from support import JOB_NETWORK

from meshrun.core import lanpath, tunnels
from meshrun.core.model import Member
from meshrun.errors import HostError
from meshrun.mesh.node.lan import LanPaths
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.lanlink import FakeLanLink

NET = JOB_NETWORK  # overlay 10.213.0.0/16 on meshrun0


def key(i: int) -> str:
    return f"{i:042d}A="


def member(i: int, lan: bool = True, routed: bool = False) -> Member:
    """Node i of site dc1: overlay 10.213.0.(i+2), LAN 10.1.0.(i+2)."""
    return Member(
        f"n{i}",
        key(i),
        f"10.213.0.{i + 2}",
        f"198.51.100.9:{40000 + i}",
        (f"10.1.0.{i + 2}:51820",),
        lan=lan,
        lan_routed=routed,
    )


ME = member(0, lan=False)
N1, N2 = member(1), member(2)


class Probe:
    """The probe through the LAN path: `answers[overlay IP]` says whether that peer answers now."""

    def __init__(self) -> None:
        self.answers: dict[str, bool] = {}
        self.calls: list[tuple[str, int, str]] = []

    def __call__(self, ip: str, port: int, source: str) -> float | None:
        self.calls.append((ip, port, source))
        return 0.001 if self.answers.get(ip, False) else None


@pytest.fixture
def probe():
    return Probe()


@pytest.fixture
def lan(state, probe):
    paths = LanPaths(state, NET, {"public_key": ME.public_key, "overlay_ip": ME.overlay_ip}, FakeLanLink, probe)
    yield paths
    paths.close()


def recorded(state: StateDir) -> dict:
    return state.read_json("lan.json")


def test_a_plan_makes_the_device_and_its_peers_and_nothing_is_active_yet(lan, state):
    lan.apply([ME, N1, N2])
    link = lan.link
    assert link.name == "meshrun0-lan"
    assert link.calls == [("ensure", "10.1.0.2"), ("set_peers", ("n1", "n2"))]
    assert link.local_ip == "10.1.0.2" and set(link.peers) == {N1.overlay_ip, N2.overlay_ip}
    # The extra tunnels a member may run (core/tunnels) reach the overlay address too.
    assert link.guard == lanpath.guard_script(ME.overlay_ip, lan.plan.peers, tunnels=tunnels.device_names("meshrun0"))
    assert link.active == set() and lan.active() == []
    assert recorded(state) == {
        "device": "meshrun0-lan",
        "routed": False,
        "rp_filter": None,
        "local": "10.1.0.2",
        "planned": ["n1", "n2"],
        "active": [],
        "error": "",
    }


def test_answers_put_a_peer_on_the_lan_path_and_misses_take_it_off(lan, state, probe):
    lan.apply([ME, N1, N2])
    probe.answers[N1.overlay_ip] = True
    for _ in range(lanpath.PROBE_OKS):
        lan.check()
    assert lan.link.active == {N1.overlay_ip} and lan.active() == ["n1"]
    assert recorded(state)["active"] == ["n1"]
    # Each probe goes to the peer's API port from this member's overlay address.
    assert (N1.overlay_ip, NET.api_port, ME.overlay_ip) in probe.calls
    assert {ip for ip, _, _ in probe.calls} == {N1.overlay_ip, N2.overlay_ip}

    probe.answers[N1.overlay_ip] = False
    for _ in range(lanpath.PROBE_FAILS - 1):
        lan.check()
    assert lan.link.active == {N1.overlay_ip}  # a miss or two: still on the LAN path
    lan.check()
    assert lan.link.active == set() and lan.active() == []
    assert recorded(state)["active"] == []
    assert ("deactivate", N1.overlay_ip) in lan.link.calls
    assert lan.link.peers  # the device and its peers stay: probing goes on, the pair is back on WireGuard


def test_check_without_a_plan_probes_nothing(lan, probe):
    lan.check()
    lan.apply([ME, member(1, lan=False)])
    lan.check()
    assert probe.calls == [] and lan.link.calls == []


def test_a_plan_without_lan_peers_removes_the_device(lan, state, probe):
    lan.apply([ME, N1, N2])
    probe.answers[N1.overlay_ip] = True
    for _ in range(lanpath.PROBE_OKS):
        lan.check()
    lan.apply([ME, member(1, lan=False), member(2, lan=False)])  # the site was untrusted
    assert lan.link.calls[-1] == ("delete",)
    assert lan.link.local_ip is None and lan.link.peers == {} and lan.link.active == set()
    assert lan.active() == [] and lan.health.active == set() and lan.health.streak == {}
    assert recorded(state) == {
        "device": None,
        "routed": False,
        "rp_filter": None,
        "local": None,
        "planned": [],
        "active": [],
        "error": "",
    }


def test_a_peer_leaving_the_plan_is_forgotten(lan, probe):
    lan.apply([ME, N1, N2])
    probe.answers = {N1.overlay_ip: True, N2.overlay_ip: True}
    for _ in range(lanpath.PROBE_OKS):
        lan.check()
    assert lan.active() == ["n1", "n2"]
    lan.apply([ME, N1, member(2, lan=False)])
    assert lan.link.calls[-1] == ("set_peers", ("n1",))
    assert lan.active() == ["n1"] and lan.link.active == {N1.overlay_ip}
    assert set(lan.health.streak) == {N1.overlay_ip}


def test_the_same_plan_again_changes_nothing(lan, state):
    lan.apply([ME, N1])
    calls = list(lan.link.calls)
    (state / "lan.json").unlink()
    lan.apply([ME, N1])
    lan.apply([ME, N1, member(2, lan=False)])  # another member list, the same plan
    assert lan.link.calls == calls
    assert not (state / "lan.json").exists()  # not rewritten either


class NoVxlan(FakeLanLink):
    def ensure(self, local_ip: str, routed: bool = False) -> None:
        super().ensure(local_ip)
        raise HostError("this kernel has no VXLAN, which the site LAN path needs", "load it (`modprobe vxlan`)")


def test_a_host_that_cannot_make_the_device_keeps_every_pair_on_wireguard(state, probe):
    lan = LanPaths(state, NET, {"public_key": ME.public_key, "overlay_ip": ME.overlay_ip}, NoVxlan, probe)
    lan.apply([ME, N1, N2])
    assert lan.plan == lanpath.LanPlan(None) and lan.active() == []
    assert lan.link.calls == [("ensure", "10.1.0.2"), ("delete",)]  # whatever was half made is taken away
    rec = recorded(state)
    assert rec["error"] == "this kernel has no VXLAN, which the site LAN path needs"
    assert rec["device"] is None and rec["planned"] == [] and rec["active"] == []
    probe.answers[N1.overlay_ip] = True
    lan.check()
    assert probe.calls == []  # nothing planned: nothing probed
    lan.apply([ME, N1, N2])  # not at every sync: RETRY_S after the failure
    assert lan.link.calls == [("ensure", "10.1.0.2"), ("delete",)]
    lan.retry_at = 0.0  # RETRY_S later, the next sync tries again (a failure may have been passing)
    lan.apply([ME, N1, N2])
    assert lan.link.calls[2:] == [("ensure", "10.1.0.2"), ("delete",)]
    lan.close()
    lan.close()
    assert lan.plan == lanpath.LanPlan(None)


class OnceNoVxlan(FakeLanLink):
    failed = False

    def ensure(self, local_ip: str, routed: bool = False) -> None:
        super().ensure(local_ip)
        if not OnceNoVxlan.failed:
            OnceNoVxlan.failed = True
            raise HostError("vxlan busy", "try again")


def test_a_passing_failure_is_tried_again_and_the_path_comes_up(state, probe):
    lan = LanPaths(state, NET, {"public_key": ME.public_key, "overlay_ip": ME.overlay_ip}, OnceNoVxlan, probe)
    lan.apply([ME, N1])
    assert lan.plan == lanpath.LanPlan(None) and recorded(state)["error"] == "vxlan busy"
    lan.retry_at = 0.0
    lan.apply([ME, N1])
    assert lan.plan.local_ip == "10.1.0.2" and recorded(state)["error"] == "" and recorded(state)["planned"] == ["n1"]


def test_close_removes_the_device_and_forgets_the_plan(lan, state, probe):
    lan.apply([ME, N1])
    probe.answers[N1.overlay_ip] = True
    for _ in range(lanpath.PROBE_OKS):
        lan.check()
    lan.close()
    assert lan.link.calls[-1] == ("delete",) and lan.link.active == set()
    assert lan.active() == [] and recorded(state)["active"] == [] and recorded(state)["device"] is None
    lan.apply([ME, N1])  # after a close the same plan is made again
    assert lan.link.calls[-2:] == [("ensure", "10.1.0.2"), ("set_peers", ("n1",))]


def test_close_without_a_lan_path_touches_nothing(lan):
    lan.close()
    assert lan.link.calls == []


def _activate(lan: LanPaths, probe: Probe, *peers: Member) -> None:
    for p in peers:
        probe.answers[p.overlay_ip] = True
    for _ in range(lanpath.PROBE_OKS):
        lan.check()


def test_a_new_own_lan_address_makes_the_path_anew_and_it_is_proven_again(lan, state, probe):
    lan.apply([ME, N1])
    _activate(lan, probe, N1)
    moved = Member(ME.name, ME.public_key, ME.overlay_ip, ME.endpoint, ("10.1.0.12:51820",))
    lan.apply([moved, N1])  # DHCP gave this host another address: the device is made anew, its routes gone
    assert lan.link.local_ip == "10.1.0.12"
    assert lan.active() == [] and lan.link.active == set() and recorded(state)["active"] == []
    _activate(lan, probe, N1)
    assert lan.active() == ["n1"] and lan.link.active == {N1.overlay_ip}


def test_a_peers_new_lan_address_is_proven_again_before_its_traffic_moves(lan, probe):
    lan.apply([ME, N1, N2])
    _activate(lan, probe, N1, N2)
    moved = Member(N1.name, N1.public_key, N1.overlay_ip, N1.endpoint, ("10.1.0.33:51820",), lan=True)
    lan.apply([ME, moved, N2])
    assert lan.link.peers[N1.overlay_ip].lan_ip == "10.1.0.33"
    assert lan.active() == ["n2"] and lan.link.active == {N2.overlay_ip}  # n2's path did not move
    _activate(lan, probe, N1)
    assert lan.active() == ["n1", "n2"] and lan.link.active == {N1.overlay_ip, N2.overlay_ip}


def test_a_routed_site_makes_no_device_and_guards_the_lan_interface(lan, state, probe):
    lan.apply([ME, member(1, routed=True), member(2, routed=True)])
    assert lan.link.calls[0] == ("ensure", "10.1.0.2", "routed")
    assert lan.link.routed and set(lan.link.peers) == {N1.overlay_ip, N2.overlay_ip}
    assert 'iifname "eth0" ip saddr != { 10.213.0.3, 10.213.0.4 } drop' in lan.link.guard
    rec = recorded(state)
    assert rec["routed"] is True and rec["device"] == "eth0" and rec["planned"] == ["n1", "n2"]
    _activate(lan, probe, N1)
    assert lan.active() == ["n1"]


def test_an_encapsulation_change_makes_the_path_anew_and_every_peer_is_proven_again(lan, state, probe):
    lan.apply([ME, N1, N2])
    _activate(lan, probe, N1, N2)
    assert lan.active() == ["n1", "n2"] and not lan.link.routed
    lan.apply([ME, member(1, routed=True), member(2, routed=True)])  # `site trust dc1 --encapsulation none`
    assert lan.link.routed and lan.link.active == set() and lan.active() == []
    assert recorded(state)["active"] == [] and recorded(state)["routed"] is True
    _activate(lan, probe, N1, N2)
    assert lan.active() == ["n1", "n2"] and lan.link.active == {N1.overlay_ip, N2.overlay_ip}
    lan.apply([ME, N1, N2])  # and back to VXLAN
    assert not lan.link.routed and lan.active() == [] and recorded(state)["device"] == "meshrun0-lan"
