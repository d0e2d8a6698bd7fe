"""What this machine offers a training job: its GPUs."""

from __future__ import annotations

import os
import shutil

from meshrun.system import procs


def visible_gpus() -> int:
    """Number of CUDA devices a worker on this node would see (0 without a GPU)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = procs.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, procs.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))
