"""Runs inside every torchrun worker of `meshrun bench`: pairwise TCP tests, then an all-reduce sweep.

    python -m meshrun.bench.worker --sizes 1M,4M,16M --duration 2 --streams 4

Launched by `meshrun bench` through the same machinery as `meshrun train` (agents, torchrun,
the coordinator's rendezvous store), so it measures exactly the path a training job uses.

1. Every node's first worker (LOCAL_RANK 0) opens a TCP server on its overlay IP; the
   addresses are exchanged with ``all_gather_object`` over a gloo group.
2. Ordered pairs run one at a time (barriers between them, so tests never overlap): the source
   measures the round-trip time (1-byte TCP ping-pong) and pushes data for ``--duration``
   seconds over ``--streams`` parallel connections; the receiver reports bytes and seconds.
3. Every rank takes part in an in-place all-reduce (sum, float32) per size: gloo on CPU,
   NCCL on GPU. A size whose first all-reduce takes longer than ``--size-budget`` seconds
   is the last one run (so the whole benchmark stays bounded on slow links).

Rank 0 prints one line ``MESHRUN_BENCH_RESULT {json}`` that `meshrun bench` picks up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from meshrun.bench.report import RESULT_MARK, busbw, parse_sizes
from meshrun.system.tcpbench import PairServer, tcp_bandwidth, tcp_rtt_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshrun.bench.worker")
    ap.add_argument("--sizes", default="1M,4M,16M")
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--size-budget", type=float, default=4.0)
    ap.add_argument("--no-pairs", action="store_true")
    args = ap.parse_args(argv)

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t_start = time.perf_counter()
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=120))
    ctl = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("MESHRUN_NODE_NAME") or os.uname().nodename
    my_ip = os.environ.get("MESHRUN_OVERLAY_IP", "")  # set by meshrun's launch plan

    leader = local_rank == 0
    server = PairServer(my_ip, os.environ.get("GLOO_SOCKET_IFNAME")) if leader and not args.no_pairs else None
    me = {
        "rank": rank,
        "node": node,
        "leader": leader,
        "overlay_ip": my_ip if leader else None,
        "port": server.port if server else None,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, me, group=ctl)
    leaders = [e for e in everyone if e["leader"]]
    t_setup = time.perf_counter() - t_start

    pairs = []
    if not args.no_pairs:
        for src in leaders:
            for dst in leaders:
                if src is dst:
                    continue
                row = None
                if rank == src["rank"]:
                    row = {"src": src["node"], "dst": dst["node"]}
                    try:
                        row["rtt_ms"] = tcp_rtt_ms(dst["overlay_ip"], dst["port"])
                        bw = tcp_bandwidth(dst["overlay_ip"], dst["port"], args.duration, args.streams)
                        row["mbit_s"] = bw["mbit_s"]
                        row["bytes"] = bw["bytes"]
                    except (OSError, ConnectionError) as exc:
                        row.update(rtt_ms=None, mbit_s=0.0, bytes=0, error=str(exc))
                    print(
                        f"pair {row['src']} -> {row['dst']}: rtt {row['rtt_ms'] or 0:.2f} ms, "
                        f"{row['mbit_s']:.1f} Mbit/s",
                        flush=True,
                    )
                got: list = [None] * world
                dist.all_gather_object(got, row, group=ctl)
                pairs.append(got[src["rank"]])
    t_pairs = time.perf_counter() - t_start - t_setup
    if server:
        server.close()

    def sync():
        if use_cuda:
            torch.cuda.synchronize(device)

    rows = []
    for size in parse_sizes(args.sizes):
        count = max(1, size // 4)
        buf = torch.ones(count, dtype=torch.float32, device=device)
        t0 = time.perf_counter()
        dist.all_reduce(buf)  # warm-up and correctness check: every element == world
        sync()
        first = torch.tensor(
            [time.perf_counter() - t0, 0.0 if bool(torch.all(buf == world).item()) else 1.0],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(first, op=dist.ReduceOp.MAX)
        first_s, ok = first[0].item(), first[1].item() == 0.0
        # As many timed iterations as fit in the budget (at least 1, at most --iters); same on every rank.
        iters = int(max(1, min(args.iters, args.size_budget // max(first_s, 1e-6))))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        el = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        sec = el[0].item()
        algbw = size / sec / 1e9
        rows.append(
            {
                "size": size,
                "iters": iters,
                "time_s": sec,
                "algbw_GBps": algbw,
                "busbw_GBps": busbw(algbw, world),
                "correct": ok,
            }
        )
        if rank == 0:
            print(f"all_reduce {size} B: {sec * 1e3:.1f} ms, busbw {rows[-1]['busbw_GBps']:.4f} GB/s", flush=True)
        del buf
        if first_s > args.size_budget:
            break
    t_ar = time.perf_counter() - t_start - t_setup - t_pairs
    if rank == 0:
        out = {
            "nodes": [{"name": e["node"], "overlay_ip": e["overlay_ip"]} for e in leaders],
            "world_size": world,
            "pairs": pairs,
            "allreduce": {"backend": backend, "dtype": "float32", "op": "sum", "results": rows},
            "settings": {
                "duration_s": args.duration,
                "streams": args.streams,
                "sizes": parse_sizes(args.sizes),
                "iters": args.iters,
                "size_budget_s": args.size_budget,
            },
            "timings_s": {"setup": round(t_setup, 3), "pairs": round(t_pairs, 3), "allreduce": round(t_ar, 3)},
        }
        print(RESULT_MARK + json.dumps(out), flush=True)
    dist.barrier(group=ctl)
    dist.destroy_process_group()
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
