"""Several nodes per datacenter: DDP inside each site on its own network, DiLoCo across sites over the overlay.

Launch with `meshrun train` on nodes that joined with `--site` (or whose sites meshrun inferred):
    meshrun train examples/sites_diloco.py --steps 60 --sync-every 20

Every rank prints its site (``site=fra site_rank=0 local=1/2``) and, at the end, the bytes it sent
across sites and ``param_checksum rank=R value=SHA256`` of its parameters: equal on every rank.
Runs on CPU (gloo) and GPU (nccl for DDP inside the site where the process group is nccl).
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn

from meshrun.train import sites
from meshrun.train.diloco import DiLoCo


def checksum(model: nn.Module) -> str:
    flat = torch.cat([p.detach().to("cpu", torch.float64).flatten() for p in model.parameters()])
    return hashlib.sha256(bytes(flat.contiguous().untyped_storage())).hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--compression", default="fp16")
    a = p.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"
    g = sites.groups()
    print(f"site={g.site} site_rank={g.site_rank}/{g.num_sites} local={g.local_rank}/{g.local_size}", flush=True)
    torch.manual_seed(0)  # the same initial model everywhere
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=g.local)  # inside the site
    opt = DiLoCo(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        sync_every=a.sync_every,
        compression=a.compression,
        sites=g,  # one replica per site: each rank sends its shard across sites
    )
    gen = torch.Generator().manual_seed(rank)
    target = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    for step in range(a.steps):
        x = torch.randn(64, 32, generator=gen).to(device)
        loss = nn.functional.mse_loss(ddp(x), x @ target.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step + 1) % a.sync_every == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    opt.finish()
    print(f"sent across sites {opt.bytes_sent_total} B in {opt.sync_count} syncs", flush=True)
    print(f"param_checksum rank={rank} value={checksum(model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
