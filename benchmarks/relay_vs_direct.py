"""Relayed vs direct all-reduce bandwidth: through a peer relay, and through the coordinator when it
relays two pairs at once.

World (every datacenter's internet link shaped to --rate-mbit, both directions): the coordinator (hq), a
direct pair dca/dcb (one-to-one NAT; they joined with --no-relay), two pairs behind symmetric NAT that
can never connect directly, dcc/dcd and dcf/dcg, and dce, a well-connected member (one-to-one NAT, its
link --relay-mbit) that relays. Phase 1: the same gloo all-reduce over the direct pair and over dcc/dcd
(relayed by dce), in alternating order, each launched with `meshrun train --nodes A,B`. Phase 2: dce
leaves, so the coordinator relays every symmetric pair; dcc/dcd and dcf/dcg all-reduce at the same time
(alternating with the direct pair), the coordinator's link carrying both, so each pair has at most half
of it (0.5 of the direct pair is the ceiling there). Reports each ratio to the direct pair's median with
min/median/max of the rounds.

    sudo .venv/bin/python benchmarks/relay_vs_direct.py [--mib 32] [--rounds 3] [--rate-mbit 200]
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from pathlib import Path

from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec, World

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"


def allreduce(mesh: Mesh, nodes: str, mib: int, iters: int) -> float:
    res = mesh.meshrun(
        "hq-a",
        "train",
        "--nodes",
        nodes,
        "--timeout",
        "60",
        "allreduce.py",
        "--mib",
        str(mib),
        "--iters",
        str(iters),
        cwd=SCRIPTS,
        timeout=600,
        check=False,
    )
    m = re.search(r"algbw_MiBps=([\d.]+)", res.stdout)
    if res.returncode != 0 or not m:
        raise SystemExit(f"all-reduce over {nodes} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return float(m.group(1))


def settle(mesh: Mesh, nodes: list[str], timeout: float = 120) -> dict:
    """The coordinator's pairs once each is decided (verified direct, or relayed)."""
    n = len(nodes) * (len(nodes) - 1) // 2
    deadline = time.monotonic() + timeout
    while True:
        pairs = {frozenset((p["a"], p["b"])): p for p in mesh.status("hq-a").get("pairs", [])}
        if len(pairs) == n and all(p["verified"] or p["path"] == "relayed" for p in pairs.values()):
            return pairs
        if time.monotonic() > deadline:
            raise SystemExit(f"paths did not settle: {pairs}")
        time.sleep(1)


def relayed_by(mesh: Mesh, a: str, b: str, relay: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pairs = settle(mesh, NODES)
        got = pairs[frozenset((a, b))].get("relay")
        if got == relay:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{a} <-> {b} is relayed by {got}, not {relay}")
        time.sleep(1)


NODES = ["dca-a", "dcb-a", "dcc-a", "dcd-a", "dce-a", "dcf-a", "dcg-a"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate-mbit", type=int, default=200, help="every datacenter's internet link [200]")
    ap.add_argument("--relay-mbit", type=int, default=1000, help="the relaying member's link [1000]")
    ap.add_argument("--name", default="relay_vs_direct")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import alternating, need_root, prefix, spread, verdict, write_result

    need_root()
    t_start = time.monotonic()
    rate = a.rate_mbit
    dcs = [
        DatacenterSpec("hq", rate_mbit=rate),
        DatacenterSpec("dca", rate_mbit=rate),
        DatacenterSpec("dcb", rate_mbit=rate),
        DatacenterSpec("dcc", nat="symmetric", rate_mbit=rate),
        DatacenterSpec("dcd", nat="symmetric", rate_mbit=rate),
        DatacenterSpec("dce", rate_mbit=a.relay_mbit),
        DatacenterSpec("dcf", nat="symmetric", rate_mbit=rate),
        DatacenterSpec("dcg", nat="symmetric", rate_mbit=rate),
    ]
    pair = {"direct": "dca-a,dcb-a", "peer_relayed": "dcc-a,dcd-a"}
    runs: dict[str, list[float]] = {"direct": [], "peer_relayed": [], "coordinator_relayed_2_pairs": []}
    with World(dcs, prefix=prefix("rel")) as world:
        world.up()
        mesh = Mesh(world, "hq-a")
        mesh.init()
        for n in NODES:
            mesh.join(n, *(["--no-relay"] if n in ("dca-a", "dcb-a") else []))
        pairs = settle(mesh, NODES)
        relayed_by(mesh, "dcc-a", "dcd-a", "dce-a")
        direct_path = pairs[frozenset(("dca-a", "dcb-a"))]["path"]
        for kind in alternating(["direct", "peer_relayed"], a.rounds):
            runs[kind].append(allreduce(mesh, pair[kind], a.mib, a.iters))
            print(f"{kind:28s} {runs[kind][-1]:.1f} MiB/s", flush=True)
        # Phase 2: the relay leaves; the coordinator relays both symmetric pairs, which run at once.
        mesh.meshrun("dce-a", "leave")
        relayed_by(mesh, "dcc-a", "dcd-a", "coordinator")
        relayed_by(mesh, "dcf-a", "dcg-a", "coordinator")
        direct2: list[float] = []
        for kind in alternating(["direct", "two"], a.rounds):
            if kind == "direct":
                direct2.append(allreduce(mesh, pair["direct"], a.mib, a.iters))
                print(f"{'direct':28s} {direct2[-1]:.1f} MiB/s", flush=True)
                continue
            out: list[float] = []
            ts = [
                threading.Thread(target=lambda nodes=nodes: out.append(allreduce(mesh, nodes, a.mib, a.iters)))
                for nodes in ("dcc-a,dcd-a", "dcf-a,dcg-a")
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if len(out) != 2:
                raise SystemExit("a relayed all-reduce through the coordinator failed")
            runs["coordinator_relayed_2_pairs"] += out
            print(f"{'coordinator_relayed_2_pairs':28s} {out[0]:.1f} / {out[1]:.1f} MiB/s", flush=True)
        runs["direct"] += direct2
    d = spread(runs["direct"])
    p, c = spread(runs["peer_relayed"]), spread(runs["coordinator_relayed_2_pairs"])
    peer_ratio, coord_ratio = p["median"] / d["median"], c["median"] / d["median"]
    summary = (
        f"relay_vs_direct: all-reduce algbw vs the direct pair (median {d['median']:.1f} MiB/s, "
        f"{d['min']:.1f}-{d['max']:.1f}): relayed by a member {peer_ratio:.2f} ({verdict(peer_ratio >= 0.9)} >= 0.9; "
        f"{p['min']:.1f}-{p['max']:.1f} MiB/s), by the coordinator with two relayed pairs at once {coord_ratio:.2f} "
        f"(of at most 0.5, its link shared; {c['min']:.1f}-{c['max']:.1f} MiB/s); {a.mib} MiB x{a.iters}, "
        f"{a.rounds} rounds alternating, links "
        f"{rate} Mbit/s, the relaying member's {a.relay_mbit} Mbit/s [{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        a.name,
        {
            "mib": a.mib,
            "iters": a.iters,
            "rounds": a.rounds,
            "rate_mbit": rate,
            "relay_mbit": a.relay_mbit,
            "direct_path": direct_path,
            "runs_MiBps": runs,
            "direct": d,
            "peer_relayed": p,
            "coordinator_relayed_2_pairs": c,
            "ratio_peer_relayed_over_direct": peer_ratio,
            "ratio_coordinator_relayed_over_direct": coord_ratio,
        },
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
