"""A paced TCP transfer between two nodes, for tests that break a path while bytes flow.

    tcp_transfer.py recv HOST PORT          # accept one connection, print {"bytes", "sha256", "seconds"}
    tcp_transfer.py send HOST PORT BYTES MIB_PER_S SEED   # send BYTES pseudo-random bytes at about that rate

Both print one JSON line at the end; the sender prints the sha256 of what it sent, so the test compares.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import sys
import time

CHUNK = 64 * 1024


def recv(host: str, port: int) -> None:
    srv = socket.create_server((host, port))
    srv.settimeout(120)
    conn, _ = srv.accept()
    conn.settimeout(120)
    h, n, t0 = hashlib.sha256(), 0, time.monotonic()
    while chunk := conn.recv(1 << 20):
        h.update(chunk)
        n += len(chunk)
    print(json.dumps({"bytes": n, "sha256": h.hexdigest(), "seconds": round(time.monotonic() - t0, 2)}))


def send(host: str, port: int, total: int, rate_mib: float, seed: int) -> None:
    rng = random.Random(seed)
    conn = socket.create_connection((host, port), timeout=120)
    h, sent, t0 = hashlib.sha256(), 0, time.monotonic()
    while sent < total:
        chunk = rng.randbytes(min(CHUNK, total - sent))
        conn.sendall(chunk)
        h.update(chunk)
        sent += len(chunk)
        ahead = sent / (rate_mib * 1024 * 1024) - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the receiver closes once it has everything
    print(json.dumps({"bytes": sent, "sha256": h.hexdigest(), "seconds": round(time.monotonic() - t0, 2)}))


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        recv(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
