"""TCP measurements between two overlay addresses: a ping-pong round trip and a bulk transfer.

The server side (`PairServer`) and the client side (`tcp_rtt_ms`, `tcp_bandwidth`) of
`meshrun bench`'s pair tests; stdlib only.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time

from meshrun.system.kernel import lanlink

CHUNK = 256 * 1024
PINGS = 10


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return buf


class PairServer:
    """TCP server for the pair tests: 'P' echoes 1-byte pings, 'S' sinks data and reports bytes/seconds."""

    def __init__(self, host: str, device: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        device = lanlink.bind_device(device)
        if device:  # only packets that came through the overlay interface reach it (or the site LAN path's)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mode = _recv_exact(conn, 1)
            if mode == b"P":
                while True:
                    b = conn.recv(1)
                    if not b:
                        return
                    conn.sendall(b)
            elif mode == b"S":
                total, first, last = 0, None, None
                while True:
                    n = conn.recv_into(memoryview(bytearray(CHUNK)))
                    if not n:
                        break
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    total += n
                secs = (last - first) if first is not None and last is not None else 0.0
                conn.sendall(struct.pack("!Qd", total, secs))
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stopped = True
        self.sock.close()


def tcp_rtt_ms(host: str, port: int, count: int = PINGS, timeout: float = 10) -> float:
    """Median round trip of a 1-byte TCP ping-pong, in milliseconds (first exchange not counted)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"P")
        times = []
        for _ in range(count + 1):
            t0 = time.perf_counter()
            s.sendall(b"x")
            _recv_exact(s, 1)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def tcp_bandwidth(host: str, port: int, duration: float, streams: int = 1, timeout: float = 30) -> dict:
    """Push data to host:port over `streams` connections for `duration` s; the receiver's view.

    Returns {"bytes", "seconds", "mbit_s"}: total bytes over the longest receiving time.
    """
    payload = b"\0" * CHUNK
    results: list[tuple[int, float]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(streams)

    def one() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout) as s:
                s.sendall(b"S")
                start.wait()
                end = time.perf_counter() + duration
                while time.perf_counter() < end:
                    s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                total, secs = struct.unpack("!Qd", _recv_exact(s, 16))
                results.append((total, secs))
        except (OSError, threading.BrokenBarrierError) as exc:
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    total = sum(r[0] for r in results)
    secs = max(r[1] for r in results) or 1e-9
    return {"bytes": total, "seconds": secs, "mbit_s": total * 8 / secs / 1e6}
