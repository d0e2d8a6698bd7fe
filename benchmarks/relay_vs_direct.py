"""Relayed vs direct all-reduce bandwidth on one NAT world (issue: NAT traversal).

World: a coordinator datacenter, two 1:1-NAT datacenters (direct pair) and two behind symmetric
NAT (relayed through the coordinator). The same gloo all-reduce runs over each pair, alternating,
launched with `meshrun train --nodes A,B`; the ratio relayed/direct is what a relayed pair costs.

    sudo .venv/bin/python benchmarks/relay_vs_direct.py [--mib 32] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

from meshrun.lab.testbed import DatacenterSpec, Mesh, World

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"


def allreduce(mesh: Mesh, nodes: str, mib: int, iters: int) -> float:
    res = mesh.meshrun("hq-a", "train", "--nodes", nodes, "--timeout", "60", "allreduce.py", "--mib", str(mib),
                       "--iters", str(iters), cwd=SCRIPTS, timeout=600, check=False)
    m = re.search(r"algbw_MiBps=([\d.]+)", res.stdout)
    if res.returncode != 0 or not m:
        raise SystemExit(f"all-reduce over {nodes} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "relay_vs_direct.json"))
    a = ap.parse_args()
    dcs = [DatacenterSpec("hq"), DatacenterSpec("dca"), DatacenterSpec("dcb"),
           DatacenterSpec("dcc", nat="symmetric"), DatacenterSpec("dcd", nat="symmetric")]
    with World(dcs, prefix="brel") as world:
        world.up()
        mesh = Mesh(world, "hq-a")
        mesh.init()
        for n in ("dca-a", "dcb-a", "dcc-a", "dcd-a"):
            mesh.join(n)
        deadline = time.monotonic() + 90
        while True:
            pairs = {(p["a"], p["b"]): p for p in mesh.status("hq-a").get("pairs", [])}
            settled = len(pairs) == 6 and all(p["verified"] or p["path"] == "relayed" for p in pairs.values())
            if settled:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"paths did not settle: {pairs}")
            time.sleep(1)
        direct_path = pairs[("dca-a", "dcb-a")]["path"]
        relayed_path = pairs[("dcc-a", "dcd-a")]["path"]
        direct, relayed = [], []
        for _ in range(a.rounds):  # alternate so machine noise hits both alike
            direct.append(allreduce(mesh, "dca-a,dcb-a", a.mib, a.iters))
            relayed.append(allreduce(mesh, "dcc-a,dcd-a", a.mib, a.iters))
    d, r = statistics.median(direct), statistics.median(relayed)
    result = {"mib": a.mib, "iters": a.iters, "rounds": a.rounds, "direct_path": direct_path,
              "relayed_path": relayed_path, "direct_algbw_MiBps": direct, "relayed_algbw_MiBps": relayed,
              "median_direct": d, "median_relayed": r, "ratio_relayed_over_direct": r / d}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"direct ({direct_path}) all-reduce {a.mib} MiB: {', '.join(f'{x:.1f}' for x in direct)} MiB/s")
    print(f"relayed ({relayed_path}) all-reduce {a.mib} MiB: {', '.join(f'{x:.1f}' for x in relayed)} MiB/s")
    print(f"relay_vs_direct: relayed/direct algbw = {r / d:.2f} (median {r:.1f} vs {d:.1f} MiB/s, "
          f"{a.mib} MiB x{a.iters}, {a.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
