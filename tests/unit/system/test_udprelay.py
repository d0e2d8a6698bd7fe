"""The relay's sockets (meshrun.system.udprelay) on loopback: ports opened and closed with the pairs, datagrams
forwarded between the two ends only, a port that cannot be bound reported."""

from __future__ import annotations

import os
import socket
import time

import pytest

from meshrun.core import keys
from meshrun.core.relayfwd import RelayedPair
from meshrun.system.udprelay import UdpRelay

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


@pytest.fixture
def relay():
    r = UdpRelay("127.0.0.1")
    yield r
    r.close()


def test_datagrams_pass_between_the_two_ends_both_ways(relay):
    port = free_port()
    assert relay.set_pairs([pair(port)]) == [] and relay.ports() == [port]
    a, b = end(A_HOST), end(B_HOST)
    first = data()
    a.sendto(first, ("127.0.0.1", port))  # b unknown yet: kept
    time.sleep(0.1)
    hello = data()
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
    relay.set_pairs([pair(port)])
    a, b, stranger = end(A_HOST), end(B_HOST), end(OTHER)
    a.sendto(data(), ("127.0.0.1", port))
    b.sendto(data(), ("127.0.0.1", port))
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
