"""Runs inside every torchrun worker of `meshrun bench`: pairwise TCP tests, then an all-reduce sweep.

    python -m meshrun.bench.worker --sizes 1M,4M,16M --duration 2 --streams 4

Launched by `meshrun bench` through the same machinery as `meshrun train` (agents, torchrun,
the coordinator's rendezvous store), so it measures exactly the path a training job uses.

1. Every node's first worker (LOCAL_RANK 0) opens a TCP server on its overlay IP; the
   addresses are exchanged with ``all_gather_object`` over a gloo group.
2. Ordered pairs run one at a time (barriers between them, so tests never overlap): the source
   measures the round-trip time (1-byte TCP ping-pong) and pushes data for ``--duration``
   seconds over ``--streams`` parallel connections; the receiver reports bytes and seconds.
   Pairs in one site (meshrun.train.sites) are measured a second time on the site network.
3. Every rank takes part in an in-place all-reduce (sum, float32) per size: gloo on CPU,
   NCCL on GPU. A size whose first all-reduce takes longer than ``--size-budget`` seconds
   is the last one run (so the whole benchmark stays bounded on slow links). With two or more
   sites of equal size, the hierarchical all-reduce (``meshrun.train.sites.all_reduce``) is timed
   beside the flat one, with the same number of iterations.

Rank 0 prints one line ``MESHRUN_BENCH_RESULT {json}`` that `meshrun bench` picks up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from meshrun.bench.report import RESULT_MARK, busbw, parse_sizes
from meshrun.system.sockets.tcpbench import PairServer, tcp_bandwidth, tcp_rtt_ms
from meshrun.train import sites


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
    site_groups = sites.groups()
    site_ip = os.environ.get("MESHRUN_SITE_ADDR") or None
    server = PairServer(my_ip, os.environ.get("GLOO_SOCKET_IFNAME")) if leader and not args.no_pairs else None
    site_server = PairServer(site_ip) if server and site_ip else None
    me = {
        "rank": rank,
        "node": node,
        "leader": leader,
        "site": site_groups.site,
        "overlay_ip": my_ip if leader else None,
        "port": server.port if server else None,
        "site_ip": site_ip if site_server else None,
        "site_port": site_server.port if site_server else None,
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
                    same_site = src["site"] == dst["site"]
                    row = {"src": src["node"], "dst": dst["node"], "scope": "site" if same_site else "cross-site"}
                    try:
                        row["rtt_ms"] = tcp_rtt_ms(dst["overlay_ip"], dst["port"])
                        bw = tcp_bandwidth(dst["overlay_ip"], dst["port"], args.duration, args.streams)
                        row["mbit_s"] = bw["mbit_s"]
                        row["bytes"] = bw["bytes"]
                    except (OSError, ConnectionError) as exc:
                        row.update(rtt_ms=None, mbit_s=0.0, bytes=0, error=str(exc))
                    if same_site and src["site_ip"] and dst["site_ip"]:
                        try:  # what the site's groups use: the site network, not the overlay
                            row["site_rtt_ms"] = tcp_rtt_ms(dst["site_ip"], dst["site_port"])
                            bw = tcp_bandwidth(dst["site_ip"], dst["site_port"], args.duration, args.streams)
                            row["site_mbit_s"] = bw["mbit_s"]
                        except (OSError, ConnectionError) as exc:
                            row.update(site_rtt_ms=None, site_mbit_s=0.0, site_error=str(exc))
                    print(
                        f"pair {row['src']} -> {row['dst']}: rtt {row['rtt_ms'] or 0:.2f} ms, "
                        f"{row['mbit_s']:.1f} Mbit/s",
                        flush=True,
                    )
                got: list = [None] * world
                dist.all_gather_object(got, row, group=ctl)
                pairs.append(got[src["rank"]])
    t_pairs = time.perf_counter() - t_start - t_setup
    for srv in (server, site_server):
        if srv:
            srv.close()

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
        row = {
            "size": size,
            "iters": iters,
            "time_s": sec,
            "algbw_GBps": algbw,
            "busbw_GBps": busbw(algbw, world),
            "correct": ok,
        }
        if site_groups.hierarchical and site_groups.local_size > 1:  # one rank per site: the same as flat
            hier = torch.ones(count, dtype=torch.float32, device=device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                sites.all_reduce(hier, site_groups)
            sync()
            el = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
            dist.all_reduce(el, op=dist.ReduceOp.MAX)
            expected = float(world) ** iters  # ones, summed over `world` ranks `iters` times
            row["hier_time_s"] = el[0].item()
            row["hier_correct"] = bool(torch.all(hier == expected).item())
            del hier
        rows.append(row)
        if rank == 0:
            print(f"all_reduce {size} B: {sec * 1e3:.1f} ms, busbw {rows[-1]['busbw_GBps']:.4f} GB/s", flush=True)
        del buf
        if first_s > args.size_budget:
            break
    t_ar = time.perf_counter() - t_start - t_setup - t_pairs
    if rank == 0:
        out = {
            "nodes": [{"name": e["node"], "overlay_ip": e["overlay_ip"], "site": e["site"]} for e in leaders],
            "sites": {site: [e["node"] for e in leaders if e["site"] == site] for site in site_groups.layout.sites},
            "hierarchical": site_groups.hierarchical,
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
    return 0 if all(r["correct"] and r.get("hier_correct", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
