"""meshrun.system.sockets.longpoll: long-polls held on one event loop, kicked, kept alive, bounded (loopback)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from meshrun.errors import MeshrunError
from meshrun.system.sockets.longpoll import LongPollServer
from meshrun.system.sockets.transport import Request, Response, Session, Wait


class Board:
    """A version number handlers long-poll on: POST /wait {"known": v, "wait": s} answers once the
    version differs from v (or at the deadline, unchanged); POST /bump publishes a new version."""

    def __init__(self) -> None:
        self.version = 0
        self.server: LongPollServer | None = None
        self.polls = 0

    def handle(self, req: Request) -> Response | Wait:
        body = req.body if isinstance(req.body, dict) else {}
        if req.path == "/bump":
            self.version += 1
            self.server.kick()
            return Response(200, {"version": self.version})
        if req.path == "/wait":
            known, deadline = body.get("known", 0), time.monotonic() + body.get("wait", 0)

            def poll(expired: bool) -> Response | None:
                self.polls += 1
                if self.version != known or expired:
                    return Response(200, {"version": self.version, "unchanged": self.version == known})
                return None

            first = poll(time.monotonic() >= deadline)
            return first if first is not None else Wait(deadline, poll)
        return Response.error(404, f"no such endpoint {req.path}")


@pytest.fixture
def board():
    b = Board()
    refuse = Response.error(403, "not you")
    srv = LongPollServer(
        ("127.0.0.1", 0),
        b.handle,
        gate=lambda r: refuse if r.path == "/refused" else None,
        max_per_source=4,
        idle_timeout=0.5,
        head_timeout=1.0,
    )
    b.server = srv
    srv.start()
    yield b, srv.server_address[1]
    srv.shutdown()


def _raw(port: int, data: bytes, source: str = "127.0.0.1") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_waiters_are_answered_when_kicked_with_news_and_not_before(board):
    b, port = board
    results: dict[int, tuple[float, dict]] = {}

    def waiter(i: int) -> None:
        s = Session("127.0.0.1", port)
        t0 = time.monotonic()
        results[i] = (time.monotonic() - t0, s.call("POST", "/wait", {"known": 0, "wait": 10}, timeout=15))
        s.close()

    # Three waiters and the publisher: the per-source cap (4) is just enough.
    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert results == {} and len(b.server.waiting) == 3  # all three held, none answered
    Session("127.0.0.1", port).call("POST", "/bump", {})
    for t in threads:
        t.join(5)
    assert sorted(r[1]["version"] for r in results.values()) == [1, 1, 1]
    assert not b.server.waiting


def test_a_wait_that_runs_out_is_answered_unchanged(board):
    b, port = board
    t0 = time.monotonic()
    got = Session("127.0.0.1", port).call("POST", "/wait", {"known": 0, "wait": 0.4})
    assert got == {"version": 0, "unchanged": True} and 0.35 < time.monotonic() - t0 < 3


def test_end_waits_answers_every_held_request_unchanged_at_once(board):
    b, port = board
    results: list[dict] = []

    def waiter() -> None:
        results.append(Session("127.0.0.1", port).call("POST", "/wait", {"known": 0, "wait": 30}, timeout=35))

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while len(b.server.waiting) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(b.server.waiting) == 2 and results == []
    t0 = time.monotonic()
    b.server.end_waits()
    for t in threads:
        t.join(5)
    assert results == [{"version": 0, "unchanged": True}] * 2 and time.monotonic() - t0 < 3
    assert not b.server.waiting


def test_a_thousand_waiters_on_one_thread_all_answered_by_one_kick(board):
    b, port = board
    srv = b.server
    srv.max_per_source = 2000
    socks = []
    body = json.dumps({"known": 0, "wait": 30}).encode()
    req = b"POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    for _ in range(1000):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(req)
        socks.append(s)
    deadline = time.monotonic() + 20
    while len(srv.waiting) < 1000 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(srv.waiting) == 1000
    threads_before = threading.active_count()
    Session("127.0.0.1", port).call("POST", "/bump", {})
    for s in socks:
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            data += s.recv(65536)
        assert b" 200 " in data.split(b"\r\n")[0] and b'"version": 1' in data and b"keep-alive" in data
        s.close()
    assert threading.active_count() <= threads_before + 1  # no thread per waiter


def test_one_kept_alive_connection_carries_many_requests_and_an_idle_one_is_replaced(board):
    b, port = board
    s = Session("127.0.0.1", port)
    for _ in range(5):
        s.call("POST", "/wait", {"known": -1})
    assert s.connects == 1
    time.sleep(1.0)  # past idle_timeout: the server closed it; the session opens a new one
    assert s.call("POST", "/wait", {"known": -1})["version"] == 0 and s.connects == 2
    s.close()


def test_refusals_and_bad_requests_close_the_connection(board):
    b, port = board
    s = Session("127.0.0.1", port)
    with pytest.raises(MeshrunError):
        s.call("POST", "/refused", {"x": 1})
    assert s.conn is None  # the server said close
    head = b"POST /wait HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
    assert b" 431 " in _raw(port, head).split(b"\r\n")[0] and b.server.refused_heads == 1
    big = b"POST /wait HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n"
    assert b" 413 " in _raw(port, big).split(b"\r\n")[0]
    assert b" 400 " in _raw(port, b"GARBAGE\r\n\r\n").split(b"\r\n")[0]


def test_connections_past_the_per_source_cap_are_closed_unread(board):
    b, port = board
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    time.sleep(0.2)
    extra = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert extra.recv(1) == b"" and b.server.refused == 1
    for s in (*held, extra):
        s.close()


def test_a_head_that_does_not_arrive_in_time_is_closed(board):
    b, port = board
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"POST /wait HTTP/1.1\r\n")  # and nothing more
    t0 = time.monotonic()
    assert s.recv(1) == b"" and time.monotonic() - t0 < 3
    s.close()


def test_what_the_gate_learns_from_a_requests_head_reaches_its_handler():
    """A gate that checks a MAC before the body is read (the overlay API) records the body hash the MAC covers;
    the handler, called with the request the server made once the body was in, must see it (else every signed
    request would fail its body check)."""
    from meshrun.core import auth

    key, seen = bytes(range(32)), []

    def gate(req: Request) -> Response | None:
        req.expect_sha256 = auth.Verifier(key).head(req.headers.get("Authorization"), req.method, req.path, time.time())
        return None

    def handle(req: Request) -> Response:
        seen.append(req.expect_sha256 == req.sha256())
        return Response(200, {})

    srv = LongPollServer(("127.0.0.1", 0), handle, gate=gate)
    srv.start()
    try:
        s = Session("127.0.0.1", srv.server_address[1])
        s.call("POST", "/x", {"a": 1}, key=key)
        s.close()
    finally:
        srv.shutdown()
    assert seen == [True]
