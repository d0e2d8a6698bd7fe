"""Inside one job of benchmarks/sites.py: the site group on the LAN vs on the overlay, and the hierarchical
all-reduce vs the flat one, in alternating order; rank 0 prints one line ``SITES_RESULT {json}``.

Values are small integers in fp32, so every sum is exact and the hierarchical result must equal the
flat one bit for bit (checked every round).
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

from meshrun.train import sites

p = argparse.ArgumentParser()
p.add_argument("--intra-mib", type=int, default=64)
p.add_argument("--cross-mib", type=int, default=256)
p.add_argument("--rounds", type=int, default=3)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
g = sites.groups()
over = sites.groups(site_ifname="")  # the same groups on the overlay
assert g.hierarchical, "the benchmark needs two or more sites of equal size"


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(el, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
    return float(el)


intra = torch.ones(a.intra_mib << 18)
cross = (torch.arange(a.cross_mib << 18) % 7 + rank).to(torch.float32)
for warm in (
    lambda: dist.all_reduce(torch.ones(1 << 10), group=g.local),
    lambda: dist.all_reduce(torch.ones(1 << 10), group=over.local),
):
    warm()
runs = {"intra_site_network": [], "intra_overlay": [], "cross_hierarchical": [], "cross_flat": []}
equal = True
for r in range(a.rounds):
    order_i = ["intra_site_network", "intra_overlay"] if r % 2 == 0 else ["intra_overlay", "intra_site_network"]
    for k in order_i:
        grp = g.local if k == "intra_site_network" else over.local
        runs[k].append(timed(lambda: dist.all_reduce(intra.clone(), group=grp)))
    order_c = ["cross_hierarchical", "cross_flat"] if r % 2 == 0 else ["cross_flat", "cross_hierarchical"]
    results = {}
    for k in order_c:
        t = cross.clone()
        fn = (lambda: sites.all_reduce(t, g)) if k == "cross_hierarchical" else (lambda: dist.all_reduce(t))
        runs[k].append(timed(fn))
        results[k] = t
    equal = equal and torch.equal(results["cross_hierarchical"], results["cross_flat"])
    if rank == 0:
        print(" ".join(f"{k}={v[-1]:.2f}s" for k, v in runs.items()), flush=True)
ok = torch.tensor([1 if equal else 0])
dist.all_reduce(ok, op=dist.ReduceOp.MIN)
if rank == 0:
    out = {
        "runs_s": runs,
        "identical": bool(ok),
        "sites": list(g.layout.sites),
        "ranks": [list(r) for r in g.layout.ranks],
    }
    print("SITES_RESULT " + json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
