"""Relayed vs direct all-reduce bandwidth on one NAT world (issue: NAT traversal).

World: a coordinator datacenter, two 1:1-NAT datacenters (direct pair) and two behind symmetric
NAT (relayed through the coordinator). The same gloo all-reduce runs over each pair, in alternating
order (direct first, then relayed first, ...), launched with `meshrun train --nodes A,B`; the ratio
relayed/direct of the medians is what a relayed pair costs, with each side's min/median/max.
`--rate-mbit` shapes every datacenter's internet link (the figure users feel: a WAN rate, not CPU-bound).

    sudo .venv/bin/python benchmarks/relay_vs_direct.py [--mib 32] [--rounds 3] [--rate-mbit 200]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from meshrun.lab.testbed import DatacenterSpec, Mesh, World

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate-mbit", type=int, default=None)
    ap.add_argument("--name", default="relay_vs_direct")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import alternating, need_root, prefix, spread, write_result

    need_root()
    t_start = time.monotonic()
    rate = a.rate_mbit
    dcs = [
        DatacenterSpec("hq", rate_mbit=rate),
        DatacenterSpec("dca", rate_mbit=rate),
        DatacenterSpec("dcb", rate_mbit=rate),
        DatacenterSpec("dcc", nat="symmetric", rate_mbit=rate),
        DatacenterSpec("dcd", nat="symmetric", rate_mbit=rate),
    ]
    with World(dcs, prefix=prefix("rel")) as world:
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
        runs: dict[str, list[float]] = {"direct": [], "relayed": []}
        pair = {"direct": "dca-a,dcb-a", "relayed": "dcc-a,dcd-a"}
        for kind in alternating(["direct", "relayed"], a.rounds):
            runs[kind].append(allreduce(mesh, pair[kind], a.mib, a.iters))
            print(f"{kind:8s} {runs[kind][-1]:.1f} MiB/s", flush=True)
    d, r = spread(runs["direct"]), spread(runs["relayed"])
    ratio = r["median"] / d["median"]
    summary = (
        f"relay_vs_direct: relayed/direct all-reduce algbw {ratio:.2f} (medians {r['median']:.1f} vs "
        f"{d['median']:.1f} MiB/s; relayed {r['min']:.1f}-{r['max']:.1f}, direct {d['min']:.1f}-{d['max']:.1f}; "
        f"{a.mib} MiB x{a.iters}, {a.rounds} rounds, links {rate or 'unshaped'}"
        f"{' Mbit/s' if rate else ''}) [{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        a.name,
        {
            "mib": a.mib,
            "iters": a.iters,
            "rounds": a.rounds,
            "rate_mbit": rate,
            "direct_path": direct_path,
            "relayed_path": relayed_path,
            "runs_MiBps": runs,
            "direct": d,
            "relayed": r,
            "ratio_relayed_over_direct": ratio,
        },
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
