"""All-reduce bus bandwidth between pairs of a meshrun job's nodes (run by `./dev.sh gpu-check`, or by hand
under `meshrun train --nproc-per-node 1`).

Pairs: ``same`` is two nodes of one site (``MESHRUN_SITE``), ``cross`` one of them and a node of another
site; every pair the job's nodes allow is measured, in turn, ``--rounds`` times in alternating order. The
collectives run on NCCL (``--gpu-map`` as in nccl_check.py; ``--hostid-per-node`` for nodes that are
namespaces of one machine) or, without a GPU, on gloo. A pair's communicator is NCCL's (or gloo's) own, over
whatever interface the job pins (``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``: meshrun0 unless ``--env``
says otherwise); the ranks outside a pair wait on a gloo barrier, so only the pair touches the network.

``--sockets default`` removes ``NCCL_SOCKET_NTHREADS`` and ``NCCL_NSOCKS_PERTHREAD`` (a user's own, which
`meshrun train` passes) before NCCL starts, so NCCL picks its own; ``TxS`` sets T threads x S sockets per
thread. NCCL reads them once per process, which is why each setting is a job of its own.

The node the pairs share prints one line ``NCCL_BENCH {json}``: per pair its bus bandwidth (GB/s) per round
(the median of the round's timed iterations) and per iteration, and what each node read from
/sys/class/net/IF/speed.
Bus bandwidth of an all-reduce over n ranks is size / time x 2(n-1)/n: for a pair, size / time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from nccl_check import pin_device  # beside this script: the job ships the folder


def iface_speed(ifname: str) -> str:
    """What /sys/class/net/IFNAME/speed says (Mb/s), as text; what went wrong if it cannot be read."""
    try:
        return open(f"/sys/class/net/{ifname}/speed").read().strip()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-map", default="", help="NODE=GPU pairs, comma-separated [the local rank's GPU]")
    p.add_argument("--hostid-per-node", action="store_true", help="NCCL_HOSTID = the node's name")
    p.add_argument("--sockets", default="", help="'default' (NCCL's choice) or TxS [what the job's env says]")
    p.add_argument("--mib", type=int, default=256, help="size of the all-reduced tensor, MiB (float32)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations before a pair's first round")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per round")
    p.add_argument("--rounds", type=int, default=1, help="rounds per pair, pairs alternating")
    p.add_argument("--pairs", default="same,cross", help="which pairs, in the first round's order")
    a = p.parse_args()
    if a.sockets == "default":
        os.environ.pop("NCCL_SOCKET_NTHREADS", None)
        os.environ.pop("NCCL_NSOCKS_PERTHREAD", None)
    elif a.sockets:
        t, s = a.sockets.lower().split("x")
        os.environ["NCCL_SOCKET_NTHREADS"], os.environ["NCCL_NSOCKS_PERTHREAD"] = str(int(t)), str(int(s))
    cuda = pin_device(a.gpu_map, a.hostid_per_node)  # the same GPU choice as the groups check
    node = os.environ.get("MESHRUN_NODE_NAME", "")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cpu = dist.new_group(backend="gloo") if cuda else dist.group.WORLD  # barriers that leave the GPU alone
    ifname = (os.environ.get("NCCL_SOCKET_IFNAME") if cuda else os.environ.get("GLOO_SOCKET_IFNAME")) or ""
    ifname = ifname.lstrip("=^")
    me = {"node": node, "site": os.environ.get("MESHRUN_SITE", ""), "rank": rank, "speed": iface_speed(ifname)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me, group=cpu)
    everyone.sort(key=lambda m: m["rank"])
    pairs: dict[str, tuple[int, int]] = {}
    # The pairs share one node: the lowest rank of a site with two nodes (else of the job).
    by_site: dict[str, list] = {}
    for m in everyone:
        by_site.setdefault(m["site"], []).append(m)
    first = next((ms[0] for ms in by_site.values() if len(ms) > 1), everyone[0])
    mate = next((m for m in everyone if m["site"] == first["site"] and m is not first), None)
    other = next((m for m in everyone if m["site"] != first["site"]), None)
    found = {"same": mate, "cross": other}
    for name in a.pairs.split(","):  # in the order asked for: the first round's order
        if found.get(name):
            pairs[name] = (first["rank"], found[name]["rank"])
    # new_group is collective over the whole world, in the same order on every rank.
    groups = {name: dist.new_group(list(ranks)) for name, ranks in pairs.items()}
    numel = a.mib << 18  # float32
    t = torch.ones(numel, device=device)
    nbytes = t.numel() * t.element_size()
    result: dict = {
        "backend": dist.get_backend(),
        "ifname": ifname,
        "sockets": a.sockets or "job env",
        "env": {k: os.environ.get(k, "") for k in ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD")},
        "mib": a.mib,
        "nodes": everyone,
        "pairs": {
            name: {"nodes": [everyone[r]["node"] for r in ranks], "rounds": [], "iters": []}
            for name, ranks in pairs.items()
        },
    }

    warm: set[str] = set()

    def timed(group) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    names = list(pairs)
    for rnd in range(a.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            ranks, group = pairs[name], groups[name]
            dist.barrier(group=cpu)
            if rank in ranks:
                if name not in warm:  # the first all-reduce also creates the communicator
                    for _ in range(a.warmup):
                        timed(group)
                    warm.add(name)
                secs = [timed(group) for _ in range(a.iters)]
                bw = [nbytes / s / 1e9 for s in secs]
                if rank == ranks[0]:
                    result["pairs"][name]["rounds"].append(round(statistics.median(bw), 4))
                    result["pairs"][name]["iters"].append([round(x, 4) for x in bw])
                    print(f"nccl_bench {name} round {rnd}: {statistics.median(bw):.3f} GB/s", flush=True)
            dist.barrier(group=cpu)
    if rank == first["rank"]:
        print("NCCL_BENCH " + json.dumps(result, sort_keys=True), flush=True)
    dist.barrier(group=cpu)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
