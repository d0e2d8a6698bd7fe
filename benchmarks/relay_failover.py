"""A peer relay lost: seconds until the pair it relayed is on another relay, and until its packets flow again.

Protocol (fixed before the run): the relay tests' world, nothing shaped: hq (the coordinator), dca and dcb
(one-to-one NAT, members that may relay), dcc and dcd (symmetric NAT: their pair can only be relayed).
Each round, with a ping every 0.1 s running from dcc to dcd over the overlay, the member relaying the pair
loses its uplink (every packet in and out of its interface dropped, as a dead uplink or a host gone), and
the benchmark records, from that moment: `moved`, when the coordinator's database names another relay for
the pair; `flowing`, the first ping answered after the cut. Then the uplink comes back, and the next round
cuts whichever member relays then, 125 s later (a relay that failed a pair is avoided for it for 120 s). Target
(issue 35: relays forward end-to-end encrypted datagrams, and failover keeps its figure): packets flow
again within 10 s of the cut in every round. 5 rounds.

    sudo .venv/bin/python benchmarks/relay_failover.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec, World
from meshrun.mesh.coordinator.pairs import AVOID_S

ROOT = Path(__file__).resolve().parent.parent
NODES = ["dca-a", "dcb-a", "dcc-a", "dcd-a"]
PAIR = ("dcc-a", "dcd-a")
TARGET_S = 10.0
# Between a round's restore and the next cut: a relay that failed a pair is not chosen for it again for AVOID_S
# (a pair the coordinator took over goes back to a member then), so each round's cut finds the pair on a member.
RESTORED_S = AVOID_S + 5


def settled(mesh: Mesh, timeout: float = 120) -> str:
    """Once every pair is decided (verified direct, or relayed) and the symmetric pair's relay is a member:
    that member's name."""
    deadline = time.monotonic() + timeout
    while True:
        pairs = {frozenset((p["a"], p["b"])): p for p in mesh.status("hq-a").get("pairs", [])}
        relay = mesh.relay_of(*PAIR)
        if (
            len(pairs) == 6
            and all(p["verified"] or p["path"] == "relayed" for p in pairs.values())
            and relay in ("dca-a", "dcb-a")
        ):
            return relay
        if time.monotonic() > deadline:
            raise SystemExit(f"paths did not settle (relay {relay}): {pairs}")
        time.sleep(1)


def one_round(mesh: Mesh, relay: str, wait: float = 30) -> dict:
    """Cut `relay`'s uplink under a running ping; returns {"relay", "moved_to", "moved_s", "flowing_s"}."""
    world = mesh.world
    dst = mesh.overlay_ip(PAIR[1])
    mesh.wait_ping(PAIR[0], dst, timeout=60)  # the pair carries packets through `relay` before it is cut
    pinger = world.node(PAIR[0]).popen("ping", "-D", "-n", "-i", "0.1", "-W", "1", dst, stdout=-1, text=True)
    moved_to, moved = None, None
    try:
        time.sleep(2)  # replies before the cut: the pair works through `relay`
        cut_wall, cut_at = time.time(), time.monotonic()
        world.node(relay).cut_uplink()
        while time.monotonic() - cut_at < wait:
            now = mesh.relay_of(*PAIR)
            if moved is None and now not in (relay, None):
                moved_to, moved = now, time.monotonic() - cut_at
            if moved is not None and time.monotonic() - cut_at > moved + 3:
                break  # a few seconds of pings on the new relay
            time.sleep(0.1)
    finally:
        pinger.terminate()
        out = pinger.communicate(timeout=10)[0]
        world.node(relay).cut_uplink(restore=True)
    replies = [float(m.group(1)) for m in re.finditer(r"^\[(\d+\.\d+)\] \d+ bytes from", out, re.M)]
    before = [t for t in replies if t < cut_wall]
    after = [t for t in replies if t >= cut_wall + 0.05]  # one in flight at the cut may still land
    if not before:
        raise SystemExit(f"no ping through {relay} answered before the cut:\n{out[-1500:]}")
    return {
        "relay": relay,
        "moved_to": moved_to,
        "moved_s": moved,
        "flowing_s": (after[0] - cut_wall) if after else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="relay_failover")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import join_all, need_root, prefix, spread, verdict, write_result

    need_root()
    t_start = time.monotonic()
    dcs = [
        DatacenterSpec("hq"),
        DatacenterSpec("dca"),
        DatacenterSpec("dcb"),
        DatacenterSpec("dcc", nat="symmetric"),
        DatacenterSpec("dcd", nat="symmetric"),
    ]
    rounds = []
    with World(dcs, prefix=prefix("rfo")) as world:
        world.up()
        mesh = Mesh(world, "hq-a")
        mesh.init()
        join_all(mesh, NODES)
        for r in range(a.rounds):
            if r:
                time.sleep(RESTORED_S)  # see RESTORED_S
            relay = settled(mesh)
            rounds.append(one_round(mesh, relay))
            print(f"round {r + 1}: {rounds[-1]}", flush=True)
    flowing = [x["flowing_s"] for x in rounds]
    moved = [x["moved_s"] for x in rounds]
    if any(v is None for v in flowing + moved):
        raise SystemExit(f"a round never moved or never flowed again: {rounds}")
    f, m = spread(flowing), spread(moved)
    met = f["max"] < TARGET_S
    summary = (
        f"relay_failover: a member relay's uplink cut, packets flow again after {f['median']:.1f} s "
        f"({f['min']:.1f}-{f['max']:.1f}; {verdict(met)}: < {TARGET_S:.0f} s in every round), the pair on another "
        f"relay after {m['median']:.1f} s ({m['min']:.1f}-{m['max']:.1f}); new relays "
        f"{', '.join(str(x['moved_to']) for x in rounds)}; {a.rounds} rounds, unshaped links "
        f"[{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        a.name,
        {"rounds": a.rounds, "target_s": TARGET_S, "runs": rounds, "flowing": f, "moved": m, "met": met},
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
