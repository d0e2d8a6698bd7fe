"""Sites: the site network vs the overlay inside a site, and the hierarchical all-reduce vs the flat ring
across sites (issue: sites and fabrics).

World: a coordinator datacenter and two sites of two nodes each (one-to-one NAT, `meshrun join
--site`), every node's own internet uplink shaped to --node-rate-mbit both ways (clouds give each VM
its own allowance), the sites' LANs unshaped. One `meshrun train` job (gloo) runs, in alternating
order, --rounds times: an all-reduce of --intra-mib MiB inside each site on the site network and on
the overlay, and an all-reduce of --cross-mib MiB over all 4 ranks, hierarchical (meshrun.train.sites)
and flat; the results must be identical (exact integer sums) in every round. Targets: intra-site on
the site network >= 3x the overlay; hierarchical >= 1.8x the flat ring.

    sudo .venv/bin/python benchmarks/sites.py [--rounds 3] [--node-rate-mbit 200]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from meshrun.lab.testbed import DatacenterSpec, Mesh, World

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
TARGET_INTRA, TARGET_CROSS = 3.0, 1.8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intra-mib", type=int, default=64)
    ap.add_argument("--cross-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-rate-mbit", type=int, default=200)
    ap.add_argument("--name", default="sites")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import need_root, prefix, spread, write_result

    need_root()
    t_start = time.monotonic()
    dcs = [
        DatacenterSpec("hq"),
        DatacenterSpec("s1", nodes=2, node_rate_mbit=a.node_rate_mbit),
        DatacenterSpec("s2", nodes=2, node_rate_mbit=a.node_rate_mbit),
    ]
    with World(dcs, prefix=prefix("sit")) as world:
        world.up()
        mesh = Mesh(world, "hq-a")
        mesh.init()
        for site in ("s1", "s2"):
            for n in (f"{site}-a", f"{site}-b"):
                mesh.join(n, "--site", site)
        res = mesh.meshrun(
            "hq-a",
            "train",
            "--nodes",
            "s1-a,s1-b,s2-a,s2-b",
            "--timeout",
            "120",
            "sites_allreduce.py",
            "--intra-mib",
            str(a.intra_mib),
            "--cross-mib",
            str(a.cross_mib),
            "--rounds",
            str(a.rounds),
            cwd=SCRIPTS,
            timeout=3000,
            check=False,
        )
        m = re.search(r"SITES_RESULT (\{.*\})", res.stdout)
        if res.returncode != 0 or not m:
            raise SystemExit(f"the sites job failed:\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}")
        print(res.stdout[-1500:], flush=True)
    got = json.loads(m.group(1))
    runs = got["runs_s"]
    s = {k: spread(v) for k, v in runs.items()}
    intra = s["intra_overlay"]["median"] / s["intra_site_network"]["median"]
    cross = s["cross_flat"]["median"] / s["cross_hierarchical"]["median"]

    def rng(k: str) -> str:
        return f"{s[k]['median']:.2f} s ({s[k]['min']:.2f}-{s[k]['max']:.2f})"

    summary = (
        f"sites: intra-site all-reduce {a.intra_mib} MiB on the site network {intra:.1f}x the overlay "
        f"({'met' if intra >= TARGET_INTRA else 'MISSED'} >= {TARGET_INTRA}x; {rng('intra_site_network')} vs "
        f"{rng('intra_overlay')}); cross-site {a.cross_mib} MiB hierarchical {cross:.3f}x the flat ring "
        f"({'met' if cross >= TARGET_CROSS else 'MISSED'} >= {TARGET_CROSS}x; {rng('cross_hierarchical')} vs "
        f"{rng('cross_flat')}); identical results: {got['identical']}; {a.rounds} rounds, "
        f"{a.node_rate_mbit} Mbit/s per node [{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        a.name,
        {
            "intra_mib": a.intra_mib,
            "cross_mib": a.cross_mib,
            "rounds": a.rounds,
            "node_rate_mbit": a.node_rate_mbit,
            "runs_s": runs,
            "spreads": s,
            "intra_site_over_overlay": intra,
            "hierarchical_over_flat": cross,
            "identical": got["identical"],
            "targets": {"intra": TARGET_INTRA, "cross": TARGET_CROSS},
        },
        summary,
    )
    return 0 if got["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
