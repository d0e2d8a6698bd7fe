"""meshrun.system.sockets.transport: JSON over HTTP(S) on loopback, pinned TLS, error mapping, NDJSON streams."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest

from meshrun.core import keys
from meshrun.errors import CoordinatorError, MeshrunError, StateError, TokenError, UsageError
from meshrun.system.sockets.frontdoor import FrontDoor
from meshrun.system.sockets.transport import (
    MAX_HEAD,
    MAX_JSON,
    JSONServer,
    Request,
    Response,
    Session,
    call,
    server_tls_context,
    stream,
)


class Recorder:
    """A handler that remembers every request it was given."""

    def __init__(self):
        self.requests: list[Request] = []

    def __call__(self, req: Request) -> Response:
        self.requests.append(req)
        if req.path == "/echo":
            return Response(
                200, {"method": req.method, "body": req.body, "raw": req.raw.decode(), "client_ip": req.client_ip}
            )
        if req.path == "/token-error":
            raise TokenError("this join token has expired", "ask for a new token")
        if req.path == "/state-error":
            return Response.error(410, StateError("this node was removed from the network", "join again"))
        if req.path == "/odd-kind":
            return Response(400, {"error": "boom", "fix": "f", "kind": "KeyError"})
        if req.path == "/not-json-error":
            return Response(502, ["no"])
        if req.path == "/list":
            return Response(200, [1, 2])
        if req.path == "/bug":
            raise RuntimeError("secret internals")
        if req.path == "/stream":
            return Response(200, stream=iter([{"i": i, "line": f"rank {i}"} for i in range(3)]))
        if req.path == "/stream-error":
            return Response.error(404, UsageError("no such job", "see `meshrun jobs`"))
        return Response.error(404, f"no such endpoint {req.method} {req.path}")


@pytest.fixture
def handler():
    return Recorder()


@pytest.fixture
def tls_files(tmp_path):
    cert, key = keys.generate_tls_identity("meshrun-test")
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    return str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), keys.cert_fingerprint(cert)


def _serve(handler, **kw):
    srv = JSONServer(("127.0.0.1", 0), handler, **kw)
    # Like srv.start(), with a short poll so that shutdown() in teardown is quick.
    threading.Thread(target=srv.serve_forever, args=(0.02,), daemon=True).start()
    return srv


@pytest.fixture
def tls_server(handler, tls_files):
    srv = FrontDoor(("127.0.0.1", 0), handler, server_tls_context(tls_files[0], tls_files[1]))
    srv.start()
    yield srv, tls_files[2]
    srv.shutdown()


@pytest.fixture
def plain_server(handler):
    srv = _serve(handler)
    yield srv
    srv.shutdown()
    srv.server_close()


def port_of(srv) -> int:
    return srv.server_address[1]


def raw_http(port: int, data: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


class TestPinnedTLS:
    def test_right_fingerprint(self, tls_server, handler):
        srv, fp = tls_server
        assert call("127.0.0.1", port_of(srv), "POST", "/echo", {"a": 1}, fingerprint=fp) == {
            "method": "POST",
            "body": {"a": 1},
            "raw": '{"a": 1}',
            "client_ip": "127.0.0.1",
        }
        assert len(handler.requests) == 1

    def test_wrong_fingerprint_never_sends_the_body(self, tls_server, handler):
        srv, fp = tls_server
        wrong = "0" * 64
        with pytest.raises(CoordinatorError) as info:
            call("127.0.0.1", port_of(srv), "POST", "/echo", {"secret": "s3cr3t"}, fingerprint=wrong)
        assert str(info.value) == (
            f"the TLS certificate at 127.0.0.1:{port_of(srv)} does not match the join "
            "token's fingerprint; make sure the token is for this coordinator; if the "
            "coordinator was re-initialised, create a new token there"
        )
        # The server is still healthy, and it never saw the request.
        call("127.0.0.1", port_of(srv), "GET", "/echo", fingerprint=fp)
        assert [r.method for r in handler.requests] == ["GET"]

    def test_plain_client_against_tls_server_fails_cleanly(self, tls_server, handler):
        srv, _ = tls_server
        with pytest.raises(CoordinatorError, match=rf"^connection to 127\.0\.0\.1:{port_of(srv)} failed during GET"):
            call("127.0.0.1", port_of(srv), "GET", "/echo", timeout=5)
        assert handler.requests == []

    def test_tls_client_against_plain_server(self, plain_server, handler):
        with pytest.raises(CoordinatorError, match=rf"^cannot reach 127\.0\.0\.1:{port_of(plain_server)} over TCP"):
            call("127.0.0.1", port_of(plain_server), "GET", "/echo", fingerprint="0" * 64, timeout=5)
        assert handler.requests == []


class TestClientErrors:
    def test_connection_refused_names_host_port(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        with pytest.raises(CoordinatorError) as info:
            call("127.0.0.1", port, "GET", "/x", timeout=5)
        assert str(info.value) == (
            f"cannot reach 127.0.0.1:{port} over TCP (Connection refused); check that the "
            f"address is right and TCP port {port} is open on that machine"
        )

    def test_named_error_class_is_re_raised(self, plain_server):
        with pytest.raises(TokenError) as info:
            call("127.0.0.1", port_of(plain_server), "POST", "/token-error", {})
        assert info.value.message == "this join token has expired"
        assert info.value.fix == "ask for a new token"
        assert info.value.status == 400

    def test_error_response_status_and_class(self, plain_server):
        with pytest.raises(StateError) as info:
            call("127.0.0.1", port_of(plain_server), "GET", "/state-error")
        assert str(info.value) == "this node was removed from the network; join again"
        assert info.value.status == 410

    def test_unknown_kind_becomes_coordinator_error(self, plain_server):
        with pytest.raises(CoordinatorError) as info:
            call("127.0.0.1", port_of(plain_server), "GET", "/odd-kind")
        assert str(info.value) == "boom; f" and info.value.status == 400

    def test_error_without_error_body(self, plain_server):
        with pytest.raises(CoordinatorError) as info:
            call("127.0.0.1", port_of(plain_server), "GET", "/not-json-error")
        assert str(info.value) == (
            f"127.0.0.1:{port_of(plain_server)} answered HTTP 502; see the daemon log on that machine"
        )

    def test_non_object_answer(self, plain_server):
        with pytest.raises(CoordinatorError, match="sent an unexpected answer"):
            call("127.0.0.1", port_of(plain_server), "GET", "/list")

    def test_handler_bug_is_500_without_internals(self, plain_server):
        # Plain-string server errors travel as kind "CoordinatorError", so callers' retry paths see them.
        with pytest.raises(CoordinatorError) as info:
            call("127.0.0.1", port_of(plain_server), "GET", "/bug")
        assert type(info.value) is CoordinatorError and info.value.status == 500
        assert str(info.value) == "internal error (see the daemon log)"
        assert "secret internals" not in str(info.value)

    def test_404(self, plain_server):
        with pytest.raises(MeshrunError, match="^no such endpoint DELETE /nope$"):
            call("127.0.0.1", port_of(plain_server), "DELETE", "/nope")

    def test_raw_upload(self, plain_server):
        got = call("127.0.0.1", port_of(plain_server), "POST", "/echo", raw=b"tarball-bytes")
        assert got["body"] is None and got["raw"] == "tarball-bytes"


class TestServerLimits:
    def test_declared_oversize_body_is_413_unread(self, plain_server, handler):
        status, body = raw_http(
            port_of(plain_server),
            b"POST /echo HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{}",
        )
        assert status == 413
        assert body == {
            "error": f"request body over {MAX_JSON} bytes or without length",
            "fix": "",
            "kind": "CoordinatorError",
        }
        assert handler.requests == []

    def test_bad_length_is_413(self, plain_server, handler):
        status, _ = raw_http(port_of(plain_server), b"POST /echo HTTP/1.0\r\nContent-Length: -5\r\n\r\n")
        assert status == 413 and handler.requests == []

    def test_absurd_length_is_413(self, plain_server, handler):
        status, _ = raw_http(
            port_of(plain_server), b"POST /echo HTTP/1.0\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n"
        )
        assert status == 413 and handler.requests == []

    def test_oversize_json_on_raw_capable_server(self, handler):
        srv = _serve(handler, max_body=4 * MAX_JSON)
        try:
            body = b'"' + b"x" * MAX_JSON + b'"'
            status, got = raw_http(
                port_of(srv),
                b"POST /echo HTTP/1.0\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body,
            )
            assert status == 413 and got["error"] == f"request body over {MAX_JSON} bytes or without length"
            # The same size as an upload is fine.
            assert call("127.0.0.1", port_of(srv), "POST", "/echo", raw=body)["raw"] == body.decode()
        finally:
            srv.shutdown()
            srv.server_close()
        assert len(handler.requests) == 1

    @pytest.mark.parametrize("payload", [b"{not json", b"\xff\xfe\xfd", b'{"a": 1'])
    def test_malformed_json_is_400(self, plain_server, handler, payload):
        status, body = raw_http(
            port_of(plain_server),
            b"POST /echo HTTP/1.0\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(payload) + payload,
        )
        assert status == 400
        assert body == {"error": "request body is not valid JSON", "fix": "", "kind": "CoordinatorError"}
        assert handler.requests == []

    def test_octet_stream_is_not_parsed(self, plain_server):
        assert call("127.0.0.1", port_of(plain_server), "POST", "/echo", raw=b"{x")["raw"] == "{x"

    def test_no_body_means_none(self, plain_server):
        assert call("127.0.0.1", port_of(plain_server), "GET", "/echo")["body"] is None


def test_start_runs_a_daemon_thread(handler):
    srv = JSONServer(("127.0.0.1", 0), handler)
    t = srv.start("meshrun-test-api")
    try:
        assert t.daemon and t.name == "meshrun-test-api"
        assert call("127.0.0.1", port_of(srv), "GET", "/echo")["method"] == "GET"
    finally:
        srv.shutdown()
        srv.server_close()


class TestStream:
    def test_yields_ndjson_lines(self, plain_server):
        got = list(stream("127.0.0.1", port_of(plain_server), "/stream", {"job": 1}))
        assert got == [{"i": 0, "line": "rank 0"}, {"i": 1, "line": "rank 1"}, {"i": 2, "line": "rank 2"}]

    def test_error_before_stream(self, plain_server):
        with pytest.raises(UsageError) as info:
            list(stream("127.0.0.1", port_of(plain_server), "/stream-error", {}))
        assert str(info.value) == "no such job; see `meshrun jobs`" and info.value.status == 404

    def test_closing_early_cancels_generator(self, handler):
        closed = threading.Event()

        def endless():
            try:
                i = 0
                while True:
                    yield {"i": i}
                    i += 1
            finally:
                closed.set()

        srv = _serve(lambda req: Response(200, stream=endless()))
        try:
            gen = stream("127.0.0.1", port_of(srv), "/x", {})
            assert next(gen) == {"i": 0}
            gen.close()
            assert closed.wait(10)
        finally:
            srv.shutdown()
            srv.server_close()


def _wait(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _connect_from(source: str, port: int) -> socket.socket:
    """A TCP connection to the server from loopback address `source` (127.0.0.0/8 is all ours)."""
    s = socket.socket()
    s.settimeout(5)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _closed_unanswered(s: socket.socket) -> bool:
    """True when the server closed `s` without a byte of answer."""
    try:
        return s.recv(64) == b""
    except ConnectionResetError:
        return True


def _get_from(source: str, port: int) -> int:
    with _connect_from(source, port) as s:
        s.sendall(b"GET /echo HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return int(reply.split()[1])


class TestConnectionCaps:
    @pytest.mark.parametrize("allow", [{"127.0.0.2"}, lambda ip: ip == "127.0.0.2"])
    def test_a_source_the_filter_refuses_is_closed_at_accept_unread(self, handler, allow):
        srv = _serve(handler, allow_source=allow)
        try:
            threads = threading.active_count()
            held = [_connect_from("127.0.0.1", port_of(srv)) for _ in range(20)]
            for s in held:
                s.sendall(b"GET /echo HTTP/1.0\r\n")  # a head that never ends, as a slow client's
            assert all(_closed_unanswered(s) for s in held)
            assert srv.refused == srv.filtered == 20 and srv.active == 0
            assert threading.active_count() <= threads  # no thread was started for any of them
            assert _get_from("127.0.0.2", port_of(srv)) == 200
            assert [r.client_ip for r in handler.requests] == ["127.0.0.2"]
        finally:
            for s in held:
                s.close()
            srv.shutdown()
            srv.server_close()

    def test_a_source_past_its_cap_is_closed_others_still_served(self, handler):
        srv = _serve(handler, max_conns=4, max_per_source=2)
        held = []
        try:
            held = [_connect_from("127.0.0.1", port_of(srv)) for _ in range(2)]
            assert _wait(lambda: srv.active == 2)
            extra = _connect_from("127.0.0.1", port_of(srv))
            held.append(extra)
            assert _closed_unanswered(extra) and srv.refused == 1 and srv.filtered == 0
            assert _get_from("127.0.0.2", port_of(srv)) == 200  # another source has slots left
            assert _wait(lambda: srv.active == 2)  # its thread gave its slot back
            held += [_connect_from("127.0.0.3", port_of(srv)) for _ in range(2)]
            assert _wait(lambda: srv.active == 4)
            last = _connect_from("127.0.0.4", port_of(srv))
            held.append(last)
            assert _closed_unanswered(last) and srv.refused == 2  # the total cap
        finally:
            for s in held:
                s.close()
            srv.shutdown()
            srv.server_close()

    def test_a_head_over_max_head_is_431_and_never_reaches_the_handler(self, plain_server, handler):
        # Each header line is far below http.server's 64 KiB, and 40 of them below its 100: 40 KiB in all.
        filler = b"".join(b"X-Fill-%d: %s\r\n" % (i, b"a" * 1000) for i in range(40))
        status, body = raw_http(port_of(plain_server), b"GET /echo HTTP/1.0\r\n" + filler + b"\r\n")
        assert status == 431 and body["error"] == f"request head over {MAX_HEAD} bytes (request line and headers)"
        status, _ = raw_http(port_of(plain_server), b"GET /" + b"a" * (MAX_HEAD + 10) + b" HTTP/1.0\r\n\r\n")
        assert status == 431  # a request line alone over the cap
        assert handler.requests == [] and plain_server.refused_heads == 2
        # A head just under the cap is served.
        small = filler[: MAX_HEAD - 200]
        small = small[: small.rindex(b"\r\n") + 2]
        status, _ = raw_http(port_of(plain_server), b"GET /echo HTTP/1.0\r\n" + small + b"\r\n")
        assert status == 200 and len(handler.requests) == 1

    def test_a_head_that_trickles_in_is_cut_off_at_head_timeout(self, handler):
        srv = _serve(handler, head_timeout=0.5)
        try:
            with _connect_from("127.0.0.1", port_of(srv)) as s:
                start = time.monotonic()
                closed = False
                for byte in b"GET /echo HTTP/1.0\r\nX-Slow: " + b"a" * 100:  # a byte every 50 ms: 5 s
                    try:
                        s.sendall(bytes([byte]))
                    except OSError:
                        closed = True
                        break
                    time.sleep(0.05)
                    if select.select([s], [], [], 0)[0] and _closed_unanswered(s):
                        closed = True
                        break
                assert closed and time.monotonic() - start < 3
            assert handler.requests == [] and _wait(lambda: srv.active == 0)
            assert call("127.0.0.1", port_of(srv), "GET", "/echo")["method"] == "GET"  # a prompt client is served
        finally:
            srv.shutdown()
            srv.server_close()


class TestKeepAlive:
    """Servers made with keep_alive=True and the client's Session: one connection for many requests."""

    @pytest.fixture
    def counted(self, handler):
        """A keep-alive server that counts the connections it accepted (and the threads it started)."""
        srv = _serve(handler, keep_alive=True, idle_timeout=0.5, gate=lambda r: refuse if r.path == "/refuse" else None)
        accepted = []
        real = srv.process_request

        def process_request(request, client_address):
            accepted.append(client_address)
            real(request, client_address)

        srv.process_request = process_request
        refuse = Response.error(403, "not you")
        yield srv, accepted
        srv.shutdown()
        srv.server_close()

    def test_many_requests_ride_one_connection(self, counted):
        srv, accepted = counted
        s = Session("127.0.0.1", port_of(srv))
        for i in range(5):
            assert s.call("POST", "/echo", {"i": i})["body"] == {"i": i}
        assert len(accepted) == 1 and s.connects == 1
        s.close()

    def test_a_connection_closed_while_idle_is_replaced_and_the_request_sent_again(self, counted):
        srv, accepted = counted
        s = Session("127.0.0.1", port_of(srv))
        assert s.call("POST", "/echo", {"i": 1})["body"] == {"i": 1}
        time.sleep(1.0)  # past idle_timeout: the server closed it
        assert s.call("POST", "/echo", {"i": 2})["body"] == {"i": 2}
        assert len(accepted) == 2 and s.connects == 2
        s.close()

    def test_a_refusal_or_a_stream_ends_the_connection(self, counted, handler):
        srv, accepted = counted
        s = Session("127.0.0.1", port_of(srv))
        with pytest.raises(MeshrunError):
            s.call("POST", "/refuse", {"x": 1})  # the gate refused it: its body was never read
        assert s.call("POST", "/echo", {"i": 3})["body"] == {"i": 3}
        assert len(accepted) == 2
        assert [x["i"] for x in stream("127.0.0.1", port_of(srv), "/stream", {})] == [0, 1, 2]
        s.close()

    def test_a_plain_server_closes_after_each_answer_and_a_session_still_works(self, plain_server):
        s = Session("127.0.0.1", port_of(plain_server))
        for i in range(3):
            assert s.call("POST", "/echo", {"i": i})["body"] == {"i": i}
        assert s.connects == 3
