"""The supervisor's liveness probe and rule against one address, for benchmarks/loss_detection.py.

    python benchmarks/liveness_probe.py IP PORT SECONDS [--until-gone]

Probes IP:PORT the way meshrun.jobs.supervisor.Supervisor._watch does (meshrun.core.liveness.Probes: overlapping
handshakes every period, a refused one counting as an answer) for SECONDS (every verdict counted, the count
starting again after each), or with --until-gone until the rule first calls the address gone, and prints one
JSON object:
probes, misses, gone_verdicts, gone_at (unix time of the first verdict, or null), round-trip percentiles.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from meshrun.core import liveness
from meshrun.system.sockets import probe


def main() -> int:
    ip, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    until_gone = "--until-gone" in sys.argv[4:]
    probes = liveness.Probes()
    rtts: list[float] = []
    sent = misses = verdicts = 0
    gone_at = None

    def one() -> tuple[bool, float]:  # what the supervisor's watch runs for a node, timing the answer too
        rtt = probe.tcp_rtt(ip, port, timeout=liveness.PROBE_TIMEOUT_S)
        if rtt is not None:
            rtts.append(rtt * 1000)
        return rtt is not None, time.monotonic()

    def settled(f):
        nonlocal misses
        if not f.done():
            return None
        answered, at = f.result()
        misses += not answered
        return answered, at

    end = time.monotonic() + seconds
    with ThreadPoolExecutor(max_workers=liveness.MAX_IN_FLIGHT) as pool:
        while time.monotonic() < end:
            now = time.monotonic()
            for name in probes.due([ip], now):
                probes.sent(name, now, pool.submit(one))
                sent += 1
            probes.settle(settled)
            if probes.gone([ip], time.monotonic()):
                verdicts += 1
                gone_at = gone_at or time.time()
                probes.seen[ip].answered()  # count each run of silence once
                if until_gone:
                    break
            time.sleep(liveness.TICK_S)
    rtts.sort()

    def pct(q: float) -> float:
        return rtts[min(len(rtts) - 1, int(q * len(rtts)))] if rtts else 0.0

    print(
        json.dumps(
            {
                "probes": sent,
                "misses": misses,
                "gone_verdicts": verdicts,
                "gone_at": gone_at,
                "p50_ms": statistics.median(rtts) if rtts else 0.0,
                "p99_ms": pct(0.99),
                "max_ms": rtts[-1] if rtts else 0.0,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
