"""meshrun.mesh.status: exact text for fixed status dicts, and how round trips are sampled (pure)."""

from __future__ import annotations

import copy
import re

from meshrun.mesh.coordinator.leader import LEASE_TTL_S
from meshrun.mesh.status import _age, _bytes, _duration, coordinator_role, render, rtt_ms

STATUS = {
    "network": "lab",
    "role": "node",
    "name": "gpu-a",
    "overlay_ip": "10.213.0.2",
    "cidr": "10.213.0.0/16",
    "interface": "meshrun0",
    "interface_up": True,
    "backend": "wireguard-go",
    "listen_port": 51820,
    "mtu": 1420,
    "daemon_pid": 4242,
    "removed": False,
    "peers": [
        {
            "name": "coord",
            "overlay_ip": "10.213.0.1",
            "endpoint": "203.0.113.1:51820",
            "handshake_age_s": 5,
            "rx_bytes": 1023,
            "tx_bytes": 1024,
            "path": "direct (public)",
            "latency_ms": 0.5,
        },
        {
            "name": "gpu-b",
            "site": "dc2",
            "overlay_ip": "10.213.0.3",
            "endpoint": None,
            "handshake_age_s": None,
            "rx_bytes": 0,
            "tx_bytes": 5 * 1024 * 1024,
            "path": "relayed",
            "latency_ms": None,
        },
        {
            "name": "?",
            "overlay_ip": "10.213.0.10",
            "endpoint": "[2001:db8::1]:51820",
            "handshake_age_s": 7300,
            "rx_bytes": 3 * 1024**4,
            "tx_bytes": 1536,
            "path": "unknown",
            "latency_ms": None,
        },
    ],
}


def test_render_table():
    assert (
        render(STATUS)
        == """\
network lab  node gpu-a  10.213.0.2 in 10.213.0.0/16
interface meshrun0 (wireguard-go)  udp/51820  mtu 1420  daemon running (pid 4242)

NAME   SITE  OVERLAY IP   PATH             ENDPOINT             HANDSHAKE  RTT      RX          TX
coord  -     10.213.0.1   direct (public)  203.0.113.1:51820    5s ago     0.50 ms  1023 B      1.0 KiB
gpu-b  dc2   10.213.0.3   relayed          -                    never      -        0 B         5.0 MiB
?      -     10.213.0.10  unknown          [2001:db8::1]:51820  2h ago     -        3072.0 GiB  1.5 KiB
RTT: median of up to 9 TCP connects over the overlay"""
    )


def test_render_down_removed_no_peers():
    st = copy.deepcopy(STATUS)
    st.update(
        interface_up=False,
        daemon_pid=None,
        removed=True,
        peers=[],
        role="coordinator",
        name="coord",
        overlay_ip="10.213.0.1",
    )
    assert (
        render(st)
        == """\
network lab  coordinator coord  10.213.0.1 in 10.213.0.0/16
interface meshrun0 DOWN  udp/51820  mtu 1420  daemon not running
this coordinator was REMOVED from the network by the other coordinators

NAME  SITE  OVERLAY IP  PATH  ENDPOINT  HANDSHAKE  RTT  RX  TX
(no peers yet)"""
    )


def test_no_trailing_spaces():
    assert all(line == line.rstrip() for line in render(STATUS).splitlines())


def test_age():
    assert [_age(s) for s in (None, 0, 119, 120, 7199, 7200, 86400)] == [
        "never",
        "0s ago",
        "119s ago",
        "2m ago",
        "119m ago",
        "2h ago",
        "24h ago",
    ]


def test_bytes():
    assert [_bytes(n) for n in (0, 1023, 1024, 1536, 1024**3, 5 * 1024**4)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "1.0 GiB",
        "5120.0 GiB",
    ]


