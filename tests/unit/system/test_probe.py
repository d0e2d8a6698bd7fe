"""meshrun.system.sockets.probe's TCP handshake on loopback: a listener accepts, a closed port refuses (the machine
answered, nothing listens); the reverse lookup's timing, and its limit for a resolver that never answers."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from meshrun.system.sockets import probe


def test_a_listener_accepts_and_a_closed_port_refuses_but_answers():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        rtt, accepted = probe.tcp_connect("127.0.0.1", port)
        assert accepted and rtt is not None and 0 <= rtt < 1
    rtt, accepted = probe.tcp_connect("127.0.0.1", port)  # closed now: the kernel answers with a reset
    assert not accepted and rtt is not None
    assert probe.tcp_rtt("127.0.0.1", port) is not None  # liveness counts a refusal as an answer


def test_a_reverse_lookup_is_timed_and_one_that_never_ends_is_none(monkeypatch):
    took = probe.reverse_lookup_s("127.0.0.1")  # /etc/hosts names it: no resolver asked
    assert took is not None and 0 <= took < 1
    release = threading.Event()
    monkeypatch.setattr(socket, "getnameinfo", lambda *a: release.wait(10))  # a resolver that never answers
    t0 = time.monotonic()
    assert probe.reverse_lookup_s("10.213.0.2", limit=0.2) is None
    assert time.monotonic() - t0 < 5  # the limit, not the lookup, ended the wait
    release.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_token_listener_hands_its_token_to_each_connection_until_it_closes():
    port = _free_port()
    listener = probe.TokenListener(port, b"t" * 32, seconds=30)
    try:
        assert probe.read_token("127.0.0.1", port, 32) == b"t" * 32
        assert probe.read_token("127.0.0.1", port, 32) == b"t" * 32  # a stranger first does not use it up
        with pytest.raises(OSError):  # the port is taken while it listens
            probe.TokenListener(port, b"u" * 32, seconds=1)
    finally:
        listener.close()
    with pytest.raises(OSError):  # closed: nothing accepts any more
        probe.read_token("127.0.0.1", port, 32, timeout=1)
