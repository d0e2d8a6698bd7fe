"""A relay's forwarding decision for one pair's datagrams (meshrun.core.relayfwd): who may speak, what passes."""

from __future__ import annotations

import base64
import os

from meshrun.core import keys
from meshrun.core.model import Member
from meshrun.core.relayfwd import (
    LATCH_MIN_S,
    PairForwarder,
    RelayedPair,
    Route,
    end_hosts,
    kernel_script,
    mac1,
    mac1_ok,
    message_type,
    relayed_pairs,
)
from meshrun.core.relays import RELAY_PORTS

A_HOST, B_HOST, OTHER = "198.51.100.1", "198.51.100.2", "203.0.113.66"
T0 = 1000.0  # a monotonic clock reading


def keypair() -> tuple[str, bytes]:
    private = keys.generate_private_key()
    public = keys.public_key(private)
    return public, base64.b64decode(public)


A_KEY, A_RAW = keypair()
B_KEY, B_RAW = keypair()


def initiation(to: bytes) -> bytes:
    """A handshake initiation as WireGuard lays it out (148 bytes, mac1 over the first 116) for receiver `to`."""
    body = b"\x01\0\0\0" + os.urandom(112)
    return body + mac1(body, to) + bytes(16)


def response(to: bytes) -> bytes:
    body = b"\x02\0\0\0" + os.urandom(56)
    return body + mac1(body, to) + bytes(16)


def transport(n: int = 64) -> bytes:
    return b"\x04\0\0\0" + os.urandom(n - 4)


def forwarder(a_hosts=(A_HOST,), b_hosts=(B_HOST,)) -> PairForwarder:
    return PairForwarder(RelayedPair(RELAY_PORTS[0], (A_KEY, B_KEY), (frozenset(a_hosts), frozenset(b_hosts))))


def test_message_types_by_layout():
    assert message_type(initiation(B_RAW)) == 1 and message_type(response(A_RAW)) == 2
    assert message_type(b"\x03\0\0\0" + bytes(60)) == 3 and message_type(transport(32)) == 4
    assert message_type(transport(1424)) == 4
    assert message_type(transport(1452)) == 4  # a full 1420-byte packet: not padded past the MTU
    for junk in (b"", b"\x01\0\0", initiation(B_RAW)[:-1], b"\x04\0\0\0" + bytes(20), b"\x05\0\0\0" + bytes(60)):
        assert message_type(junk) == 0
    assert message_type(b"GET / HTTP/1.1\r\n" * 4) == 0


def test_mac1_names_the_receiver():
    msg = initiation(B_RAW)
    assert mac1_ok(msg, B_RAW) and not mac1_ok(msg, A_RAW)
    assert not mac1_ok(transport(), B_RAW)
    tampered = bytearray(msg)
    tampered[10] ^= 1
    assert not mac1_ok(bytes(tampered), B_RAW)


def test_the_ends_are_latched_from_what_they_send_and_the_first_datagram_waits_for_the_other_end():
    f = forwarder()
    a, b = (A_HOST, 40001), (B_HOST, 50002)
    hello = initiation(B_RAW)
    assert f.route(hello, a, now=T0) == []  # b not heard from yet: kept
    reply = response(A_RAW)
    # b's first datagram latches b; a's kept initiation goes out to b, and b's reply to a.
    assert f.route(reply, b, now=T0) == [(hello, b), (reply, a)]
    data = transport()
    assert f.route(data, a) == [(data, b)] and f.route(data, b) == [(data, a)]
    # a's NAT gives it a new port: its transport datagrams from there prove nothing and move nothing; the
    # handshake its WireGuard sends from there (for b's key) moves a.
    moved = (A_HOST, 40999)
    assert f.route(data, moved) == [] and f.addrs[0] == a
    again = initiation(B_RAW)
    assert f.route(again, moved, now=T0 + LATCH_MIN_S) == [(again, b)]
    assert f.route(data, moved) == [(data, b)] and f.route(data, b) == [(data, moved)]
    assert f.forwarded == 7 and f.dropped == 1


