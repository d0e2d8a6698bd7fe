"""meshrun.system.sockets.probe's TCP handshake on loopback: a listener accepts, a closed port refuses (the machine
answered, nothing listens)."""

from __future__ import annotations

import socket

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
