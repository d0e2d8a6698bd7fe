"""Work that ends after the script's last line: a non-daemon thread (a checkpoint upload), a
ThreadPoolExecutor's queued job (as torch.distributed.checkpoint's async save uses) and an atexit handler,
each writing a file into the working directory 1 s after the script returned. Python waits for all three."""

import atexit
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
dist.destroy_process_group()


def later(name):
    time.sleep(1)
    with open(f"{name}-r{rank}.done", "w") as f:
        f.write(f"{os.getpid()}\n")


threading.Thread(target=later, args=("thread",)).start()
ThreadPoolExecutor(1).submit(later, "executor")
atexit.register(later, "atexit")
print(f"final-digest {int(t.item())}")
