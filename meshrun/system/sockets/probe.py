"""Network probes over plain sockets: path MTU towards an endpoint, ICMP echo of a given size, TCP round-trip time,
how long the resolver takes to name an address.

Path MTU: UDP datagrams with DF set (IP_PMTUDISC_DO) to the peer's WireGuard port. A router
on a smaller hop answers "fragmentation needed"; the kernel then caches the path MTU and
reports it (IP_MTU, or EMSGSIZE on the next send). WireGuard ignores the junk datagrams.
Where ICMP is filtered nothing comes back and the caller keeps its default (documented limit).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time

IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
IP_MTU = getattr(socket, "IP_MTU", 14)
IP_PMTUDISC_PROBE = getattr(socket, "IP_PMTUDISC_PROBE", 3)


def path_mtu(host: str, port: int, start: int = 1500, rounds: int = 4, wait: float = 0.15) -> int | None:
    """Underlay path MTU towards host:port as the kernel learns it, or None if it cannot tell."""
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    try:
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        s.connect((host, port))
        size = start
        for _ in range(rounds):
            try:
                s.send(b"\0" * (size - 28))  # 20 IP + 8 UDP
            except OSError as exc:
                if exc.errno not in (errno.EMSGSIZE, errno.ECONNREFUSED):  # refused: port closed, path fine
                    return None
            time.sleep(wait)
            learned = s.getsockopt(socket.IPPROTO_IP, IP_MTU)
            if learned >= size:
                continue
            size = learned
        return min(size, s.getsockopt(socket.IPPROTO_IP, IP_MTU))
    except OSError:
        return None
    finally:
        s.close()


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo(host: str, size: int, timeout: float = 1.0, tries: int = 2) -> bool | None:
    """True if an ICMP echo of `size` bytes (IP header included) with DF set gets its reply.

    DF is set and the kernel's cached path MTU ignored (IP_PMTUDISC_PROBE), so a packet that a
    hop drops without saying so (an ICMP black hole) is found lost rather than assumed to fit.
    None when this process may not send ICMP (a raw socket needs CAP_NET_RAW) or `size` exceeds the
    outgoing interface's MTU.
    """
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    except OSError:
        return None
    ident = os.getpid() & 0xFFFF
    try:
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)
        s.connect((host, 0))
        payload = os.urandom(max(0, size - 28))  # 20 IP + 8 ICMP
        for seq in range(1, tries + 1):
            head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            packet = struct.pack("!BBHHH", 8, 0, _checksum(head + payload), ident, seq) + payload
            try:
                s.send(packet)
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE:
                    return None
                raise
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                s.settimeout(left)
                try:
                    data = s.recv(65535)
                except TimeoutError:
                    break
                ihl = (data[0] & 0x0F) * 4
                kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
                if kind == 0 and rid == ident and rseq == seq and len(data) - ihl == len(packet):
                    return True
        return False
    except OSError:
        return None
    finally:
        s.close()


def tcp_connect(host: str, port: int, timeout: float = 1.0) -> tuple[float | None, bool]:
    """(seconds for one TCP handshake to host:port, whether the connection was accepted): (None, False) if no
    answer came; a refused connection answered (its time counts: the machine is there) but was not accepted
    (nothing listens on the port)."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        return time.perf_counter() - t0, False
    except OSError:
        return None, False
    return time.perf_counter() - t0, True


def marked_handshake(host: str, port: int, source: str, mark: int, timeout: float = 0.5) -> float | None:
    """Seconds for one TCP handshake to host:port from `source` with SO_MARK `mark` (policy routing picks the
    path: the site LAN path's or one tunnel's probe table); None when it did not answer. A refusal answers too."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        s.settimeout(timeout)
        s.bind((source, 0))
        t0 = time.perf_counter()
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            pass
        return time.perf_counter() - t0
    except OSError:
        return None
    finally:
        s.close()


def tcp_rtt(host: str, port: int, timeout: float = 1.0) -> float | None:
    """Seconds for one TCP handshake to host:port (a SYN/SYN-ACK round trip), None if no answer.

    A refused connection still answers, so its time counts.
    """
    return tcp_connect(host, port, timeout)[0]


def listening(host: str, port: int, timeout: float = 3.0) -> bool:
    """True when a TCP connection to host:port is accepted (something listens there)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def send_udp(host: str, port: int, payload: bytes, count: int = 3, gap: float = 0.05) -> int:
    """Send `count` datagrams to host:port from a fresh socket (an ephemeral port); returns how many left."""
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(count):
            try:
                s.sendto(payload, (host, port))
                sent += 1
            except OSError:
                pass
            if i + 1 < count:
                time.sleep(gap)
    return sent


def reverse_lookup_s(ip: str, limit: float = 6.0) -> float | None:
    """Seconds the resolver takes to look up the host name of `ip` (an answer or a failure, either way), or None
    when it had not ended after `limit` seconds (the lookup is left to end in a daemon thread).

    torch's c10d store does this lookup for each connection's own address before a rank's process group exists
    (a slow resolver: every rank's start waits for its timeout, glibc's 5 s).
    """
    done = threading.Event()

    def lookup() -> None:
        try:
            socket.getnameinfo((ip, 0), 0)
        except OSError:
            pass
        done.set()

    t0 = time.perf_counter()
    threading.Thread(target=lookup, name="reverse-lookup", daemon=True).start()
    return time.perf_counter() - t0 if done.wait(limit) else None


class TokenListener:
    """A TCP listener on every address's `port` that sends `token` to each connection, for `seconds` at most.

    What a node about to become a coordinator offers (`meshrun coordinator add`): the coordinator connects to
    the public endpoint the operator named and must read the token it gave this node over the overlay, so the
    endpoint is known to reach this machine's future enrolment port before anything changes. Anyone else who
    connects in that window learns a one-time random value and nothing more. OSError from the bind (the port
    is taken) is raised by the constructor; `close()` ends it early."""

    def __init__(self, port: int, token: bytes, seconds: float) -> None:
        self.token = token
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(("0.0.0.0", port))
            self.sock.listen(8)
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(0.2)
        self.deadline = time.monotonic() + seconds
        self.thread = threading.Thread(target=self._serve, name="token-listener", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                try:
                    conn, _ = self.sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return  # closed
                with conn:
                    conn.settimeout(1.0)
                    try:
                        conn.sendall(self.token)
                    except OSError:
                        pass
        finally:
            self.sock.close()

    def close(self) -> None:
        self.deadline = 0.0
        self.thread.join(2)


def read_token(host: str, port: int, size: int, timeout: float = 3.0) -> bytes:
    """Up to `size` bytes a TCP listener at host:port sends on connecting (b"" when it sends none before
    closing); OSError when nothing accepts the connection within `timeout`."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        got = b""
        while len(got) < size:
            chunk = s.recv(size - len(got))
            if not chunk:
                break
            got += chunk
        return got
