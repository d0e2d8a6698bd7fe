"""A relay (meshrun.system.sockets.udprelay with its kernel fast path) for one test, driven over stdin.

Run inside the relay's namespace: `python relay_host.py TABLE`. Each line on stdin is a JSON command, each
answer one JSON line on stdout:
  {"pairs": [[port, key_a, key_b, [hosts_a], [hosts_b]], ...]}  -> {"failed": [ports]}   (set_pairs)
  {"stats": true}   -> {"mode": ..., "stats": {port: [forwarded, dropped]}, "kernel": {port: packets}}
  {"close": true}   -> {"closed": true}, then it exits (so does end of input)
"""

from __future__ import annotations

import json
import sys

from meshrun.core.relayfwd import RelayedPair
from meshrun.system.kernel.relaykernel import KernelPath
from meshrun.system.sockets.udprelay import UdpRelay


def main() -> None:
    kernel = KernelPath(sys.argv[1])
    relay = UdpRelay(kernel=kernel)
    print(json.dumps({"ready": True, "mode": relay.mode}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "pairs" in cmd:
            pairs = [RelayedPair(p, (a, b), (frozenset(ha), frozenset(hb))) for p, a, b, ha, hb in cmd["pairs"]]
            out: dict = {"failed": relay.set_pairs(pairs)}
        elif "stats" in cmd:
            out = {"mode": relay.mode, "stats": relay.stats(), "kernel": kernel.counters()}
        else:
            break
        print(json.dumps(out), flush=True)
    relay.close()
    print(json.dumps({"closed": True}), flush=True)


if __name__ == "__main__":
    main()
