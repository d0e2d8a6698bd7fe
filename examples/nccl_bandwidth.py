"""All-reduce bandwidth sweep, like nccl-tests' all_reduce_perf, under torchrun / `meshrun train`.

    meshrun train examples/nccl_bandwidth.py --max-size 256M
    torchrun --nproc-per-node 2 examples/nccl_bandwidth.py --backend gloo --max-size 4M

Sizes double from --min-size (1 MiB) to --max-size (256 MiB). Each size runs --warmup
untimed and --iters timed in-place all-reduces (sum, float32); the time is the slowest rank's
average. Rank 0 prints a table: size, time, algbw = size / time and
busbw = algbw * 2(n-1)/n in GB/s (1e9 bytes/s); busbw is comparable with the link speed
whatever the number of ranks. --json FILE writes the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_arg(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)(?:i?B)?", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1M, 256M, 1G or a byte count")
    return int(m.group(1)) * UNITS[m.group(2)]


def human(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return str(n)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-size", type=size_arg, default=1 << 20, help="first message size [1M]")
    p.add_argument("--max-size", type=size_arg, default=256 << 20, help="last message size [256M]")
    p.add_argument("--iters", type=int, default=20, help="timed all-reduces per size")
    p.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size")
    p.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl when CUDA is available, else gloo",
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (rank 0)")
    args = p.parse_args(argv)
    if args.min_size < 4 or args.max_size < args.min_size:
        p.error(f"sizes must satisfy 4 <= --min-size ({args.min_size}) <= --max-size ({args.max_size})")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sizes = []
    s = args.min_size
    while s <= args.max_size:
        sizes.append(s)
        s *= 2
    if rank == 0:
        print(
            f"# all_reduce sum float32, {world} ranks, backend {backend}, warmup {args.warmup}, iters {args.iters}",
            flush=True,
        )
        print(
            f"# {'size':>8} {'count':>11} {'time(ms)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'check':>6}",
            flush=True,
        )
    rows = []
    for size in sizes:
        count = size // 4
        buf = torch.ones(count, dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # also a correctness check: every element == world
        sync()
        ok = bool(torch.all(buf == world).item())
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buf)
        sync()
        elapsed = torch.tensor(
            [(time.perf_counter() - t0) / args.iters, 0.0 if ok else 1.0], dtype=torch.float64, device=device
        )
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        sec = elapsed[0].item()
        ok = elapsed[1].item() == 0.0
        algbw = size / sec / 1e9
        busbw = algbw * 2 * (world - 1) / world
        rows.append(
            {"size": size, "count": count, "time_s": sec, "algbw_GBps": algbw, "busbw_GBps": busbw, "correct": ok}
        )
        if rank == 0:
            print(
                f"  {human(size):>8} {count:>11} {sec * 1e3:>10.3f} {algbw:>12.3f} {busbw:>12.3f} "
                f"{'ok' if ok else 'WRONG':>6}",
                flush=True,
            )
        del buf
    if rank == 0:
        avg = sum(r["busbw_GBps"] for r in rows) / len(rows)
        print(f"# avg busbw {avg:.3f} GB/s", flush=True)
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(
                    {
                        "backend": backend,
                        "world_size": world,
                        "iters": args.iters,
                        "warmup": args.warmup,
                        "dtype": "float32",
                        "op": "sum",
                        "results": rows,
                    },
                    f,
                    indent=2,
                )
            os.replace(tmp, args.json)
    dist.destroy_process_group()
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
