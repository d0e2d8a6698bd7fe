"""HTTP(S) with JSON bodies: the servers and clients meshrun members talk with.

Servers: a threading HTTP server that does its TLS handshake in the request thread (a slow
client cannot stall accept()), optionally bound to one device (SO_BINDTODEVICE) so an
overlay API only ever sees packets that came through WireGuard. Handlers are plain
functions `handle(Request) -> Response`.

Clients: `call()` for one JSON request, `stream()` for NDJSON responses. With
`fingerprint=` the TLS certificate is pinned: the request (which may carry a token secret)
is only sent after the certificate's SHA-256 matched.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import http.client
import json
import logging
import os
import socket
import socketserver
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO

from meshrun import errors
from meshrun.core import auth
from meshrun.errors import CoordinatorError, MeshrunError

log = logging.getLogger("meshrun.system.sockets.transport")

MAX_JSON = 256 * 1024
TIMEOUT = 15
# A request's head (request line and headers): at most MAX_HEAD bytes, all of it within HEAD_TIMEOUT
# seconds, else 431 or closed. http.server alone allows 100 headers of 64 KiB each, read one slow byte
# at a time for ever: 6 MiB and a thread per connection before any check could run.
MAX_HEAD = 16 * 1024
HEAD_TIMEOUT = 10.0
# A kept-alive connection (servers made with keep_alive=True) may sit this long between a response and
# the first byte of its next request; then it is closed (the client's Session opens a new one).
IDLE_TIMEOUT = 60.0


@dataclass
class Request:
    method: str
    path: str
    client_ip: str
    body: object = None  # parsed JSON (or None)
    raw: bytes = b""  # a JSON body as it arrived (what a request MAC covers)
    headers: dict = field(default_factory=dict)
    upload: IO[bytes] | None = None  # a binary body, streamed to a spooled file (server-side uploads)
    body_sha256: str = ""  # SHA-256 of the body as read (raw or upload)
    expect_sha256: str = ""  # set by a server's gate: the hash the request's MAC covers
    gated: bool = False  # the server's gate already admitted the request
    deferrable: bool = False  # the server takes a Wait for an answer (meshrun.system.sockets.longpoll)

    def sha256(self) -> str:
        """The body's SHA-256 (computed from `raw` when the server did not stream it)."""
        return self.body_sha256 or hashlib.sha256(self.raw).hexdigest()


@dataclass
class Response:
    status: int = 200
    body: object = None
    stream: Iterator[dict] | None = None  # NDJSON lines, sent as they come
    raw: bytes | None = None  # a binary answer (files pulled from a node), sent as is

    @classmethod
    def error(cls, status: int, err: MeshrunError | str) -> Response:
        """An error answer: the error as meshrun.errors.to_wire writes it (a bare text: a CoordinatorError)."""
        return cls(status, errors.to_wire(err if isinstance(err, MeshrunError) else CoordinatorError(err)))


@dataclass
class Wait:
    """A handler's answer that is not ready yet, to a request that is `deferrable`.

    `poll(expired)` returns the Response once there is one (None: not yet). The server calls it whenever
    it is kicked (something the answer depends on may have changed) and once `deadline`
    (time.monotonic()) has passed, with expired=True, when it must answer. It runs on the server's event
    loop: it must not block."""

    deadline: float
    poll: Callable[[bool], Response | None]


Handler = Callable[[Request], Response]


class _HeadTooLarge(Exception):
    pass


class _HeadReader:
    """The connection's reader while the request head comes in: a line at a time, at most `limit` bytes in
    all (then _HeadTooLarge), all within `seconds` (then TimeoutError, which http.server answers by
    closing). Each wait for bytes is at most one recv() with the time that is left."""

    def __init__(self, rfile, sock: socket.socket, limit: int, seconds: float) -> None:
        self.rfile, self.sock = rfile, sock
        self.left = limit
        self.deadline = time.monotonic() + seconds

    def readline(self, size: int = -1) -> bytes:
        out = bytearray()
        while size < 0 or len(out) < size:
            wait = self.deadline - time.monotonic()
            if wait <= 0:
                raise TimeoutError("the request head did not arrive in time")
            self.sock.settimeout(wait)
            buffered = self.rfile.peek(1)  # what is buffered, or one recv() when nothing is
            if not buffered:
                break  # the client closed
            newline = buffered.find(b"\n")
            take = len(buffered) if newline < 0 else newline + 1
            if size >= 0:
                take = min(take, size - len(out))
            if take > self.left:
                raise _HeadTooLarge
            out += self.rfile.read(take)
            self.left -= take
            if out.endswith(b"\n"):
                break
        return bytes(out)

    def close(self) -> None:  # the handler's finish() closes whatever reader it holds
        self.rfile.close()