def test_a_stranger_at_an_ends_host_moves_nothing_and_handshakes_move_an_end_once_a_second_at_most():
    """A stranger holding one of an end's hosts (behind its NAT, or its LAN address elsewhere), sending what looks
    like WireGuard transport from there, moved the latched end before. Now only a handshake made for the other
    end's key moves it, and a flood of them at most once per LATCH_MIN_S."""
    f = forwarder()
    a, b = (A_HOST, 40001), (B_HOST, 50002)
    f.route(initiation(B_RAW), a, now=T0)
    f.route(response(A_RAW), b, now=T0)
    stranger = (A_HOST, 51820)
    for i in range(100):
        assert f.route(transport(), stranger, now=T0 + i) == []
    assert f.addrs == [a, b] and f.dropped == 100
    moves = [f.route(initiation(B_RAW), (A_HOST, 41000 + i), now=T0 + 10 + i * 0.1) != [] for i in range(30)]
    assert sum(moves) == 3 and moves[0]  # 3 s of handshakes from ever new ports: one move a second
    assert f.route(transport(), a, now=T0 + 14) == []  # a's old address is no longer a's


def test_two_initiations_do_not_cross_at_the_relay():
    """Both ends start a handshake before the relay knows the second: only the second goes on (its answer
    completes the handshake); delivering the kept one too would leave both ends waiting 5 s."""
    f = forwarder()
    a, b = (A_HOST, 40001), (B_HOST, 50002)
    assert f.route(initiation(B_RAW), a) == []
    theirs = initiation(A_RAW)
    assert f.route(theirs, b) == [(theirs, a)]
    answer = response(B_RAW)
    assert f.route(answer, a) == [(answer, b)]


def test_nobody_but_the_ends_and_nothing_but_wireguard_passes():
    f = forwarder()
    a, b = (A_HOST, 40001), (B_HOST, 50002)
    f.route(initiation(B_RAW), a)
    f.route(response(A_RAW), b)
    assert f.route(transport(), (OTHER, 40001)) == []  # another host, even on an end's port
    assert f.route(b"GET / HTTP/1.1\r\n\r\n" + bytes(14), a) == []  # an end's host, not WireGuard
    assert f.route(initiation(A_RAW), a) == []  # a handshake from a not addressed to b
    assert f.route(initiation(os.urandom(32)), (A_HOST, 1)) == []  # for a key that is not b's
    assert f.addrs == [a, b]  # none of it moved an end
    assert f.dropped == 4


def test_ends_behind_one_address_are_told_apart_by_their_handshakes():
    shared = "198.51.100.9"
    f = forwarder((shared,), (shared,))
    a, b = (shared, 40001), (shared, 40002)
    assert f.route(transport(), a) == []  # unknown which end: dropped, not guessed
    hello = initiation(B_RAW)  # made for b: from a
    assert f.route(hello, a) == []
    assert f.route(response(A_RAW), b)[0] == (hello, b)
    data = transport()
    assert f.route(data, a) == [(data, b)] and f.route(data, b) == [(data, a)]


def test_new_hosts_unlatch_an_end_that_is_no_longer_allowed():
    f = forwarder()
    a, b = (A_HOST, 40001), (B_HOST, 50002)
    f.route(initiation(B_RAW), a)
    f.route(response(A_RAW), b)
    f.update(RelayedPair(RELAY_PORTS[0], (A_KEY, B_KEY), (frozenset({"198.51.100.77"}), frozenset({B_HOST}))))
    assert f.addrs == [None, b]
    assert f.route(transport(), a) == []


def test_the_pairs_to_forward_come_from_the_relays_list_and_what_it_knows_of_the_ends():
    a = Member("a", A_KEY, "10.213.0.2", "198.51.100.1:40000", ("172.31.40.46:51820",))
    b = Member("b", B_KEY, "10.213.0.3", "198.51.100.2:40001")
    first = RELAY_PORTS[0]
    got = relayed_pairs(
        [
            ["10.213.0.2", "10.213.0.3", first],
            ["10.213.0.2", "10.213.0.9", first + 1],
            ["10.213.0.3", "10.213.0.2", 80],
        ],
        [a, b],
        {A_KEY: "192.0.2.1:33333"},
    )
    assert got == [
        RelayedPair(
            first,
            (A_KEY, B_KEY),
            # a's LAN address is not one this relay can see a datagram of a's come from (another network's).
            (frozenset({"192.0.2.1", "198.51.100.1"}), frozenset({"198.51.100.2"})),
        )
    ]


