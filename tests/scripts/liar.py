"""A member that lies to the coordinator about round trips: 0 ms to every other member, every half second.

    liar.py STATE_DIR SECONDS

Runs in the member's namespace (its sync reaches the coordinator over its own tunnel, so the coordinator
knows who sends it). The rest of its heartbeat is what its agent says (its candidates, MTU, relay setting),
so only the round trips are false. Prints {"sent", "accepted"} at the end.
"""

from __future__ import annotations

import json
import sys
import time

from meshrun.mesh import member
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import net
from meshrun.system.sockets import transport


def main(state_dir: str, seconds: float) -> None:
    state = StateDir(state_dir)
    rec, network = member.load(state)
    key = member.OverlayKeys(state).by_ip(network.coordinator_ip)  # root on its machine: it signs as its agent
    sent = accepted = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        _, members = member.load_members(state)
        rtt = {m.public_key: 0.0 for m in members if m.public_key != rec["public_key"]}
        body = {
            "candidates": (
                list(rec.get("advertised", []))
                + [f"{a}:{network.listen_port}" for a in net.local_addresses(network.interface)]
            )[:16],
            "peers": {},
            "stale": [],
            "relay": True,
            "rtt": dict(list(rtt.items())[:64]),
            "full": False,
            "mtu": int(rec.get("mtu") or network.mtu),
            "site": str(rec.get("site") or ""),
            "version": 0,
            "wait": 0,
            "delta": True,
        }
        if rtt:
            sent += 1
            try:
                transport.call(network.coordinator_ip, network.api_port, "POST", "/v1/sync", body, timeout=5, key=key)
                accepted += 1
            except Exception:  # noqa: BLE001 - a refused lie is counted, not fatal
                pass
        time.sleep(0.5)
    print(json.dumps({"sent": sent, "accepted": accepted}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
