"""All-reduce of a --mib MiB float32 tensor (gloo); prints the bandwidth and checks the sum."""

import argparse
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mib", type=int, default=64)
p.add_argument("--iters", type=int, default=1)
a = p.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((a.mib * 1024 * 1024 // 4,), float(rank + 1))
dist.all_reduce(torch.ones(1))  # connect first: time only the transfer
t0 = time.perf_counter()
for _ in range(a.iters):
    dist.all_reduce(t)
dt = (time.perf_counter() - t0) / a.iters
expected = float(sum(range(1, world + 1))) * world ** (a.iters - 1)
assert torch.allclose(t[:4], torch.full((4,), expected)), (t[:4], expected)
if rank == 0:
    print(
        f"allreduce mib={a.mib} world={world} seconds={dt:.3f} algbw_MiBps={a.mib / dt:.1f} "
        f"busbw_MiBps={a.mib / dt * 2 * (world - 1) / world:.1f}",
        flush=True,
    )
dist.destroy_process_group()
