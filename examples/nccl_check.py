"""Which transport and interface the collectives of a meshrun job use: the world group, the site group
and the cross-site groups, each in turn (run by `./dev.sh gpu-check`, or by hand under `meshrun train`).

Between the groups every rank prints ``== GROUP ==`` markers; with NCCL (the node's GPU from ``--gpu-map``,
else its local rank's) and ``NCCL_DEBUG=INFO`` the lines NCCL logs after a marker belong to that group's
communicator (NCCL creates it at its first collective). ``--hostid-per-node`` sets ``NCCL_HOSTID`` to
the node's name (nodes that are namespaces of one machine, possibly on one GPU). Without a GPU the same
runs on gloo. Each group's all-reduce result is checked; the last line of every rank is
``nccl_check rank=R ok``.

It also checks how a warm worker (meshrun.jobs.agent) treats the GPU: torch was imported before the worker was
forked, CUDA must not have been initialised (``cuda_at_start=False``: CUDA does not survive a fork), and the
script ends the way countless training scripts end, a DDP model in a module global and destroy_process_group(),
which the worker must not tear down in a way that hangs (meshrun.system.machine.warmfork.exit_as_interpreter).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from meshrun.train import sites


def pin_device(gpu_map: str, hostid_per_node: bool) -> bool:
    """This rank's GPU (from `gpu_map`, NODE=GPU pairs, else the local rank's) and, for nodes that are namespaces
    of one machine, NCCL_HOSTID; True when there is a GPU (NCCL), False for gloo."""
    if not torch.cuda.is_available():
        return False
    node = os.environ.get("MESHRUN_NODE_NAME", "")
    gpu_of = dict(pair.split("=", 1) for pair in gpu_map.split(",") if "=" in pair)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(int(gpu_of[node]) if node in gpu_of else local % torch.cuda.device_count())
    if hostid_per_node and node:
        # NCCL tells hosts apart by host name and boot id, which namespaces share; read at NCCL's init.
        os.environ["NCCL_HOSTID"] = node
    return True


MODEL = None  # a module global, as in many training scripts: alive when the script returns


def main() -> None:
    global MODEL
    cuda_at_start = torch.cuda.is_available() and torch.cuda.is_initialized()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu-map", default="", help="NODE=GPU pairs, comma-separated [the local rank's GPU]")
    p.add_argument("--hostid-per-node", action="store_true", help="NCCL_HOSTID = the node's name")
    p.add_argument("--mib", type=int, default=16)
    a = p.parse_args()
    cuda = pin_device(a.gpu_map, a.hostid_per_node)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    print(
        f"backend={dist.get_backend()} device={device} interface={os.environ.get('MESHRUN_INTERFACE')} "
        f"hostid={os.environ.get('NCCL_HOSTID', '-')} cuda_at_start={cuda_at_start}",
        flush=True,
    )

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
        f"site={g.site} site_ifname={os.environ.get('MESHRUN_SITE_IFNAME', '-')} local={g.local_rank}/{g.local_size} "
        f"site_net={g.local_net or 'default'}",
        flush=True,
    )
    check("site group", lambda t: dist.all_reduce(t, group=g.local), float(g.local_size))
    if g.hierarchical:
        check("cross-site groups", lambda t: sites.all_reduce(t, g), float(world))
    MODEL = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(64, 64).to(device), device_ids=[device.index] if cuda else None
    )
    MODEL(torch.randn(8, 64, device=device)).sum().backward()  # the reducer's all-reduce on the backend
    dist.barrier()
    print(f"nccl_check rank={rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
