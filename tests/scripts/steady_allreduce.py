"""A gloo job that keeps talking: --iters all-reduces of a small tensor, --gap seconds apart, every rank
checking each result; rank 0 prints one JSON line per --report iterations and a final one. Rendezvous by
env:// (MASTER_ADDR/PORT, RANK, WORLD_SIZE), so it depends on no coordinator."""

import argparse
import json
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=100)
p.add_argument("--gap", type=float, default=0.5)
p.add_argument("--report", type=int, default=10)
a = p.parse_args()
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
t0 = time.monotonic()
slowest = 0.0
for i in range(a.iters):
    t = torch.full((256 * 1024,), float(rank + 1 + i))
    s = time.monotonic()
    dist.all_reduce(t)
    slowest = max(slowest, time.monotonic() - s)
    want = float(sum(r + 1 + i for r in range(world)))
    assert torch.equal(t, torch.full_like(t, want)), (i, t[:2], want)
    if rank == 0 and (i + 1) % a.report == 0:
        print(json.dumps({"iter": i + 1, "t": round(time.monotonic() - t0, 1)}), flush=True)
    time.sleep(a.gap)
if rank == 0:
    print(json.dumps({"done": a.iters, "seconds": round(time.monotonic() - t0, 1), "slowest_s": round(slowest, 2)}))
dist.destroy_process_group()
