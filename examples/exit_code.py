"""Minimal failing job: after a barrier, rank --rank exits with --code; every other rank exits 0.

Used to check that `meshrun train` returns the failing rank's exit code:
    meshrun train examples/exit_code.py --rank 1 --code 3     # exits 3

The other ranks run no collective after the barrier (one with the dead rank would block
until a timeout), so they finish at once with exit code 0. The failing rank waits --delay
seconds first, so that torchrun sees the others' clean exits before it tears the group down
(it SIGTERMs every worker still alive once one fails).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=1, help="the rank that fails")
    p.add_argument("--code", type=int, default=3, help="its exit code")
    p.add_argument("--delay", type=float, default=2.0, help="seconds the failing rank waits before exiting")
    args = p.parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == args.rank:
        time.sleep(args.delay)
        print(f"rank {rank} of {world} exiting with code {args.code}", file=sys.stderr, flush=True)
        os._exit(args.code)  # no clean shutdown: like a crash
    print(f"rank {rank} of {world} done", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
