"""`report(step, total=None, **numbers)`: a training script tells `meshrun jobs` how far it is.

    from meshrun.train import report
    report(step=1200, total=10_000, loss=2.31)

Rank 0 prints one line (meshrun.core.progress.MARK and JSON), which the job's supervisor reads and keeps out of
the job's logs; `meshrun jobs` then shows the step, the steps a second and the numbers. Any other rank, and a
script not started by meshrun (no MESHRUN_RUN_ID: plain torchrun, python), prints nothing. Stdlib only.
"""

from __future__ import annotations

import os

from meshrun.core.progress import line


def report(step: int, total: int | None = None, **numbers: float) -> None:
    """Say the job is at `step` (of `total`), with `numbers` such as loss=2.31 (rank 0 under meshrun only)."""
    if os.environ.get("RANK", "0") != "0" or not os.environ.get("MESHRUN_RUN_ID"):
        return
    print(line(step, total, **numbers), flush=True)
