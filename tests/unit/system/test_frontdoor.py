"""meshrun.system.sockets.frontdoor: the public TLS listener keeps serving other sources under a flood.

Loopback only: the flood comes from 127.0.0.1, the legitimate client from 127.0.0.2 (the whole
127/8 is local on Linux), so per-source caps can be seen working.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import ssl
import sys
import threading
import time

import pytest

from meshrun.core import keys
from meshrun.system.sockets.frontdoor import FrontDoor
from meshrun.system.sockets.transport import Response, server_tls_context


@pytest.fixture
def door(tmp_path):
    cert, key = keys.generate_tls_identity("meshrun-test")
    (tmp_path / "c").write_bytes(cert)
    (tmp_path / "k").write_bytes(key)
    srv = FrontDoor(
        ("127.0.0.1", 0),
        lambda req: Response(200, {"ip": req.client_ip, "body": req.body}),
        server_tls_context(str(tmp_path / "c"), str(tmp_path / "k")),
        max_conns=64,
        max_per_source=4,
        handshake_s=0.5,
        request_s=1.0,
    )
    srv.start()
    srv.addr = ("127.0.0.1", srv.server_address[1])
    yield srv
    srv.shutdown()


def tls_post(addr, source: str, body: dict, timeout: float = 5) -> tuple[int, dict]:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    conn = http.client.HTTPSConnection(*addr, timeout=timeout, context=ctx, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/join", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def idle(addr, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(addr)
        socks.append(s)
    return socks


def test_a_request_is_answered_over_tls(door):
    assert tls_post(door.addr, "127.0.0.2", {"a": 1}) == (200, {"ip": "127.0.0.2", "body": {"a": 1}})


def test_idle_connections_from_one_source_do_not_lock_out_another(door):
    socks = idle(door.addr, 100)
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        assert tls_post(door.addr, "127.0.0.2", {"a": 2})[0] == 200
        assert time.monotonic() - t0 < 2
        assert door.refused >= 100 - 4  # all but the source's 4 slots closed before any TLS
        # The other source's connection is released just after its answer was sent: give it a moment.
        deadline = time.monotonic() + 2
        while door.active > 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert door.active <= 4
    finally:
        for s in socks:
            s.close()


def test_a_silent_connection_is_dropped_after_the_handshake_deadline(door):
    (s,) = idle(door.addr, 1)
    try:
        s.settimeout(5)
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the server
        assert time.monotonic() - t0 < 3
    finally:
        s.close()


def test_garbage_handshakes_and_threads_stay_bounded(door):
    threads_before = threading.active_count()
    stop = time.monotonic() + 2

    def spray():
        while time.monotonic() < stop:
            with socket.create_connection(door.addr) as s:
                s.sendall(os.urandom(300))
                s.settimeout(1)
                try:
                    s.recv(100)
                except OSError:
                    pass

    sprayers = [threading.Thread(target=spray) for _ in range(4)]
    for t in sprayers:
        t.start()
    try:
        assert tls_post(door.addr, "127.0.0.2", {"a": 3})[0] == 200
        # the server's own threads: its loop and at most its pool, whatever arrives
        assert threading.active_count() - threads_before - len(sprayers) <= 4
    finally:
        for t in sprayers:
            t.join()


def test_oversized_and_broken_requests_get_an_answer_not_a_crash(door):
    status, body = tls_post(door.addr, "127.0.0.2", {"x": "y" * (300 * 1024)})
    assert status == 413
    assert tls_post(door.addr, "127.0.0.2", {"a": 4})[0] == 200


def _close_notify_after_request(addr) -> None:
    """A client that sends a whole request, then its TLS close_notify before reading: the server sees
    the end of the stream while the connection is still up (what many clients do after a request)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    raw = socket.create_connection(addr, timeout=5)
    tls = ctx.wrap_socket(raw)
    body = b"{}"
    tls.sendall(b"POST /x HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n" + body)
    try:
        tls.unwrap()
    except (OSError, ssl.SSLError):
        pass
    time.sleep(0.3)
    raw.close()


def test_a_client_closing_first_leaves_no_warning_in_the_log(door, caplog, monkeypatch):
    from meshrun.system.sockets import frontdoor

    noise = [f for f in logging.getLogger("asyncio").filters if isinstance(f, frontdoor._DropEofNoise)]
    assert noise, "the filter is installed when the module is imported"

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "asyncio"]

    # The filter drops exactly that message and nothing else asyncio says.
    drop = frontdoor._DropEofNoise()
    record = logging.LogRecord("asyncio", logging.WARNING, __file__, 1, frontdoor.EOF_NOISE, None, None)
    other = logging.LogRecord("asyncio", logging.WARNING, __file__, 1, "Task was destroyed", None, None)
    assert not drop.filter(record) and drop.filter(other)

    with caplog.at_level(logging.WARNING):
        if sys.version_info >= (3, 11):
            # Negative control: without the filter, asyncio's warning is what such a client leaves
            # (Python 3.10's asyncio does not log it at all).
            monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
            _close_notify_after_request(door.addr)
            time.sleep(0.3)
            assert frontdoor.EOF_NOISE in warnings()
            caplog.clear()
            monkeypatch.undo()
        for _ in range(3):
            _close_notify_after_request(door.addr)
        time.sleep(0.3)
        assert warnings() == []
