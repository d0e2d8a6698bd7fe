"""The relay's sockets (meshrun.system.sockets.udprelay) on loopback: ports opened and closed with the pairs, datagrams
forwarded between the two ends only, a port that cannot be bound reported; what its kernel fast path is told
(a FakeKernelPath: tests/e2e/test_relay_kernel_e2e.py runs the real one). Also the relay table's counters."""

from __future__ import annotations

import os
import socket
import time

import pytest
from support import wg_handshake

from meshrun.core import keys
from meshrun.core.relayfwd import RelayedPair
from meshrun.system.kernel import relaykernel
from meshrun.system.sockets.udprelay import UdpRelay

A_HOST, B_HOST, OTHER = "127.0.0.2", "127.0.0.3", "127.0.0.4"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair(port: int) -> RelayedPair:
    ka, kb = (keys.public_key(keys.generate_private_key()) for _ in range(2))
    return RelayedPair(port, (ka, kb), (frozenset({A_HOST}), frozenset({B_HOST})))


def end(host: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, 0))
    s.settimeout(2)
    return s


def data(n: int = 200) -> bytes:
    return b"\x04\0\0\0" + os.urandom(n - 4)


def handshake(p: RelayedPair, to: int, kind: int = 1) -> bytes:
    """A handshake message made for end `to`'s key: what the relay latches the other end on."""
    return wg_handshake(p.keys[to], kind)


@pytest.fixture
def relay():
    r = UdpRelay("127.0.0.1")
    yield r
    r.close()


def test_datagrams_pass_between_the_two_ends_both_ways(relay):
    port = free_port()
    p = pair(port)
    assert relay.set_pairs([p]) == [] and relay.ports() == [port]
    a, b = end(A_HOST), end(B_HOST)
    first = handshake(p, 1)
    a.sendto(first, ("127.0.0.1", port))  # b unknown yet: kept
    time.sleep(0.1)
    hello = handshake(p, 0, kind=2)
    b.sendto(hello, ("127.0.0.1", port))
    assert a.recvfrom(2048) == (hello, ("127.0.0.1", port))
    assert b.recvfrom(2048)[0] == first  # the kept one, once b was heard from
    for _ in range(50):
        d = data(1452)
        a.sendto(d, ("127.0.0.1", port))
        assert b.recvfrom(2048)[0] == d
    assert relay.stats()[port][0] >= 52


def test_a_stranger_gets_nothing_through_and_no_answer(relay):
    port = free_port()
    p = pair(port)
    relay.set_pairs([p])
    a, b, stranger = end(A_HOST), end(B_HOST), end(OTHER)
    a.sendto(handshake(p, 1), ("127.0.0.1", port))
    b.sendto(handshake(p, 0, kind=2), ("127.0.0.1", port))
    a.recvfrom(2048)
    b.recvfrom(2048)
    stranger.sendto(data(), ("127.0.0.1", port))
    stranger.settimeout(0.3)
    with pytest.raises(TimeoutError):
        stranger.recvfrom(2048)
    b.settimeout(0.3)
    with pytest.raises(TimeoutError):
        b.recvfrom(2048)
    assert relay.stats()[port][1] >= 1


def test_ports_close_with_their_pairs_and_a_busy_port_is_reported(relay):
    port, busy = free_port(), free_port()
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.bind(("127.0.0.1", busy))
    try:
        assert relay.set_pairs([pair(port), pair(busy)]) == [busy]
        assert relay.ports() == [port]
        relay.set_pairs([])
        assert relay.ports() == []
        time.sleep(0.2)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as again:
            again.bind(("127.0.0.1", port))  # the relay let go of it
    finally:
        holder.close()


def wait_for(cond, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_kernel_path_hears_of_each_latched_pair_and_lets_go_before_the_socket_closes():
    kernel = relaykernel.FakeKernelPath()
    relay = UdpRelay("127.0.0.1", kernel=kernel)
    try:
        assert kernel.calls == 1 and kernel.latched == {}  # a table left behind is emptied at the start
        port = free_port()
        p = pair(port)
        relay.set_pairs([p])
        a, b = end(A_HOST), end(B_HOST)
        a.sendto(handshake(p, 1), ("127.0.0.1", port))
        assert kernel.latched == {}  # one end known: nothing for the kernel yet
        b.sendto(handshake(p, 0, kind=2), ("127.0.0.1", port))
        a.recvfrom(2048)
        wait_for(lambda: port in kernel.latched)  # the pair's thread woke the kernel's
        assert kernel.latched[port] == ((A_HOST, a.getsockname()[1]), (B_HOST, b.getsockname()[1]))
        seen: list = []
        kernel.apply = lambda latched, fresh=False: seen.append((dict(latched), relay.ports()))
        relay.set_pairs([])
        # The first word to the kernel after the pair left is without it, while its port is still open.
        assert seen[0] == ({}, [port])
    finally:
        relay.close()
    assert kernel.closed


def test_the_relay_tables_counters_are_read_by_port():
    text = """{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"table": {"family": "netdev", "name": "t"}},
      {"rule": {"family": "netdev", "table": "t", "chain": "in0", "expr": [
        {"match": {"op": "==", "left": {"payload": {"protocol": "udp", "field": "sport"}}, "right": 4000}},
        {"match": {"op": "==", "left": {"payload": {"protocol": "udp", "field": "dport"}}, "right": 51821}},
        {"counter": {"packets": 7, "bytes": 900}}, {"fwd": {"dev": "eth0", "family": "ip", "addr": "10.0.0.1"}}]}},
      {"rule": {"family": "netdev", "table": "t", "chain": "in1", "expr": [
        {"match": {"op": "==", "left": {"payload": {"protocol": "udp", "field": "dport"}}, "right": 51821}},
        {"counter": {"packets": 5, "bytes": 700}}]}}]}"""
    assert relaykernel.kernel_counters(text) == {51821: 12}
    assert relaykernel.kernel_counters("") == {} and relaykernel.kernel_counters("Error: no such table") == {}
