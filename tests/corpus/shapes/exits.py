"""How a rank ends, chosen by --how: `exit3` (every rank calls sys.exit(3)), `raise` (rank 1 raises while
rank 0 waits in a collective), `sigterm` (rank 1 exits 4; rank 0 has its own SIGTERM handler, which the
launcher's stop reaches: it writes a last checkpoint and exits 0), `wait` (every rank sleeps until stopped:
for Ctrl-C)."""

import argparse
import signal
import sys
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--how", choices=["exit3", "raise", "sigterm", "wait"], required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} started", flush=True)
if args.how == "exit3":
    sys.exit(3)
if args.how == "raise":
    if rank == 1:
        raise ValueError("diverged at step 7")
    dist.barrier()  # never completes: the launcher stops this rank
if args.how == "sigterm":

    def on_term(signum, frame):
        with open(f"last-checkpoint-r{rank}.pt", "w") as f:
            f.write("saved on SIGTERM\n")
        print(f"rank {rank} saved a checkpoint on SIGTERM", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    if rank == 1:
        sys.exit(4)
    while True:
        time.sleep(0.1)
if args.how == "wait":
    while True:
        time.sleep(0.1)
