"""The relay's sockets: one UDP port per relayed pair, its datagrams forwarded as they are.

What is forwarded, and what dropped, is meshrun.core.relayfwd's decision; this module only owns the sockets
and the threads. A relay (a member chosen for some pairs, or a coordinator) calls `set_pairs` with the pairs it
relays now whenever that changes: ports of pairs it no longer relays are closed at once, so the ends'
WireGuard stops reaching their peer through it, and new ports are bound (a port that cannot be bound is
logged and left out: its pair's ends find the relay down and get another one). The ports listen on every
underlay address (the ends reach a relay at whatever address they reach its WireGuard) and answer nothing:
a datagram from anyone but the pair's ends, or that is not WireGuard's, is dropped without a reply.

Each pair has a thread of its own that blocks in its socket's receive: one system call to read a datagram and
one to send it, in order, with no event loop in between (a loop that polls first pays two more calls for
every datagram when they come one at a time, which is what a relayed stream does). Measured against one
connected socket and thread per direction: slower, as the two threads then take turns on Python's lock.

Once a pair's two ends are latched, the kernel fast path (meshrun.system.kernel.relaykernel) takes their transport
messages before they reach the socket; it is told whenever an end is latched anew, when pairs change (before a
pair's socket closes, so nothing of it is forwarded after) and every REFRESH_S (routes may have moved).

`FakeRelay` (beside it) records what it was asked for, for tests of the agents.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

from meshrun.core import relayfwd
from meshrun.core.model import Member
from meshrun.core.relayfwd import PairForwarder, RelayedPair
from meshrun.errors import MeshrunError
from meshrun.system.kernel import relaykernel
from meshrun.system.kernel.device import SO_RCVBUFFORCE, SO_SNDBUFFORCE

__all__ = ["FakeRelay", "Relaying", "UdpRelay"]

log = logging.getLogger("meshrun.system.sockets.udprelay")

BUFFER = 4 << 20  # socket buffers: a burst at datacenter rates must not overflow while the thread is busy
POLL_S = 1.0  # a pair's thread looks this often whether it is to stop
PRIORITY = -10  # the forwarding thread's nice value (the agent's other threads keep theirs)
REFRESH_S = 10.0  # the kernel fast path's routes are looked up again this often


class UdpRelay:
    """Forwards the pairs' datagrams; `set_pairs` to change them, `close` to stop (idempotent). With `kernel`,
    latched pairs' transport messages are forwarded by the kernel (see the module's docstring)."""

    def __init__(
        self, bind_host: str = "0.0.0.0", kernel: relaykernel.KernelPath | relaykernel.FakeKernelPath | None = None
    ) -> None:
        self.bind_host = bind_host
        self.lock = threading.Lock()
        self.pairs: dict[int, _PairThread] = {}
        self.stopped = False
        self.kernel = kernel
        self.latched = threading.Event()  # set by a pair's thread when it latched an end anew
        self.kernel_thread: threading.Thread | None = None
        if kernel is not None:
            kernel.apply({})  # a table left by a relay that died is emptied
            self.kernel_thread = threading.Thread(target=self._keep_kernel, name="udprelay-kernel", daemon=True)
            self.kernel_thread.start()

    @property
    def mode(self) -> str:
        """How latched pairs are forwarded: relaykernel.KERNEL or USERSPACE."""
        return self.kernel.mode if self.kernel is not None else relaykernel.USERSPACE

    def ports(self) -> list[int]:
        with self.lock:
            return sorted(self.pairs)

    def stats(self) -> dict[int, tuple[int, int]]:
        """{port: (datagrams forwarded, by the socket or the kernel, datagrams dropped)}."""
        fast = self.kernel.counters() if self.kernel is not None else {}
        with self.lock:
            return {p: (t.fwd.forwarded + fast.get(p, 0), t.fwd.dropped) for p, t in self.pairs.items()}

    def set_pairs(self, pairs: Sequence[RelayedPair]) -> list[int]:
        """Forward exactly these pairs from now on; returns the ports that could not be bound."""
        failed = []
        want = {p.port: p for p in pairs}
        self._sync_kernel(keep=set(want))  # the kernel lets go of a pair before its socket does
        with self.lock:
            for port in [p for p in self.pairs if p not in want]:
                self.pairs.pop(port).close()
            for port, pair in want.items():
                have = self.pairs.get(port)
                if have is not None:
                    have.fwd.update(pair)
                    continue
                try:
                    sock = self._bind(port)
                except OSError as exc:
                    log.warning("relay port %d cannot be bound (%s): its pair is not relayed here", port, exc)
                    failed.append(port)
                    continue
                self.pairs[port] = _PairThread(port, sock, PairForwarder(pair), self.latched.set)
        self._sync_kernel()  # a pair whose ends moved (update) keeps only what is still allowed
        return failed

    def close(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.set_pairs([])
            if self.kernel is not None:
                self.latched.set()
                if self.kernel_thread is not None:
                    self.kernel_thread.join(timeout=5)
                self.kernel.close()

    def _sync_kernel(self, keep: set[int] | None = None, fresh_routes: bool = False) -> None:
        """Tell the kernel fast path the pairs latched now (only those in `keep`, when given)."""
        if self.kernel is None:
            return
        with self.lock:
            latched = {
                port: (t.fwd.addrs[0], t.fwd.addrs[1])
                for port, t in self.pairs.items()
                if None not in t.fwd.addrs and (keep is None or port in keep)
            }
        self.kernel.apply(latched, fresh_routes)  # type: ignore[arg-type]

    def _keep_kernel(self) -> None:
        while not self.stopped:
            woken = self.latched.wait(REFRESH_S)
            self.latched.clear()
            if self.stopped:
                return
            try:
                self._sync_kernel(fresh_routes=not woken)
            except Exception:  # noqa: BLE001 - the socket path goes on; the next wake-up tries again
                log.exception("relay fast path: update failed")

    def _bind(self, port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # Past net.core.[rw]mem_max where we may (root): the default cap (208 KiB) drops bursts.
            for force, opt in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, force, BUFFER)
                except OSError:
                    sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER)
            sock.bind((self.bind_host, port))
            sock.settimeout(POLL_S)
        except OSError:
            sock.close()
            raise
        return sock


class _PairThread:
    """One pair's socket and the thread that forwards what arrives on it (see the module's docstring)."""

    def __init__(self, port: int, sock: socket.socket, fwd: PairForwarder, on_latch: Callable[[], None]) -> None:
        self.port, self.sock, self.fwd, self.on_latch = port, sock, fwd, on_latch
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"udprelay-{port}", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop forwarding and let go of the port (the thread is woken: a shutdown ends its receive)."""
        self.closed.set()
        with contextlib.suppress(OSError):  # an unconnected UDP socket says ENOTCONN, and wakes its reader all the same
            self.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=POLL_S + 1)
        self.sock.close()

    def _run(self) -> None:
        # Ahead of the host's other work where we may (root): on a busy host a relay that waits for a time slice
        # delays every datagram of its pairs.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PRIORITY)
        sock, fwd = self.sock, self.fwd
        addrs = fwd.addrs
        buf = bytearray(65535)
        view = memoryview(buf)
        while not self.closed.is_set():
            try:
                n, source = sock.recvfrom_into(buf)
            except TimeoutError:
                continue
            except OSError as exc:  # an ICMP error for an earlier send, or the socket closed under us
                if self.closed.is_set():
                    return
                if exc.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    log.warning("relay port %d: %s", self.port, exc)
                continue
            # The hot path, a transport datagram between two latched ends, skips the decision's bookkeeping (the
            # same as route() decides for it: a transport message from a latched end goes to the other end).
            dest = None
            if n >= relayfwd.MIN_TRANSPORT and buf[0] == relayfwd.TRANSPORT and not any(buf[1:4]):
                if source == addrs[0]:
                    dest = addrs[1]
                elif source == addrs[1]:
                    dest = addrs[0]
            if dest is not None:
                fwd.forwarded += 1
                out: list = [(view[:n], dest)]
            else:
                before = list(addrs)
                out = fwd.route(bytes(view[:n]), source)
                if addrs != before:
                    self.on_latch()
            for data, to in out:
                try:
                    sock.sendto(data, to)
                except OSError:
                    fwd.dropped += 1  # a full buffer or a route gone: WireGuard and TCP resend


