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

import hashlib
import hmac
import http.client
import json
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from meshrun import errors
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
    raw: bytes = b""             # the raw body for application/octet-stream uploads
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
        log.debug("%s %s", self.client_address[0], fmt % args)

    def _handle(self) -> None:
        srv: JSONServer = self.server  # type: ignore[assignment]
        length = self.headers.get("Content-Length", "0")
        # isascii and the length cap first: int() refuses "²" and strings over 4300 digits.
        if not (length.isascii() and length.isdigit()) or len(length) > 12 or int(length) > srv.max_body:
            return self._send(Response.error(413, f"request body over {srv.max_body} bytes or without length"))
        raw = self.rfile.read(int(length)) if int(length) else b""
        body = None
        if raw and self.headers.get("Content-Type", "application/json").startswith("application/json"):
            if int(length) > MAX_JSON:
                return self._send(Response.error(413, f"JSON body over {MAX_JSON} bytes"))
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                return self._send(Response.error(400, "request body is not valid JSON"))
            raw = b""
        req = Request(self.command, self.path, self.client_address[0], body, raw, dict(self.headers))
        try:
            resp = srv.handler(req)
        except MeshrunError as exc:
            resp = Response.error(400, exc)
        except Exception:  # a bug must not kill the server thread silently, nor leak internals
            log.exception("handler failed for %s %s", self.command, self.path)
            resp = Response.error(500, "internal error (see the daemon log)")
        self._send(resp)

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


class JSONServer(ThreadingHTTPServer):
    """Threaded HTTP server; TLS if `ssl_context`, bound to `device` if given."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a burst of agents reconnecting after a long-poll
    # returned would see dropped SYNs and a 1 s retransmit each.
    request_queue_size = 1024

    def __init__(self, addr: tuple[str, int], handler: Handler, ssl_context: ssl.SSLContext | None = None,
                 device: str | None = None, max_body: int = MAX_JSON) -> None:
        self.handler = handler
        self.ssl_context = ssl_context
        self.device = device
        self.max_body = max_body
        super().__init__(addr, _RequestHandler)

    def server_bind(self) -> None:
        if self.device:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, self.device.encode())
        super().server_bind()

    def finish_request(self, request, client_address) -> None:
        request.settimeout(TIMEOUT)
        if self.ssl_context is not None:
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.debug("TLS handshake with %s failed: %s", client_address[0], exc)
                return
        super().finish_request(request, client_address)

    def start(self, name: str) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        t.start()
        return t


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


def _send(conn: http.client.HTTPConnection, method: str, path: str, body: object, raw: bytes | None) -> None:
    if raw is not None:
        conn.request(method, path, body=raw, headers={"Content-Type": "application/octet-stream"})
    elif body is not None:
        conn.request(method, path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    else:
        conn.request(method, path)


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
         fingerprint: str | None = None, timeout: float = TIMEOUT) -> dict:
    """One request; returns the JSON answer or raises the error class the server named."""
    where = f"{host}:{port}"
    conn = _connect(host, port, timeout, fingerprint)
    try:
        _send(conn, method, path, body, raw)
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


def stream(host: str, port: int, path: str, body: object, *, timeout: float = 60) -> Iterator[dict]:
    """POST and yield NDJSON objects as they arrive. Closing the generator closes the socket."""
    where = f"{host}:{port}"
    conn = _connect(host, port, timeout, None)
    try:
        _send(conn, "POST", path, body, None)
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
