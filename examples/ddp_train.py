"""DDP on a small synthetic regression task; runs unchanged on CPU (gloo) and GPU (nccl).

Launch under torchrun / `meshrun train`:
    meshrun train examples/ddp_train.py --epochs 5
    torchrun --nproc-per-node 2 examples/ddp_train.py --epochs 2 --steps-per-epoch 5

Data is generated per rank from the seed and the rank (deterministic). Rank 0 prints the
loss per epoch (``epoch 1 loss 0.1234``) and checkpoints each epoch (atomic: tmp + os.replace);
on start rank 0 reads the checkpoint, when it exists, and sends it to every rank
(``resumed from epoch N``). Under meshrun the checkpoint is ``checkpoints/$MESHRUN_RUN_ID.pt`` in the
project's directory unless --checkpoint names one: torchrun's restarts and ``meshrun train --resume JOB``
continue the run, a new job starts fresh. At the end every rank prints ``param_checksum rank=R value=SHA256``
(of its parameters as float64) so one can check that all ranks hold identical parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    from meshrun.train import report  # `meshrun jobs` shows the step and the loss (rank 0, under meshrun only)
except ImportError:  # run where meshrun is not installed

    def report(step: int, total: int | None = None, **numbers: float) -> None:
        pass


IN, HIDDEN, OUT = 16, 32, 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint",
        default=None,
        help="path (rank 0 writes, all ranks resume) [checkpoints/$MESHRUN_RUN_ID.pt, else checkpoint.pt]",
    )
    p.add_argument("--fail-rank", type=int, default=None, help="this rank exits at start (tests)")
    p.add_argument("--fail-code", type=int, default=1, help="exit code for --fail-rank")
    p.add_argument("--sleep-per-step", type=float, default=0.0, help="seconds to sleep each step (tests)")
    p.add_argument("--log-steps", action="store_true", help="every rank prints `step N` after each step")
    return p.parse_args(argv)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def batches(seed: int, rank: int, epoch: int, steps: int, bs: int, device):
    """Deterministic data for (seed, rank, epoch): y = x @ w_true + noise, same w_true everywhere."""
    w_true = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + epoch)
    for _ in range(steps):
        x = torch.randn(bs, IN, generator=g)
        y = x @ w_true + 0.01 * torch.randn(bs, OUT, generator=g)
        yield x.to(device), y.to(device)


def checksum(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().to("cpu", torch.float64).flatten() for p in model.parameters()])
    # bytes of the storage, not .numpy(): torch does not depend on numpy, and it may be absent.
    return hashlib.sha256(bytes(flat.contiguous().untyped_storage())).hexdigest()


def checkpoint_path(given: str | None) -> str:
    """--checkpoint, else the run's file under meshrun (a new job is a new run: it does not resume another's)."""
    if given is not None:
        return given
    run = os.environ.get("MESHRUN_RUN_ID")
    return os.path.join("checkpoints", f"{run}.pt") if run else "checkpoint.pt"


def save_checkpoint(path: str, model, opt, epoch: int) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"epoch": epoch, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path)


@record
def main(argv=None) -> int:
    args = parse_args(argv)
    args.checkpoint = checkpoint_path(args.checkpoint)
    rank = int(os.environ.get("RANK", "0"))
    if args.fail_rank is not None and rank == args.fail_rank:
        print(f"rank {rank} failing on purpose with exit code {args.fail_code}", file=sys.stderr, flush=True)
        sys.exit(args.fail_code)

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts them)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    start = 0
    # Only rank 0 writes the checkpoint, and on other nodes the file may not exist: rank 0
    # reads it and sends it to everyone, so all ranks resume from the same epoch.
    box = [None]
    if rank == 0 and args.checkpoint and os.path.exists(args.checkpoint):
        box[0] = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        state = box[0]
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["epoch"])
        if rank == 0:
            print(f"resumed from epoch {start}", flush=True)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    if rank == 0:
        print(f"training on {world} rank(s), backend {dist.get_backend()}, device {device.type}", flush=True)

    loss_fn = torch.nn.MSELoss()
    for epoch in range(start, args.epochs):
        total = torch.zeros((), device=device, dtype=torch.float64)
        for i, (x, y) in enumerate(batches(args.seed, rank, epoch, args.steps_per_epoch, args.batch_size, device)):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            total += loss.detach().double()
            if args.log_steps:
                print(f"step {epoch * args.steps_per_epoch + i + 1}", flush=True)
            if args.sleep_per_step:
                time.sleep(args.sleep_per_step)
        dist.all_reduce(total)
        mean = total.item() / (world * max(1, args.steps_per_epoch))
        report((epoch + 1) * args.steps_per_epoch, args.epochs * args.steps_per_epoch, loss=mean)
        if rank == 0:
            print(f"epoch {epoch + 1} loss {mean:.4f}", flush=True)
            if args.checkpoint:
                save_checkpoint(args.checkpoint, model, opt, epoch + 1)
        dist.barrier()

    print(f"param_checksum rank={rank} value={checksum(model)}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