class Relaying:
    """The pairs a member (node or coordinator) relays, kept on a relay made at the first pair: what each daemon
    calls when its list may have changed. `make` makes the relay (FakeRelay in tests); by default a UdpRelay with
    the kernel fast path in the table of the member's overlay `interface`."""

    def __init__(self, make: Callable[[], UdpRelay | FakeRelay] | None = None, interface: str = "meshrun0") -> None:
        self.make = make or (lambda: UdpRelay(kernel=relaykernel.KernelPath(relaykernel.table_name(interface))))
        self.relay: UdpRelay | FakeRelay | None = None
        self.pairs: list[RelayedPair] = []

    def apply(self, listed: list[list], members: list[Member], device, me: str = "") -> bool:
        """Relay exactly `listed` ([[overlay IP, overlay IP, port], ...]); each end's datagrams may come from
        where `device` (this member's WireGuard) sees it, its entry's endpoint or its candidates (relayfwd's
        end_hosts; `me`: this member's public key, which says whether it shares an end's LAN). True when the
        pairs changed."""
        try:
            observed = {p.public_key: p.endpoint for p in device.peers()}
        except MeshrunError:
            observed = {}
        pairs = relayfwd.relayed_pairs(listed, members, observed, me)
        if pairs == self.pairs:
            return False
        if self.relay is None and pairs:
            self.relay = self.make()
        if self.relay is not None:
            failed = self.relay.set_pairs(pairs)
            if failed:
                log.warning("relay ports %s could not be bound: those pairs' ends will ask for another relay", failed)
        self.pairs = pairs
        return True

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()


class FakeRelay:
    """UdpRelay's stand-in for tests: remembers the pairs it was given, binds nothing."""

    def __init__(self) -> None:
        self.pairs: list[RelayedPair] = []
        self.calls = 0
        self.closed = False
        self.mode = relaykernel.USERSPACE

    def ports(self) -> list[int]:
        return sorted(p.port for p in self.pairs)

    def stats(self) -> dict[int, tuple[int, int]]:
        return {p.port: (0, 0) for p in self.pairs}

    def set_pairs(self, pairs: Sequence[RelayedPair]) -> list[int]:
        self.pairs = list(pairs)
        self.calls += 1
        return []

    def close(self) -> None:
        self.closed = True
