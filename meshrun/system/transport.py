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
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from meshrun import errors
from meshrun.core import auth
from meshrun.errors import CoordinatorError, MeshrunError

log = logging.getLogger("meshrun.system.transport")

MAX_JSON = 256 * 1024
TIMEOUT = 15


@dataclass
class Request:
    method: str
    path: str
    client_ip: str
    body: object = None          # parsed JSON (or None)
    raw: bytes = b""             # the body as it arrived (uploads; what a request MAC covers)
    headers: dict = field(default_factory=dict)


@dataclass
class Response:
    status: int = 200
    body: object = None
    stream: Iterator[dict] | None = None   # NDJSON lines, sent as they come

    @classmethod
    def error(cls, status: int, err: MeshrunError | str, kind: str = "") -> "Response":
        if isinstance(err, MeshrunError):
            return cls(status, {"error": err.message, "fix": err.fix, "kind": type(err).__name__})
        return cls(status, {"error": err, "fix": "", "kind": kind or "CoordinatorError"})


Handler = Callable[[Request], Response]


class _RequestHandler(BaseHTTPRequestHandler):
    server_version = "meshrun"
    sys_version = ""
    protocol_version = "HTTP/1.0"

    def log_message(self, fmt: str, *args) -> None:  # route through logging, never stderr
        log.debug("%s %s", self.server.client_id(self.request, self.client_address), fmt % args)

    def _handle(self) -> None:
        srv: JSONServer = self.server  # type: ignore[assignment]
        length = body_length(self.headers.get("Content-Length", "0"), srv.max_body)
        if isinstance(length, Response):
            return self._send(length)
        raw = self.rfile.read(length) if length else b""
        req = make_request(self.command, self.path, srv.client_id(self.request, self.client_address),
                           dict(self.headers), raw)
        self._send(req if isinstance(req, Response) else answer(srv.handler, req))

    do_GET = do_POST = do_DELETE = _handle

    def _send(self, resp: Response) -> None:
        if resp.stream is not None:
            self.send_response(resp.status)
            self.send_header("Content-Type", "application/x-ndjson")
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
        data = json.dumps(resp.body if resp.body is not None else {}).encode()
        self.send_response(resp.status)
        self.send_header("Content-Type", "application/json")
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


class JSONServer(ThreadingHTTPServer):
    """Threaded plain-HTTP server, bound to `device` if given (the overlay APIs: WireGuard already
    encrypted and authenticated the traffic). The public TLS port is meshrun.system.frontdoor."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a burst of agents reconnecting after a long-poll
    # returned would see dropped SYNs and a 1 s retransmit each.
    request_queue_size = 1024

    def __init__(self, addr: tuple[str, int], handler: Handler, device: str | None = None,
                 max_body: int = MAX_JSON) -> None:
        self.handler = handler
        self.device = device
        self.max_body = max_body
        super().__init__(addr, _RequestHandler)

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
        _pid, uid, _gid = struct.unpack("3i", request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 struct.calcsize("3i")))
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
        raise CoordinatorError(f"the coordinator daemon does not run here ({path} is missing)",
                               "start it with `meshrun up`") from None
    except (OSError, http.client.HTTPException) as exc:
        raise CoordinatorError(f"the coordinator daemon did not answer on {path} ({exc})",
                               "check that it runs (`meshrun status`) and its log (daemon.log)") from None
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
        reason = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else (
            getattr(exc, "strerror", None) or str(exc))
        raise CoordinatorError(f"cannot reach {where} over TCP ({reason})",
                               f"check that the address is right and TCP port {port} is open on that machine") from None
    der = conn.sock.getpeercert(binary_form=True) or b""
    if not hmac.compare_digest(hashlib.sha256(der).hexdigest(), fingerprint):
        conn.close()
        raise CoordinatorError(f"the TLS certificate at {where} does not match the join token's fingerprint",
                               "make sure the token is for this coordinator; if the coordinator was "
                               "re-initialised, create a new token there")
    return conn


def _send(conn: http.client.HTTPConnection, method: str, path: str, body: object, raw: bytes | None,
          key: bytes | None) -> None:
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
    if resp_status < 400:
        return
    if isinstance(data, dict) and "error" in data:
        cls = getattr(errors, str(data.get("kind")), None)
        if not (isinstance(cls, type) and issubclass(cls, MeshrunError)):
            cls = CoordinatorError
        err = cls(str(data["error"]), str(data.get("fix", "")))
        err.status = resp_status  # type: ignore[attr-defined]
        raise err
    raise CoordinatorError(f"{where} answered HTTP {resp_status}", "see the daemon log on that machine")


def call(host: str, port: int, method: str, path: str, body: object = None, *, raw: bytes | None = None,
         fingerprint: str | None = None, timeout: float = TIMEOUT, key: bytes | None = None) -> dict:
    """One request; returns the JSON answer or raises the error class the server named.

    With `fingerprint` the TLS certificate is pinned; with `key` the request carries a MAC
    (meshrun.core.auth) that the node's job API checks.
    """
    where = f"{host}:{port}"
    conn = _connect(host, port, timeout, fingerprint)
    try:
        _send(conn, method, path, body, raw, key)
        resp = conn.getresponse()
        payload = resp.read(16 * 1024 * 1024)
    except (OSError, http.client.HTTPException) as exc:
        raise CoordinatorError(f"connection to {where} failed during {method} {path} ({exc})",
                               "retry; if it persists check the daemon log on that machine") from None
    finally:
        conn.close()
    try:
        data = json.loads(payload) if payload else {}
    except ValueError:
        raise CoordinatorError(f"{where} sent an answer that is not JSON", "is that really a meshrun daemon?") from None
    raise_for(resp.status, data, where)
    if not isinstance(data, dict):
        raise CoordinatorError(f"{where} sent an unexpected answer", "check that both sides run the same meshrun")
    return data


def stream(host: str, port: int, path: str, body: object, *, timeout: float = 60,
           key: bytes | None = None) -> Iterator[dict]:
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