class _RequestHandler(BaseHTTPRequestHandler):
    server_version = "meshrun"
    sys_version = ""
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        self._timeout = self.connection.gettimeout()
        self._body_rfile = self.rfile
        self._served = 0  # requests served on this connection
        if getattr(self.server, "keep_alive", False):
            # HTTP/1.1: the connection stays open after a response unless the client says close
            # (Content-Length on every answer; a stream or a refusal closes it).
            self.protocol_version = "HTTP/1.1"

    def parse_request(self) -> bool:
        try:
            return super().parse_request()  # reads the headers through the _HeadReader
        finally:
            self.rfile = self._body_rfile  # the body is read as it always was
            self.connection.settimeout(self._timeout)

    def handle_one_request(self) -> None:
        srv = self.server
        if self._served:
            # A later request on a kept-alive connection: it may start up to IDLE_TIMEOUT from now; its
            # head then has the same limits as a first one.
            try:
                self.connection.settimeout(getattr(srv, "idle_timeout", IDLE_TIMEOUT))
                more = self._body_rfile.peek(1)
            except OSError:
                more = b""
            if not more:
                self.close_connection = True
                return
        self._served += 1
        self.rfile = _HeadReader(  # type: ignore[assignment]
            self._body_rfile,
            self.connection,
            getattr(srv, "max_head", MAX_HEAD),
            getattr(srv, "head_timeout", HEAD_TIMEOUT),
        )
        try:
            super().handle_one_request()
        except _HeadTooLarge:
            self.close_connection = True
            self.rfile = self._body_rfile
            self.connection.settimeout(self._timeout)
            srv = self.server
            if hasattr(srv, "refused_heads"):
                srv.refused_heads += 1
            limit = getattr(srv, "max_head", MAX_HEAD)
            who = srv.client_id(self.request, self.client_address)
            log.warning("refused a request from %s: its head is over %d bytes", who, limit)
            self.request_version = getattr(self, "request_version", None) or "HTTP/1.0"
            self.requestline = getattr(self, "requestline", "")
            self.command = getattr(self, "command", None)
            with contextlib.suppress(OSError):
                self._send(Response.error(431, f"request head over {limit} bytes (request line and headers)"))
            # The rest of the head is still on its way: closing on it would reset the connection, and the
            # client could lose the 431 (seen under load: ENOTCONN on the client's shutdown).
            self._drain()

    def log_message(self, fmt: str, *args) -> None:  # route through logging, never stderr
        log.debug("%s %s", self.server.client_id(self.request, self.client_address), fmt % args)

    def _handle(self) -> None:
        srv: JSONServer = self.server  # type: ignore[assignment]
        client = srv.client_id(self.request, self.client_address)
        headers = dict(self.headers)
        if srv.gate is not None:
            # Who sent it, and its MAC, before a byte of the body is read.
            head = Request(self.command, self.path, client, headers=headers)
            refused = srv.gate(head)
            if refused is not None:
                self.close_connection = True  # its body is not read: the connection cannot carry another
                self._send(refused)
                self._drain()
                return
            expect = head.expect_sha256
        else:
            expect = ""
        binary = headers.get("Content-Type", "") == "application/octet-stream"
        length = body_length(self.headers.get("Content-Length", "0"), srv.max_body if binary else MAX_JSON)
        if isinstance(length, Response):
            self.close_connection = True
            self._send(length)
            self._drain()
            return
        if binary and srv.upload_dir is not None:
            req: Request | Response = self._upload(client, headers, length)
        else:
            req = make_request(self.command, self.path, client, headers, self.rfile.read(length) if length else b"")
        if isinstance(req, Request):
            req.gated, req.expect_sha256 = srv.gate is not None, expect
            if expect and not hmac.compare_digest(expect, req.sha256()):
                req = Response.error(
                    401, errors.AuthError("the request's body is not the one it was signed with", "send it again")
                )
        try:
            self._send(req if isinstance(req, Response) else answer(srv.handler, req))
        finally:
            if isinstance(req, Request) and req.upload is not None:
                req.upload.close()

    def _upload(self, client: str, headers: dict, length: int) -> Request:
        """A binary body streamed to a spooled file (memory up to 1 MiB, then disk), hashed as it comes."""
        srv: JSONServer = self.server  # type: ignore[assignment]
        f = tempfile.SpooledTemporaryFile(max_size=1 << 20, dir=srv.upload_dir)
        h = hashlib.sha256()
        left = length
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
        f.seek(0)
        return Request(self.command, self.path, client, None, b"", headers, upload=f, body_sha256=h.hexdigest())

    def _drain(self, limit: int = 1 << 20, seconds: float = 2.0) -> None:
        """Read and drop what the client still sends (bounded), so our refusal is not lost to a reset."""
        try:
            self.request.settimeout(seconds)
            deadline = time.monotonic() + seconds
            left = limit
            while left > 0 and time.monotonic() < deadline:
                chunk = self.request.recv(min(left, 65536))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    do_GET = do_POST = do_DELETE = _handle

    def _send(self, resp: Response) -> None:
        if resp.stream is not None:
            self.close_connection = True  # no length: the end of the stream is the end of the connection
            self.send_response(resp.status)
            self.send_header("Content-Type", "application/x-ndjson")
            if self.protocol_version >= "HTTP/1.1":
                self.send_header("Connection", "close")
            self.end_headers()
            try:
                for item in resp.stream:
                    self.wfile.write(json.dumps(item).encode() + b"\n")
                    self.wfile.flush()
            except OSError:
                close = getattr(resp.stream, "close", None)
                if close:
                    close()  # GeneratorExit lets the handler cancel what it streamed
            return
        binary = resp.raw is not None
        data = resp.raw if binary else json.dumps(resp.body if resp.body is not None else {}).encode()
        self.send_response(resp.status)
        self.send_header("Content-Type", "application/octet-stream" if binary else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def body_length(header: str, max_body: int) -> int | Response:
    """The Content-Length to read, or the 413 answer to a missing, absurd or oversized one."""
    # isascii and the length cap first: int() refuses "²" and strings over 4300 digits.
    if not (header.isascii() and header.isdigit()) or len(header) > 12 or int(header) > max_body:
        return Response.error(413, f"request body over {max_body} bytes or without length")
    return int(header)


def make_request(method: str, path: str, client_ip: str, headers: dict, raw: bytes) -> Request | Response:
    """A Request from what arrived (JSON bodies parsed), or the 400/413 answer to a bad body."""
    body = None
    if raw and headers.get("Content-Type", "application/json").startswith("application/json"):
        if len(raw) > MAX_JSON:
            return Response.error(413, f"JSON body over {MAX_JSON} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return Response.error(400, "request body is not valid JSON")
    return Request(method, path, client_ip, body, raw, headers)


def answer(handler: Handler, req: Request) -> Response:
    """The handler's response; a MeshrunError becomes a 400 naming it, any other exception a bare 500."""
    try:
        return handler(req)
    except MeshrunError as exc:
        return Response.error(400, exc)
    except Exception:  # a bug must not kill the server thread silently, nor leak internals
        log.exception("handler failed for %s %s", req.method, req.path)
        return Response.error(500, "internal error (see the daemon log)")


Gate = Callable[[Request], "Response | None"]


class JSONServer(ThreadingHTTPServer):
    """Threaded plain-HTTP server, bound to `device` if given (the overlay APIs: WireGuard already
    encrypted and authenticated the traffic). The public TLS port is meshrun.system.sockets.frontdoor.

    Bounded: with `allow_source` (a set of addresses, or a function of the address) a connection from
    any other address is closed as it is accepted; then at most `max_conns` connections (a thread
    each) and `max_per_source` from one address; past either a new connection is closed at once (all
    three counted in `refused`, the first also in `filtered`). A request head (request line and
    headers) over `max_head` bytes is answered 431 (counted in `refused_heads`), one not complete
    within `head_timeout` seconds is closed. With `keep_alive` a connection carries one request after
    another (HTTP/1.1; the agents' long-polls: no TCP handshake and no new thread per sync) and is closed
    when idle for `idle_timeout` seconds. `gate(request head)` runs before the body is
    read: it returns a refusal, or admits the request (and may set `expect_sha256`, the hash its MAC
    covers, checked once the body is in). Binary bodies (application/octet-stream) may be up to
    `max_body`, streamed to a spooled file in `upload_dir` when it is given; JSON bodies are capped
    at MAX_JSON.
    """

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a burst of agents reconnecting after a long-poll
    # returned would see dropped SYNs and a 1 s retransmit each.
    request_queue_size = 1024

    def __init__(
        self,
        addr: tuple[str, int],
        handler: Handler,
        device: str | None = None,
        max_body: int = MAX_JSON,
        gate: Gate | None = None,
        max_conns: int = 1024,
        max_per_source: int = 16,
        upload_dir: str | None = None,
        allow_source: Callable[[str], bool] | Collection[str] | None = None,
        max_head: int = MAX_HEAD,
        head_timeout: float = HEAD_TIMEOUT,
        keep_alive: bool = False,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        self.handler = handler
        self.keep_alive, self.idle_timeout = keep_alive, idle_timeout
        self.device = device
        self.max_body = max_body
        self.gate = gate
        self.max_conns, self.max_per_source = max_conns, max_per_source
        self.upload_dir = upload_dir
        if allow_source is None or callable(allow_source):
            self.allow_source = allow_source
        else:
            allowed = frozenset(allow_source)
            self.allow_source = allowed.__contains__
        self.max_head, self.head_timeout = max_head, head_timeout
        self.active = 0
        self.per_source: collections.Counter[str] = collections.Counter()
        self.refused = 0  # connections closed at accept: filtered or at a cap (for tests and the log)
        self.filtered = 0  # of those, from an address `allow_source` refuses
        self.refused_heads = 0  # requests whose head was too large (431)
        self._count = threading.Lock()
        super().__init__(addr, _RequestHandler)

    def process_request(self, request, client_address) -> None:
        ip = str(client_address[0]) if isinstance(client_address, tuple) else "local"
        if self.allow_source is not None and not self.allow_source(ip):
            with self._count:
                self.refused += 1
                self.filtered += 1
            self.shutdown_request(request)  # not a byte read, no thread: nothing to spend on a stranger
            return
        with self._count:
            if self.active >= self.max_conns or self.per_source[ip] >= self.max_per_source:
                self.refused += 1
                over = True
            else:
                over = False
                self.active += 1
                self.per_source[ip] += 1
        if over:
            self.shutdown_request(request)  # no thread, no read: the cheapest answer
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(ip)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(str(client_address[0]) if isinstance(client_address, tuple) else "local")

    def _release(self, ip: str) -> None:
        with self._count:
            self.active -= 1
            self.per_source[ip] -= 1
            if self.per_source[ip] <= 0:
                del self.per_source[ip]

    def server_bind(self) -> None:
        if self.device:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, self.device.encode())
        super().server_bind()

    def finish_request(self, request, client_address) -> None:
        request.settimeout(TIMEOUT)
        super().finish_request(request, client_address)

    def client_id(self, request: socket.socket, client_address) -> str:
        """Who is calling, as handlers see it (Request.client_ip): the source address."""
        return client_address[0]

    def start(self, name: str) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        t.start()
        return t


class AdminServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A member's local admin API: HTTP on a Unix socket (0600, in the 0700 state directory).

    Handlers see the caller as "uid:N" (SO_PEERCRED), so they can refuse anyone but root even if
    the file's permissions were loosened. Nothing of it is reachable from any network.
    """

    daemon_threads = True
    max_body = MAX_JSON
    gate = None
    upload_dir = None

    def __init__(self, path: str, handler: Handler) -> None:
        self.handler = handler
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        old = os.umask(0o177)
        try:
            super().__init__(path, _RequestHandler)
        finally:
            os.umask(old)

    def client_id(self, request: socket.socket, client_address) -> str:
        _pid, uid, _gid = struct.unpack(
            "3i", request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        return f"uid:{uid}"

    def start(self, name: str) -> threading.Thread:
        return JSONServer.start(self, name)  # type: ignore[arg-type]

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.server_address)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path_ = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path_)


def call_admin(path: str, method: str, route: str, body: object = None, timeout: float = 60) -> dict:
    """One request to a member's admin socket; the JSON answer, or the error the daemon named."""
    conn = _UnixConnection(path, timeout)
    try:
        _send(conn, method, route, body, None, None)
        resp = conn.getresponse()
        payload = resp.read(16 * 1024 * 1024)
    except FileNotFoundError:
        raise CoordinatorError(
            f"the coordinator daemon does not run here ({path} is missing)", "start it with `meshrun up`"
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise CoordinatorError(
            f"the coordinator daemon did not answer on {path} ({exc})",
            "check that it runs (`meshrun status`) and its log (daemon.log)",
        ) from None
    finally:
        conn.close()
    try:
        data = json.loads(payload) if payload else {}
    except ValueError:
        raise CoordinatorError(f"{path} sent an answer that is not JSON", "is that really a meshrun daemon?") from None
    raise_for(resp.status, data, "the coordinator daemon")
    return data


def server_tls_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_path, key_path)
    return ctx


def _client_tls_context() -> ssl.SSLContext:
    # No CA: the certificate is pinned by fingerprint right after the handshake.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _connect(host: str, port: int, timeout: float, fingerprint: str | None) -> http.client.HTTPConnection:
    where = f"{host}:{port}"
    try:
        if fingerprint is None:
            conn: http.client.HTTPConnection = http.client.HTTPConnection(host, port, timeout=timeout)
            conn.connect()
            return conn
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=_client_tls_context())
        conn.connect()
    except (OSError, ssl.SSLError) as exc:
        reason = (
            "timed out"
            if isinstance(exc, (socket.timeout, TimeoutError))
            else (getattr(exc, "strerror", None) or str(exc))
        )
        raise CoordinatorError(
            f"cannot reach {where} over TCP ({reason})",
            f"check that the address is right and TCP port {port} is open on that machine",
        ) from None
    der = conn.sock.getpeercert(binary_form=True) or b""
    if not hmac.compare_digest(hashlib.sha256(der).hexdigest(), fingerprint):
        conn.close()
        raise CoordinatorError(
            f"the TLS certificate at {where} does not match the join token's fingerprint",
            "make sure the token is for this coordinator; if the coordinator was "
            "re-initialised, create a new token there",
        )
    return conn


def check_tls(host: str, port: int, fingerprint: str, timeout: float = 5.0) -> None:
    """A TLS handshake with `host`:`port` whose certificate has `fingerprint` (what a joining node checks);
    CoordinatorError saying what failed."""
    _connect(host, port, timeout, fingerprint).close()


def _send(
    conn: http.client.HTTPConnection, method: str, path: str, body: object, raw: bytes | None, key: bytes | None
) -> None:
    headers = {}
    data: bytes | None = None
    if raw is not None:
        data, headers["Content-Type"] = raw, "application/octet-stream"
    elif body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    if key is not None:
        headers["Authorization"] = auth.sign(key, method, path, data or b"", time.time())
    conn.request(method, path, body=data, headers=headers)


def raise_for(resp_status: int, data: object, where: str) -> None:
    """Raise the error an answer carries, as its own class with `status` set; nothing for a success."""
    if resp_status < 400:
        return
    if isinstance(data, dict) and "error" in data:
        raise errors.from_wire(data, status=resp_status)
    raise CoordinatorError(
        f"{where} answered HTTP {resp_status}", "see the daemon log on that machine", status=resp_status
    )


def call(
    host: str,
    port: int,
    method: str,
    path: str,
    body: object = None,
    *,
    raw: bytes | None = None,
    fingerprint: str | None = None,
    timeout: float = TIMEOUT,
    key: bytes | None = None,
) -> dict:
    """One request; returns the JSON answer or raises the error class the server named.

    With `fingerprint` the TLS certificate is pinned; with `key` the request carries a MAC
    (meshrun.core.auth) that the node's job API checks.
    """
    where = f"{host}:{port}"
    status, ctype, payload = _exchange(host, port, method, path, body, raw, fingerprint, timeout, key, 16 * 1024 * 1024)
    return _json_answer(status, payload, where)


def call_binary(
    host: str,
    port: int,
    method: str,
    path: str,
    body: object = None,
    *,
    timeout: float = TIMEOUT,
    key: bytes | None = None,
    max_bytes: int = 1 << 30,
) -> bytes:
    """One request whose answer is binary (files pulled from a node); at most `max_bytes` are read.

    An error answer (JSON) raises the error class the server named; a longer answer raises CoordinatorError.
    """
    where = f"{host}:{port}"
    status, ctype, payload = _exchange(host, port, method, path, body, None, None, timeout, key, max_bytes + 1)
    if status >= 400 or not ctype.startswith("application/octet-stream"):
        _json_answer(status, payload, where)
        raise CoordinatorError(f"{where} sent JSON where files were expected", "use the same meshrun everywhere")
    if len(payload) > max_bytes:
        raise CoordinatorError(f"{where} sent more than {max_bytes} bytes", "pull a smaller path")
    return payload


def _exchange(
    host: str,
    port: int,
    method: str,
    path: str,
    body: object,
    raw: bytes | None,
    fingerprint: str | None,
    timeout: float,
    key: bytes | None,
    max_read: int,
) -> tuple[int, str, bytes]:
    """Send one request; (status, content type, at most `max_read` bytes of the answer)."""
    where = f"{host}:{port}"
    conn = _connect(host, port, timeout, fingerprint)
    try:
        _send(conn, method, path, body, raw, key)
        resp = conn.getresponse()
        payload = resp.read(max_read)
        return resp.status, resp.getheader("Content-Type") or "", payload
    except (OSError, http.client.HTTPException) as exc:
        raise CoordinatorError(
            f"connection to {where} failed during {method} {path} ({exc})",
            "retry; if it persists check the daemon log on that machine",
        ) from None
    finally:
        conn.close()


def _json_answer(status: int, payload: bytes, where: str) -> dict:
    try:
        data = json.loads(payload) if payload else {}
    except ValueError:
        raise CoordinatorError(f"{where} sent an answer that is not JSON", "is that really a meshrun daemon?") from None
    raise_for(status, data, where)
    if not isinstance(data, dict):
        raise CoordinatorError(f"{where} sent an unexpected answer", "check that both sides run the same meshrun")
    return data


class Session:
    """JSON requests to one server over one kept-alive connection (a server made with keep_alive=True).

    The agent long-polls its coordinator through one: no TCP handshake, and no new server thread, per
    sync (a thousand agents reconnecting at once after a new member-list version queued for seconds
    behind the server's accept-and-start-a-thread loop). A connection the server closed while it sat
    idle is replaced and the request sent once more on a new one; any other failure raises as `call`
    does. Thread-safe (one request at a time)."""

    # The server closed an idle kept-alive connection before it read the request: safe to send again.
    _GONE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.conn: http.client.HTTPConnection | None = None
        self.lock = threading.Lock()
        self.connects = 0  # connections opened so far (tests: one for many requests)

    def call(
        self, method: str, path: str, body: object = None, *, timeout: float = TIMEOUT, key: bytes | None = None
    ) -> dict:
        """One request on the kept connection; the JSON answer, or the error class the server named. With `key`
        it carries a MAC (meshrun.core.auth), made again for a request sent again."""
        where = f"{self.host}:{self.port}"
        with self.lock:
            for again in (False, True):
                reused = self.conn is not None
                if self.conn is None:
                    self.conn = _connect(self.host, self.port, timeout, None)
                    self.connects += 1
                conn = self.conn
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                try:
                    _send(conn, method, path, body, None, key)
                    resp = conn.getresponse()
                    payload = resp.read(16 * 1024 * 1024)
                    if resp.will_close:
                        self.close()
                    return _json_answer(resp.status, payload, where)
                except (OSError, http.client.HTTPException) as exc:
                    self.close()
                    if reused and not again and isinstance(exc, self._GONE):
                        continue
                    raise CoordinatorError(
                        f"connection to {where} failed during {method} {path} ({exc})",
                        "retry; if it persists check the daemon log on that machine",
                    ) from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def abort(self) -> None:
        """From another thread: end the request in flight now (it raises CoordinatorError), as a server that
        went away would, but at once (the agent's coordinator stopped answering its probes)."""
        conn = self.conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def stream(
    host: str, port: int, path: str, body: object, *, timeout: float = 60, key: bytes | None = None
) -> Iterator[dict]:
    """POST and yield NDJSON objects as they arrive. Closing the generator closes the socket."""
    where = f"{host}:{port}"
    conn = _connect(host, port, timeout, None)
    try:
        _send(conn, "POST", path, body, None, key)
        resp = conn.getresponse()
        if resp.status >= 400:
            payload = resp.read(1024 * 1024)
            try:
                data = json.loads(payload)
            except ValueError:
                data = None
            raise_for(resp.status, data, where)
        for line in resp:
            if line.strip():
                yield json.loads(line)
    except (OSError, http.client.HTTPException) as exc:
        raise CoordinatorError(f"stream from {where} broke ({exc})", "see the daemon log on that machine") from None
    finally:
        conn.close()
