"""A TCP server on an asyncio event loop of its own thread: the skeleton the public TLS port
(meshrun.system.sockets.frontdoor) and the overlay API (meshrun.system.sockets.longpoll) share.

The socket is bound in the caller's thread (a port in use is the caller's error, not a thread's),
optionally to one device (SO_BINDTODEVICE: an overlay API sees only what came through WireGuard).
`start()` runs the loop; `shutdown()` stops listening, cancels every connection's task and waits for
them (their handlers get no answer out), then stops the loop. Subclasses implement
`_connection(reader, writer)` and close the connection themselves.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["LoopServer"]


class LoopServer:
    """Listening socket, event loop, thread and worker pool; `_connection` is the subclass's."""

    def __init__(
        self,
        addr: tuple[str, int],
        *,
        device: str | None = None,
        head_limit: int,
        workers: int,
        pool_name: str,
        max_conns: int,
        max_per_source: int,
    ) -> None:
        self.head_limit = head_limit
        self.max_conns, self.max_per_source = max_conns, max_per_source
        self.active = 0
        self.per_source: collections.Counter[str] = collections.Counter()
        self.refused = 0  # connections closed at a cap (tests, the log)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=pool_name)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if device:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
        self.sock.bind(addr)
        self.sock.listen(1024)
        self.server_address = self.sock.getsockname()
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()  # one per open connection

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _admit(self, ip: str) -> bool:
        """Count a new connection from `ip`, or refuse it (False) at `max_conns` or `max_per_source`: the
        caller then closes it unread. An admitted connection is given back with `_release(ip)`."""
        if self.active >= self.max_conns or self.per_source[ip] >= self.max_per_source:
            self.refused += 1
            return False
        self.active += 1
        self.per_source[ip] += 1
        return True

    def _release(self, ip: str) -> None:
        self.active -= 1
        self.per_source[ip] -= 1
        if not self.per_source[ip]:
            del self.per_source[ip]

    async def _tracked(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._connection(reader, writer)
        except asyncio.CancelledError:  # shutdown
            pass
        finally:  # the subclass closed the connection as it had to (a clean TLS close lets the answer out)
            self._tasks.discard(task)  # type: ignore[arg-type]

    def start(self, name: str = "server") -> threading.Thread:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self._server = self.loop.run_until_complete(
                asyncio.start_server(self._tracked, sock=self.sock, limit=self.head_limit)
            )
            ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self._thread

    def shutdown(self) -> None:
        """Stop listening, close every connection, stop the loop."""
        if self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._close_all(), self.loop).result(5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close()

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
