"""Capture every packet on every interface of this network namespace (what tcpdump -i any sees) for a while.

    sniff.py SECONDS MARKER [UDP_PORT]

Prints one JSON line: {"packets", "marker" (packets whose bytes hold MARKER), "port" (UDP packets to or from
UDP_PORT), "interfaces": {name: packets}}. Needs root (AF_PACKET).
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003


def main(seconds: float, marker: bytes, port: int) -> None:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.settimeout(0.2)
    counts = {"packets": 0, "marker": 0, "port": 0}
    interfaces: dict[str, int] = {}
    end = time.monotonic() + seconds
    print("up", flush=True)
    while time.monotonic() < end:
        try:
            data, addr = sock.recvfrom(65535)
        except TimeoutError:
            continue
        counts["packets"] += 1
        interfaces[addr[0]] = interfaces.get(addr[0], 0) + 1
        if marker in data:
            counts["marker"] += 1
        # An IPv4 UDP datagram at the start (a tunnel interface) or after a 14-byte Ethernet header.
        for off in (0, 14):
            ip = data[off:]
            if len(ip) >= 28 and ip[0] >> 4 == 4 and ip[9] == 17:
                ihl = (ip[0] & 15) * 4
                src, dst = struct.unpack("!HH", ip[ihl : ihl + 4])
                if port in (src, dst):
                    counts["port"] += 1
                break
    print(json.dumps({**counts, "interfaces": interfaces}), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
