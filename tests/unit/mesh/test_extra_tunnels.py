"""meshrun.mesh.node.tunnels: one member's extra tunnels per pair, peered from member lists, moved by probes.

Tunnels runs on a FakeTunnelLink (meshrun.system.kernel.tunnellink, the kernel state in memory) with a scripted
probe, on a state directory in tmp_path: no root, no kernel.
"""

from __future__ import annotations

import pytest
from support import JOB_NETWORK

from meshrun.core import lanpath, tunnels
from meshrun.core.model import Member
from meshrun.errors import HostError
from meshrun.mesh.node.tunnels import Tunnels
from meshrun.system.kernel.tunnellink import FakeTunnelLink

NET = JOB_NETWORK  # overlay 10.213.0.0/16 on meshrun0
T1, T2 = tunnels.device_names("meshrun0", 3)


def member(i: int, path: str = "private", count: int = 3) -> Member:
    return Member(
        f"n{i}",
        f"{i:042d}A=",
        f"10.213.0.{i + 2}",
        f"198.51.100.9:{40000 + i}",
        (f"10.1.0.{i + 2}:51820",),
        path=path,
        tunnels=count,
    )


ME = member(0, path="")
N1, N2 = member(1), member(2)


class Probe:
    """The probe through one tunnel: `answers[(overlay IP, tunnel)]` says whether it answers now."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, int], bool] = {}

    def __call__(self, ip: str, port: int, source: str, i: int) -> float | None:
        return 0.001 if self.answers.get((ip, i), False) else None


@pytest.fixture
def probe():
    return Probe()


def make(state, probe, count: int = 3) -> Tunnels:
    rec = {"public_key": ME.public_key, "overlay_ip": ME.overlay_ip, "tunnels": count}
    return Tunnels(state, NET, rec, FakeTunnelLink, probe)


def rounds(t: Tunnels, n: int) -> None:
    for _ in range(n):
        t.check()


def test_one_tunnel_makes_nothing(state, probe):
    t = make(state, probe, count=1)
    t.start()
    t.apply([ME, N1])
    assert not t.enabled and t.link.calls == [] and not (state / "tunnels.json").exists()


def test_start_makes_the_devices_and_the_guard_before_any_peer(state, probe):
    t = make(state, probe)
    t.start()
    assert t.link.made and t.link.peers == {} and t.link.spread == {}
    assert T1 in t.link.interfaces and "meshrun0" in t.link.interfaces
    assert state.read_json("tunnels.json")["devices"] == [T1, T2]


def test_peers_are_planned_but_carry_nothing_until_their_tunnels_answer(state, probe):
    t = make(state, probe)
    t.start()
    t.apply([ME, N1, N2, member(3, path="public")])
    assert [p.name for p in t.link.peers[T1]] == ["n1", "n2"]
    assert t.link.spread == {}
    probe.answers = {(N1.overlay_ip, 1): True, (N1.overlay_ip, 2): True, (N2.overlay_ip, 2): True}
    rounds(t, lanpath.PROBE_OKS - 1)
    assert t.link.spread == {}
    rounds(t, 1)
    assert t.link.spread == {N1.overlay_ip: (1, 2), N2.overlay_ip: (2,)}
    assert state.read_json("tunnels.json")["peers"]["n1"]["live"] == [1, 2]


def test_a_peer_running_fewer_tunnels_is_peered_and_probed_on_those_only(state, probe):
    t = make(state, probe)
    t.start()
    calls = []
    t.probe = lambda ip, port, source, i: calls.append((ip, i)) or 0.001
    t.apply([ME, N1, member(2, count=2), member(3, count=1)])
    assert [p.name for p in t.link.peers[T1]] == ["n1", "n2"] and [p.name for p in t.link.peers[T2]] == ["n1"]
    rounds(t, lanpath.PROBE_OKS)
    assert set(calls) == {(N1.overlay_ip, 1), (N1.overlay_ip, 2), (N2.overlay_ip, 1)}  # none to n3
    assert t.link.spread == {N1.overlay_ip: (1, 2), N2.overlay_ip: (1,)}
    assert state.read_json("tunnels.json")["peers"]["n2"] == {"live": [1], "lan_ip": "10.1.0.4", "count": 2}


def test_a_tunnel_that_stops_answering_leaves_the_spread_and_the_last_leaves_the_interface_alone(state, probe):
    t = make(state, probe)
    t.start()
    t.apply([ME, N1])
    probe.answers = {(N1.overlay_ip, 1): True, (N1.overlay_ip, 2): True}
    rounds(t, lanpath.PROBE_OKS)
    probe.answers[(N1.overlay_ip, 1)] = False
    rounds(t, lanpath.PROBE_FAILS - 1)
    assert t.link.spread[N1.overlay_ip] == (1, 2)
    rounds(t, 1)
    assert t.link.spread[N1.overlay_ip] == (2,)
    probe.answers[(N1.overlay_ip, 2)] = False
    rounds(t, lanpath.PROBE_FAILS)
    assert N1.overlay_ip not in t.link.spread  # main's route: the interface alone


def test_the_guard_follows_a_routed_site_lan_path(state, probe):
    t = make(state, probe)
    t.start()
    t.apply([ME, N1], routed_via="eth1")
    assert "eth1" in t.link.interfaces
    t.apply([ME, N1])
    assert "eth1" not in t.link.interfaces


def test_a_peer_that_leaves_the_private_path_leaves_the_tunnels_and_the_spread(state, probe):
    t = make(state, probe)
    t.start()
    t.apply([ME, N1])
    probe.answers = {(N1.overlay_ip, 1): True}
    rounds(t, lanpath.PROBE_OKS)
    assert t.link.spread == {N1.overlay_ip: (1,)}
    t.apply([ME, member(1, path="relayed")])
    assert t.link.peers[T1] == () and t.link.spread == {}
    assert state.read_json("tunnels.json")["peers"] == {}


def test_devices_made_anew_are_peered_and_proven_again(state, probe):
    t = make(state, probe)
    t.start()
    t.apply([ME, N1])
    probe.answers = {(N1.overlay_ip, 1): True}
    rounds(t, lanpath.PROBE_OKS)
    t.link.made = False  # a wireguard-go died and took its device with it: ensure makes them anew
    t.apply([ME, N1])
    assert [p.name for p in t.link.peers[T1]] == ["n1"] and t.link.spread == {}
    rounds(t, lanpath.PROBE_OKS)
    assert t.link.spread == {N1.overlay_ip: (1,)}


def test_a_host_that_cannot_make_them_keeps_the_interface_alone_and_says_why(state, probe):
    t = make(state, probe)
    t.link.fail = HostError("wireguard-go is not installed", "install it")
    t.start()
    rec = state.read_json("tunnels.json")
    assert rec["error"] == "wireguard-go is not installed" and rec["devices"] == []
    t.link.fail = None
    t.apply([ME, N1])  # within RETRY_S: not tried again
    assert state.read_json("tunnels.json")["error"]
    t.retry_at = 0.0
    t.apply([ME, N1])
    assert state.read_json("tunnels.json")["error"] == "" and t.link.made


def test_close_takes_everything_away(state, probe):
    t = make(state, probe)
    t.start()
    t.apply([ME, N1])
    t.close()
    assert not t.link.made and t.link.calls[-1] == ("delete",)
    assert state.read_json("tunnels.json")["devices"] == []
