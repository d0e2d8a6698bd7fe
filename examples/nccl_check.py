"""Which transport and interface the collectives of a meshrun job use: the world group, the site group
and the cross-site groups, each in turn (run by `./dev.sh gpu-check`, or by hand under `meshrun train`).

Between the groups every rank prints ``== GROUP ==`` markers; with NCCL (one GPU per rank, chosen by the
node's position in ``--gpu-order``) and ``NCCL_DEBUG=INFO`` the lines NCCL logs after a marker belong to
that group's communicator (NCCL creates it at its first collective). Without a GPU the same runs on gloo.
Each group's all-reduce result is checked; the last line of every rank is ``nccl_check rank=R ok``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from meshrun.train import sites


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-order", default="", help="node names, comma-separated: node i uses GPU i")
    p.add_argument("--mib", type=int, default=16)
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        order = [n for n in a.gpu_order.split(",") if n]
        node = os.environ.get("MESHRUN_NODE_NAME", "")
        gpu = order.index(node) if node in order else int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(gpu)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    print(f"backend={dist.get_backend()} device={device} interface={os.environ.get('MESHRUN_INTERFACE')}", flush=True)

    def check(name: str, fn, expected: float) -> None:
        dist.barrier()
        print(f"== {name} ==", flush=True)
        t = torch.ones(a.mib << 18, device=device)
        fn(t)
        if cuda:
            torch.cuda.synchronize()
        ok = bool(torch.all(t == expected).item())
        print(f"{name}: {'ok' if ok else 'WRONG RESULT'}", flush=True)
        if not ok:
            raise SystemExit(f"{name}: wrong all-reduce result")

    check("world group", lambda t: dist.all_reduce(t), float(world))
    g = sites.groups()
    print(
        f"site={g.site} site_ifname={os.environ.get('MESHRUN_SITE_IFNAME', '-')} local={g.local_rank}/{g.local_size}",
        flush=True,
    )
    check("site group", lambda t: dist.all_reduce(t, group=g.local), float(g.local_size))
    if g.hierarchical:
        check("cross-site groups", lambda t: sites.all_reduce(t, g), float(world))
    dist.barrier()
    print(f"nccl_check rank={rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
