"""Network probes over plain sockets: path MTU towards an endpoint, and TCP round-trip time.

Path MTU: UDP datagrams with DF set (IP_PMTUDISC_DO) to the peer's WireGuard port. A router
on a smaller hop answers "fragmentation needed"; the kernel then caches the path MTU and
reports it (IP_MTU, or EMSGSIZE on the next send). WireGuard ignores the junk datagrams.
Where ICMP is filtered nothing comes back and the caller keeps its default (documented limit).
"""

from __future__ import annotations

import errno
import socket
import time

IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)
IP_MTU = getattr(socket, "IP_MTU", 14)


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
                s.send(b"\0" * (size - 28))     # 20 IP + 8 UDP
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


def tcp_rtt(host: str, port: int, timeout: float = 1.0) -> float | None:
    """Seconds for one TCP handshake to host:port (a SYN/SYN-ACK round trip), None if no answer.

    A refused connection still answers, so its time counts.
    """
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        pass
    except OSError:
        return None
    return time.perf_counter() - t0


def listening(host: str, port: int, timeout: float = 3.0) -> bool:
    """True when a TCP connection to host:port is accepted (something listens there)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