def test_an_ends_lan_addresses_are_its_hosts_only_at_a_relay_on_its_lan():
    """Private ranges repeat across datacenters: a stranger on the relay's LAN holding 172.31.40.46 must not
    count as end a, whose LAN elsewhere has that address. A relay of a's own site, or behind a's public address,
    may see a there."""
    a = Member("a", A_KEY, "10.213.0.2", "198.51.100.1:40000", ("172.31.40.46:51820", "100.64.3.4:51820"), site="fra")
    public_candidate = Member("a", A_KEY, "10.213.0.2", "198.51.100.1:40000", ("192.0.2.77:51820",))
    r_key = keypair()[0]
    elsewhere = Member("r", r_key, "10.213.0.5", "203.0.113.5:51820", site="ber")
    same_site = Member("r", r_key, "10.213.0.5", "203.0.113.5:51820", site="fra")
    same_nat = Member("r", r_key, "10.213.0.5", "198.51.100.1:40001")
    assert end_hosts(a, None, elsewhere) == end_hosts(a, None, None) == {"198.51.100.1"}
    assert end_hosts(a, "10.0.0.7:51820", elsewhere) == {"198.51.100.1", "10.0.0.7"}  # seen there: it is there
    lan = {"198.51.100.1", "172.31.40.46", "100.64.3.4"}
    assert end_hosts(a, None, same_site) == end_hosts(a, None, same_nat) == lan
    # Behind one public address but joined with another site: another datacenter's LAN (a CGNAT's shared IP).
    same_nat_elsewhere = Member("r", r_key, "10.213.0.5", "198.51.100.1:40001", site="ber")
    assert end_hosts(a, None, same_nat_elsewhere) == {"198.51.100.1"}
    assert end_hosts(public_candidate, None, elsewhere) == {"198.51.100.1", "192.0.2.77"}
    got = relayed_pairs(
        [["10.213.0.2", "10.213.0.3", RELAY_PORTS[0]]], [a, same_site, Member("b", B_KEY, "10.213.0.3")], {}, r_key
    )
    assert got[0].hosts[0] == lan


ROUTES = {
    A_HOST: Route("eth0", "10.0.0.1", "10.0.0.5"),
    B_HOST: Route("eth1", B_HOST, "192.0.2.9"),
}


def rules(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines() if "fwd ip to" in line]


def test_the_kernel_forwards_each_latched_pairs_transport_messages_both_ways():
    script = kernel_script("meshrun_relay_x", {51821: ((A_HOST, 4000), (B_HOST, 5000))}, ROUTES)
    got = rules(script)
    assert len(got) == 2
    a_to_b = next(r for r in got if r.startswith(f"ip saddr {A_HOST} "))
    # Only A's latched address and port, the pair's port, whole datagrams, WireGuard transport messages.
    for part in (
        "udp sport 4000 udp dport 51821",
        "ip frag-off & 0x3fff == 0",
        "udp length >= 40",
        "@th,64,32 0x04000000",
    ):
        assert part in a_to_b
    # Out as the relay's own address on B's route, from the pair's port, to B's latched address.
    assert a_to_b.endswith(
        "ip saddr set 192.0.2.9 udp sport set 51821 ip daddr set 198.51.100.2 udp dport set 5000"
        ' fwd ip to 198.51.100.2 device "eth1"'
    )
    b_to_a = next(r for r in got if r.startswith(f"ip saddr {B_HOST} "))
    assert b_to_a.endswith('udp dport set 4000 fwd ip to 10.0.0.1 device "eth0"')
    # Each rule sits in the chain of the device its sender's datagrams come in on.
    chains = script.split("chain ")[1:]
    assert any('device "eth0"' in c and f"ip saddr {A_HOST} " in c for c in chains)
    assert any('device "eth1"' in c and f"ip saddr {B_HOST} " in c for c in chains)
    # One transaction replaces whatever table was there.
    assert script.startswith("table netdev meshrun_relay_x {}\ndelete table netdev meshrun_relay_x\n")


def test_pairs_the_kernel_cannot_take_stay_with_the_socket():
    latched = {
        51821: ((A_HOST, 4000), ("2001:db8::1", 5000)),  # an IPv6 end
        51822: ((A_HOST, 4001), (OTHER, 5001)),  # no route known to OTHER
    }
    assert rules(kernel_script("t", latched, ROUTES)) == []
    assert "chain" not in kernel_script("t", {}, ROUTES)
