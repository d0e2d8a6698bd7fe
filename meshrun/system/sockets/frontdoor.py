"""The coordinator's public TLS listener (enrolment), built to keep serving under abuse.

Every connection is counted before its TLS handshake starts: past `max_conns` in all, or
`max_per_source` from one address, a new connection is closed at once, before any cryptography
runs. The handshake must finish within `handshake_s` and the whole request arrive within
`request_s`. TLS and HTTP parsing run on one asyncio thread (an idle connection costs a socket
and a few kilobytes, no thread); handlers run on a pool of `workers` threads. So threads and
memory stay bounded whatever arrives, and a legitimate join from another address always finds a
free slot.

Requests are HTTP/1.0 with JSON bodies; handlers are the same `handle(Request) -> Response`
functions as meshrun.system.sockets.transport's servers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from http import HTTPStatus

from meshrun.system.sockets.loopserver import LoopServer
from meshrun.system.sockets.transport import MAX_JSON, Handler, Response, answer, body_length, make_request

log = logging.getLogger("meshrun.system.sockets.frontdoor")

HEAD_LIMIT = 16 * 1024  # request line + headers
EOF_NOISE = "returning true from eof_received() has no effect when using ssl"


class _DropEofNoise(logging.Filter):
    """Drops asyncio's warning, logged for every client that closes first, that the stream protocol's
    eof_received() returned true under TLS: the protocol was made for the plain TCP connection that
    `start_tls` upgrades (counting and refusing run before any cryptography), and the warning means
    nothing for it. Unfiltered, it was a daemon.log line per enrolment."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != EOF_NOISE


_ASYNCIO_LOG = logging.getLogger("asyncio")
if not any(isinstance(f, _DropEofNoise) for f in _ASYNCIO_LOG.filters):
    _ASYNCIO_LOG.addFilter(_DropEofNoise())


class FrontDoor(LoopServer):
    """A TLS HTTP server on `addr` for `handler`; `start()` runs it on its own thread."""

    def __init__(
        self,
        addr: tuple[str, int],
        handler: Handler,
        ssl_context: ssl.SSLContext,
        *,
        max_conns: int = 256,
        max_per_source: int = 8,
        handshake_s: float = 5.0,
        request_s: float = 10.0,
        workers: int = 4,
        max_body: int = MAX_JSON,
    ) -> None:
        super().__init__(
            addr,
            head_limit=HEAD_LIMIT,
            workers=workers,
            pool_name="frontdoor",
            max_conns=max_conns,
            max_per_source=max_per_source,
        )
        self.handler = handler
        self.ssl_context = ssl_context
        self.handshake_s, self.request_s = handshake_s, request_s
        self.max_body = max_body

    # ------------------------------------------------------------------ one connection
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        ip = peer[0]
        if not self._admit(ip):
            writer.transport.abort()  # before the TLS handshake: an attacker's cheapest move costs us least
            return
        transport = writer.transport
        answered = False
        try:
            transport = await self.loop.start_tls(
                transport,
                transport.get_protocol(),
                self.ssl_context,
                server_side=True,
                ssl_handshake_timeout=self.handshake_s,
            )
            tls_writer = asyncio.StreamWriter(transport, transport.get_protocol(), reader, self.loop)
            resp = await asyncio.wait_for(self._request(reader, ip), self.request_s)
            tls_writer.write(_encode(resp))
            await asyncio.wait_for(tls_writer.drain(), self.request_s)
            answered = True
        except (
            asyncio.TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            ssl.SSLError,
            OSError,
            ValueError,
        ) as exc:
            log.debug("connection from %s dropped: %s", ip, exc.__class__.__name__)
        finally:
            self._release(ip)
            # A clean close lets the answer reach the client; anything else is dropped at once, so a
            # misbehaving peer cannot keep a TLS shutdown pending.
            if answered:
                transport.close()
            else:
                transport.abort()

    async def _request(self, reader: asyncio.StreamReader, ip: str) -> Response:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        parts = head[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return Response.error(400, "not an HTTP request")
        headers = {}
        for line in head[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().title()] = value.strip()
        length = body_length(headers.get("Content-Length", "0"), self.max_body)
        if isinstance(length, Response):
            await self._discard(reader, headers.get("Content-Length", ""))
            return length
        raw = await reader.readexactly(length) if length else b""
        req = make_request(parts[0], parts[1], ip, headers, raw)
        if isinstance(req, Response):
            return req
        return await self.loop.run_in_executor(self.pool, answer, self.handler, req)

    async def _discard(self, reader: asyncio.StreamReader, declared: str) -> None:
        """Read (and drop) a body too large to accept, up to 4 x max_body, so the client can read
        our 413 instead of a reset; a larger declared body just gets the connection closed."""
        if declared.isascii() and declared.isdigit() and len(declared) <= 12 and int(declared) <= 4 * self.max_body:
            await reader.readexactly(int(declared))


def _encode(resp: Response) -> bytes:
    data = json.dumps(resp.body if resp.body is not None else {}).encode()
    try:
        reason = HTTPStatus(resp.status).phrase
    except ValueError:
        reason = ""
    head = (
        f"HTTP/1.0 {resp.status} {reason}\r\nServer: meshrun\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data
