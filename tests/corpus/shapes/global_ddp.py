"""The shape of countless training scripts: the DDP model is a module global, and with --destroy the script
ends with destroy_process_group() (its teardown at exit raced gloo's threads: issue 56)."""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--destroy", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(dist.get_rank())
for step in range(args.steps):
    opt.zero_grad()
    loss = model(torch.randn(16, 32, generator=gen)).pow(2).mean()
    loss.backward()
    opt.step()
digest = hash(tuple(round(x, 6) for p in model.parameters() for x in p.detach().flatten().tolist()))
print(f"rank {dist.get_rank()} loss {loss.item():.6f}")
print(f"final-digest {digest & 0xFFFFFFFF:08x}")
if args.destroy:
    dist.destroy_process_group()
