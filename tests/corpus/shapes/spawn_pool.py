"""A script that picks the spawn start method and runs a Pool: the pool's children import the script again
as __mp_main__ (by its path), which only works if the script runs as a real __main__."""

import multiprocessing as mp

import torch
import torch.distributed as dist


def shard_sum(bounds):
    lo, hi = bounds
    return sum(i * i for i in range(lo, hi))


if __name__ == "__main__":
    mp.set_start_method("spawn")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with mp.Pool(2) as pool:
        parts = pool.map(shard_sum, [(rank * 1000, rank * 1000 + 500), (rank * 1000 + 500, rank * 1000 + 1000)])
    total = torch.tensor([float(sum(parts))])
    dist.all_reduce(total)
    print(f"rank {rank} pool parts {parts}")
    print(f"final-digest {int(total.item()):d}")
    dist.destroy_process_group()
