"""Send UDP datagrams to a member's site LAN path as a VXLAN peer would, with an inner packet of our choosing.

    python vxlan_send.py LAN_DST VNI INNER_SRC INNER_DST PORT PAYLOAD [COUNT]

The outer datagram goes from this namespace's own LAN address (the kernel's choice) to LAN_DST:51819; inside it,
an Ethernet frame between the MACs meshrun derives from the two overlay addresses, carrying an IPv4/UDP packet
INNER_SRC -> INNER_DST:PORT with PAYLOAD. A member of a trusted site uses it to try to speak as another member.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

from meshrun.core import lanpath


def checksum(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def frame(vni: int, src: str, dst: str, port: int, payload: bytes) -> bytes:
    udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
    hdr = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst)
    )
    hdr = hdr[:10] + struct.pack("!H", checksum(hdr)) + hdr[12:]
    mac = lambda ip: bytes.fromhex(lanpath.mac_for(ip).replace(":", ""))  # noqa: E731
    eth = mac(dst) + mac(src) + b"\x08\x00"
    return struct.pack("!II", 0x08000000, vni << 8) + eth + hdr + udp


def main() -> None:
    lan_dst, vni, src, dst, port, payload = sys.argv[1:7]
    count = int(sys.argv[7]) if len(sys.argv) > 7 else 3
    data = frame(int(vni), src, dst, int(port), payload.encode())
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(count):
        s.sendto(data, (lan_dst, lanpath.LAN_PORT))
        time.sleep(0.05)
    print("sent", count, flush=True)


if __name__ == "__main__":
    main()
