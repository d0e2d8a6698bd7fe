"""The overlay API's HTTP server: one event loop for a thousand kept-alive long-polls.

Every member's agent holds one connection to the coordinator and long-polls on it. With a thread per
connection (transport.JSONServer), a new member-list version woke a thousand threads at once, and
they fought over the GIL for seconds (a join took 4-8 s to reach every agent at 1000 members). Here
the waiting requests are entries in a table: `kick()` (after a publish) polls each of them on the
loop's own thread, and only the answers that are ready are written.

A handler is `handle(Request) -> Response | Wait`, run in a small worker pool (it may take a lock), or
with `inline` on the loop thread itself (a handler that only ever holds a lock briefly: a thousand
requests after a publish then cost no thread handoffs); a `Wait` is polled on the loop thread (it
must not block) whenever the server is kicked, and once more when its deadline passes, until it
returns a Response. The bounds are JSONServer's: a request
head over `max_head` bytes is answered 431, one not complete within `head_timeout` is closed, at
most `max_conns` connections and `max_per_source` from one address (beyond, closed unread), the
`gate` runs before a byte of the body is read, JSON bodies are capped at MAX_JSON, and a kept-alive
connection idle for `idle_timeout` seconds is closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from http import HTTPStatus

from meshrun.system.sockets.loopserver import LoopServer
from meshrun.system.sockets.transport import (
    HEAD_TIMEOUT,
    IDLE_TIMEOUT,
    MAX_HEAD,
    MAX_JSON,
    TIMEOUT,
    Gate,
    Request,
    Response,
    Wait,
    answer,
    body_length,
    make_request,
)

__all__ = ["LongPollServer"]

log = logging.getLogger("meshrun.system.sockets.longpoll")


class LongPollServer(LoopServer):
    """A plain-HTTP server on `addr` (bound to `device` if given) for `handler`; `start()` runs it on its
    own thread, `kick()` (any thread) polls every waiting request, `shutdown()` stops it."""

    def __init__(
        self,
        addr: tuple[str, int],
        handler,
        *,
        device: str | None = None,
        gate: Gate | None = None,
        max_conns: int = 4096,
        max_per_source: int = 8,
        workers: int = 4,
        inline: bool = False,
        offload=None,
        max_head: int = MAX_HEAD,
        head_timeout: float = HEAD_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        request_timeout: float = TIMEOUT,
    ) -> None:
        super().__init__(
            addr,
            device=device,
            head_limit=max_head,
            workers=workers,
            pool_name="longpoll",
            max_conns=max_conns,
            max_per_source=max_per_source,
        )
        self.handler, self.gate = handler, gate
        self.max_head, self.head_timeout, self.idle_timeout = max_head, head_timeout, idle_timeout
        self.request_timeout = request_timeout
        self.inline = inline
        # inline, but these requests (offload(req) true) go to the pool: a handler that waits on another
        # machine (the replicated store) must not hold every long-poll's loop while it does.
        self.offload = offload
        self.refused_heads = 0  # requests whose head was too large (431)
        self.waiting: dict[asyncio.Future, Wait] = {}  # requests waiting for an answer
        self._kicked = False

    def kick(self) -> None:
        """Poll every waiting request soon (thread-safe; kicks before the poll ran count once)."""
        if not self._kicked:
            self._kicked = True
            try:
                self.loop.call_soon_threadsafe(self._poll_all)
            except RuntimeError:  # the loop is closed: nothing waits any more
                pass

    def end_waits(self) -> None:
        """Answer every waiting request soon as if its wait had run out (thread-safe): the handler that
        holds them was replaced (a service restarted in the same process) and its waits would otherwise
        be held to their deadlines on the old one."""
        try:
            self.loop.call_soon_threadsafe(self._poll_all, True)
        except RuntimeError:  # the loop is closed: nothing waits any more
            pass

    # waiting requests --------------------------------------------------------
    def _poll_all(self, expired: bool = False) -> None:
        if not expired:
            self._kicked = False
        for fut, wait in list(self.waiting.items()):
            self._poll(fut, wait, expired=expired)

    def _poll(self, fut: asyncio.Future, wait: Wait, expired: bool) -> None:
        if fut.done():
            self.waiting.pop(fut, None)
            return
        try:
            resp = wait.poll(expired)
        except Exception:  # a bug must not stop the other waiters' answers
            log.exception("a waiting request's poll failed")
            resp = Response.error(500, "internal error (see the daemon log)")
        if resp is None and expired:
            resp = Response.error(500, "internal error: a wait ended without an answer")
        if resp is not None:
            self.waiting.pop(fut, None)
            fut.set_result(resp)

    async def _wait(self, wait: Wait) -> Response:
        fut = self.loop.create_future()
        self.waiting[fut] = wait
        self._poll(fut, wait, expired=False)  # a version published while the handler ran
        timer = self.loop.call_later(
            max(0.0, wait.deadline - time.monotonic()), lambda: self._poll(fut, wait, expired=True)
        )
        try:
            return await fut
        finally:
            timer.cancel()
            self.waiting.pop(fut, None)

    # one connection ----------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        ip = str(peer[0])
        if not self._admit(ip):
            writer.transport.abort()  # no read, no task beyond this one
            return
        try:
            first = True
            while await self._one(reader, writer, ip, first):
                first = False
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("connection from %s closed: %s", ip, exc.__class__.__name__)
        finally:
            self._release(ip)
            if not self.loop.is_closed():
                writer.transport.abort()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ip: str, first: bool) -> bool:
        """Serve one request; True to keep the connection for another."""
        # A kept-alive connection may sit idle before its next request; once a byte came, the head
        # has head_timeout seconds and max_head bytes, as a first request's has.
        try:
            lead = await self._within(writer, self.head_timeout if first else self.idle_timeout, reader.readexactly(1))
            rest = await self._within(writer, self.head_timeout, reader.readuntil(b"\r\n\r\n"))
        except asyncio.LimitOverrunError:
            self.refused_heads += 1
            log.warning("refused a request from %s: its head is over %d bytes", ip, self.max_head)
            await self._write(writer, Response.error(431, f"request head over {self.max_head} bytes"), False)
            return False
        except asyncio.IncompleteReadError:  # the client closed (between requests: the normal end), or timed out
            return False
        head = (lead + rest).decode("latin-1").split("\r\n")
        parts = head[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            await self._write(writer, Response.error(400, "not an HTTP request"), False)
            return False
        method, path, version = parts
        headers: dict[str, str] = {}
        for line in head[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().title()] = value.strip()
        keep = version == "HTTP/1.1" and headers.get("Connection", "").lower() != "close"
        expect = ""
        if self.gate is not None:
            head = Request(method, path, ip, headers=headers)
            refused = await self._call(self.gate, head)
            if refused is not None:  # its body is not read: the connection cannot carry another request
                await self._write(writer, refused, False)
                return False
            expect = head.expect_sha256  # the body hash the request's MAC covers (checked by the handler)
        length = body_length(headers.get("Content-Length", "0"), MAX_JSON)
        if isinstance(length, Response):
            await self._write(writer, length, False)
            return False
        raw = await self._within(writer, self.request_timeout, reader.readexactly(length)) if length else b""
        req = make_request(method, path, ip, headers, raw)
        if isinstance(req, Request):
            req.gated, req.deferrable, req.expect_sha256 = self.gate is not None, True, expect
            resp = await self._call(answer, self.handler, req, pool=self.offload is not None and self.offload(req))
            if isinstance(resp, Wait):
                resp = await self._wait(resp)
        else:
            resp = req
        await self._write(writer, resp, keep)
        return keep

    async def _call(self, fn, *args, pool: bool = False):
        """fn(*args) on the loop thread (`inline`: the handler never waits long for a lock), else in the pool."""
        if self.inline and not pool:
            return fn(*args)
        return await self.loop.run_in_executor(self.pool, fn, *args)

    async def _write(self, writer: asyncio.StreamWriter, resp: Response, keep: bool) -> None:
        if resp.stream is not None or resp.raw is not None:
            resp = Response.error(500, "internal error: this server answers JSON only")
        data = json.dumps(resp.body if resp.body is not None else {}).encode()
        try:
            reason = HTTPStatus(resp.status).phrase
        except ValueError:
            reason = ""
        head = (
            f"HTTP/1.1 {resp.status} {reason}\r\nServer: meshrun\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n"
        )
        writer.write(head.encode() + data)
        await self._within(writer, self.request_timeout, writer.drain())

    async def _within(self, writer: asyncio.StreamWriter, seconds: float, step):
        """Await `step`; past `seconds` the connection is dropped (the step then fails as a closed one).
        A timer, not asyncio.wait_for: that costs a task per step, four per request, a thousand requests
        after every publish."""
        timer = self.loop.call_later(seconds, writer.transport.abort)
        try:
            return await step
        finally:
            timer.cancel()