def test_a_large_mesh_shows_counts_and_the_worst_few_and_all_rows_on_request():
    st = copy.deepcopy(STATUS)
    st["peers"] = [
        {
            "name": f"n{i}",
            "overlay_ip": f"10.213.1.{i}",
            "endpoint": f"198.18.0.{i}:51820",
            "handshake_age_s": 10,
            "rx_bytes": 0,
            "tx_bytes": 0,
            "path": "direct (public)",
            "latency_ms": None,
        }
        for i in range(30)
    ]
    st["peers"][17].update(handshake_age_s=None, endpoint=None, path="relayed")  # never handshaken
    st["peers"][4].update(handshake_age_s=900)  # stale
    text = render(st)
    assert "30 peers: direct (public) 29, relayed 1; handshake < 3 min 28, older 1, never 1" in text, text
    names = [line.split()[0] for line in text.splitlines() if re.match(r"n\d+ ", line)]
    assert names[:2] == ["n17", "n4"] and len(names) == 5  # the worst first, five of them
    full = render(st, full=True)
    assert sum(bool(re.match(r"n\d+ ", line)) for line in full.splitlines()) == 30 and "worst" not in full


def test_render_names_the_relay_what_this_node_relays_and_a_silent_coordinator():
    st = copy.deepcopy(STATUS)
    st["peers"][1]["relay"] = "gpu-c"
    st["relaying"] = [["gpu-d", "gpu-e"]]
    st["warnings"] = ["the coordinator has not answered for 45s (timed out); tunnels, paths and relays stay"]
    text = render(st)
    assert re.search(r"^gpu-b +dc2 +10\.213\.0\.3 +relayed by gpu-c +- ", text, re.M)
    assert "this node relays 1 pairs: gpu-d <-> gpu-e" in text
    assert "warning: the coordinator has not answered for 45s" in text
    pairs = copy.deepcopy(STATUS)
    pairs["pairs"] = [{"a": "gpu-b", "b": "gpu-f", "path": "relayed", "relay": "coordinator", "verified": False}]
    assert re.search(r"^gpu-b +gpu-f +relayed by coordinator +no$", render(pairs), re.M)
    pairs["pairs"][0]["direct_try_in_s"] = 840
    assert re.search(r"^gpu-b +gpu-f +relayed by coordinator, next direct try in 14m +no$", render(pairs), re.M)


def _probes(monkeypatch, answers: list[float | None], accepted: bool = True) -> list[float | None]:
    """Make probe.tcp_connect answer `answers` in turn (each accepted or refused, as `accepted` says; None: no
    answer); returns the list of those it was asked for."""
    from meshrun.system.sockets import probe

    asked: list[float | None] = []

    def tcp_connect(ip, port, timeout=1.0):
        asked.append(answers[len(asked)])
        return asked[-1], asked[-1] is not None and accepted

    monkeypatch.setattr(probe, "tcp_connect", tcp_connect)
    return asked


def test_rtt_near_peer_takes_all_samples_and_drops_the_warm_up(monkeypatch):
    asked = _probes(monkeypatch, [1.5] + [0.0002] * 9)
    assert rtt_ms("10.0.0.2", 7000) == (0.2, True) and len(asked) == 10


def test_rtt_far_peer_takes_three_samples(monkeypatch):
    asked = _probes(monkeypatch, [0.3, 0.2, 0.25, 0.21])
    assert rtt_ms("10.0.0.2", 7000) == (210.0, True) and len(asked) == 4


def test_a_peer_whose_port_refuses_has_a_round_trip_but_did_not_answer(monkeypatch):
    _probes(monkeypatch, [0.001] * 10, accepted=False)
    assert rtt_ms("10.0.0.2", 7000) == (1.0, False)


def test_rtt_silent_peer_costs_two_timeouts(monkeypatch):
    asked = _probes(monkeypatch, [None, None] + [0.001] * 9)
    assert rtt_ms("10.0.0.2", 7000) == (None, False) and len(asked) == 2


def test_a_span_is_said_in_units_and_never_negative():
    """The coordinator's silence was once printed as "-2s ago" (a clock read before the agent's last write)."""
    assert [_duration(x) for x in (-2.7, 0, 45.9, 119, 120, 7199, 7200)] == [
        "0 s", "0 s", "45 s", "119 s", "2 min", "119 min", "2 h"
    ]  # fmt: skip


def test_a_leader_whose_etcd_member_does_not_answer_is_listed_as_lost_not_as_leading():
    """The leader key outlives a powered-off leader until its lease ends: `coordinator list` called it "leader"
    for about 6 s; only a leader that answers leads."""
    assert coordinator_role(True, "ok") == "leader"
    assert coordinator_role(True, "unreachable") == f"lost leader (another takes the lead within {LEASE_TTL_S} s)"
    assert coordinator_role(False, "unreachable") == coordinator_role(False, "ok") == "follower"
