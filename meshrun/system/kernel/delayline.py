"""A WAN on a kernel without sch_netem: a process that holds each packet of an NFQUEUE for a fixed delay.

iptables sends the packets to delay to queue N (``-j NFQUEUE --queue-num N``, in the namespace that forwards
them); this process, in the same namespace, drops each with ``--loss-pct`` probability and accepts the rest
``--delay-ms`` after they arrived, in order (one batch verdict accepts every packet up to an id). GSO packets
are segmented by the kernel before they are queued. It prints ``READY`` once bound, and on SIGTERM one line
``STATS {json}`` (packets, dropped, ENOBUFS, the longest queue, its CPU seconds). meshrun.lab.wan starts it
and sets the rules; tests/vm.py and the testbed's DatacenterSpec.delay_ms use netem where the kernel has it.

    python -m meshrun.system.kernel.delayline --queue 7 --delay-ms 30 --loss-pct 0.1
"""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER, SUBSYS = 12, 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG, MSG_BATCH = 0, 1, 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 1, 4, 2


def _attr(t: int, data: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(data), t) + data + b"\0" * (-len(data) % 4)


def _msg(queue: int, kind: int, payload: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BB", 0, 0) + struct.pack("!H", queue) + payload
    return struct.pack("=IHHII", 16 + len(body), (SUBSYS << 8) | kind, flags, 0, 0) + body


def serve(queue: int, delay_ms: float, loss_pct: float) -> dict:
    """Bind NFQUEUE `queue` and delay (or drop) its packets until SIGTERM; the counters."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
    s.bind((0, 0))
    for payload in (
        _attr(1, struct.pack("!BBH", 1, 0, socket.AF_INET)),  # NFQA_CFG_CMD: bind the queue
        _attr(2, struct.pack("!IB", 128, 1)),  # NFQA_CFG_PARAMS: copy the metadata only
        _attr(3, struct.pack("!I", 200000)),  # NFQA_CFG_QUEUE_MAXLEN
    ):
        s.send(_msg(queue, MSG_CONFIG, payload, NLM_F_REQUEST | NLM_F_ACK))
        ack = s.recv(65536)
        if struct.unpack_from("=H", ack, 4)[0] == NLMSG_ERROR and (err := -struct.unpack_from("=i", ack, 16)[0]):
            raise OSError(err, f"NFQUEUE {queue} refused its configuration: {os.strerror(err)}")
    s.setblocking(False)
    delay, loss = delay_ms / 1000.0, loss_pct / 100.0
    q: collections.deque = collections.deque()
    stats = {"packets": 0, "dropped": 0, "enobufs": 0, "max_queued": 0}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("READY", flush=True)
    buf = bytearray(1 << 16)
    while not stop:
        timeout = max(0.0, q[0][0] - time.monotonic()) if q else 0.2
        try:
            select.select([s], [], [], timeout)
        except InterruptedError:
            continue
        for _ in range(4096):
            try:
                n = s.recv_into(buf)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # messages lost, not packets: a later batch verdict covers them
                    stats["enobufs"] += 1
                    continue
                raise
            now = time.monotonic()
            off = 0
            while off + 16 <= n:
                ln, typ = struct.unpack_from("=IH", buf, off)
                if ln < 16:
                    break
                if typ == (SUBSYS << 8) | MSG_PACKET:
                    p = off + 20
                    while p + 4 <= off + ln:
                        alen, atype = struct.unpack_from("=HH", buf, p)
                        if alen < 4:
                            break
                        if atype & 0x3FFF == 1:  # NFQA_PACKET_HDR: packet id first
                            pid = struct.unpack_from("!I", buf, p + 4)[0]
                            stats["packets"] += 1
                            if loss and random.random() < loss:
                                stats["dropped"] += 1
                                s.send(_msg(queue, MSG_VERDICT, _attr(2, struct.pack("!II", 0, pid))))
                            else:
                                q.append((now + delay, pid))
                            break
                        p += (alen + 3) & ~3
                off += (ln + 3) & ~3
        stats["max_queued"] = max(stats["max_queued"], len(q))
        now, last = time.monotonic(), None
        while q and q[0][0] <= now:
            last = q.popleft()[1]
        if last is not None:
            try:
                s.send(_msg(queue, MSG_BATCH, _attr(2, struct.pack("!II", 1, last))))
            except BlockingIOError:
                time.sleep(0.0005)
                s.send(_msg(queue, MSG_BATCH, _attr(2, struct.pack("!II", 1, last))))
    t = os.times()
    stats["cpu_s"] = t.user + t.system
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=0)
    p.add_argument("--loss-pct", type=float, default=0)
    a = p.parse_args(argv)
    print("STATS " + json.dumps(serve(a.queue, a.delay_ms, a.loss_pct)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
