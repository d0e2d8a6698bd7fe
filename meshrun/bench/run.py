"""`meshrun bench` on the coordinator: run the bench worker on every node as a job, collect its result.

`run` launches ``python -m meshrun.bench.worker`` on every node through `meshrun train`'s own
machinery (agents, torchrun, the coordinator's rendezvous store, NCCL/Gloo pinned to the
overlay), so the numbers describe the path training takes. Rank 0 prints one result line;
`run` picks it up, adds each pair's path as the coordinator decided it, and flags slow pairs.
The result is kept in the coordinator's state directory (meshrun.jobs.submission.BENCH_RESULT, with
"measured_at"): `meshrun train --compression auto` chooses its DiLoCo preset from it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from meshrun.bench.report import (
    DEFAULT_SIZES,
    DEFAULT_STREAMS,
    PROGRESS_MARKS,
    RESULT_MARK,
    auto_duration,
    summarize,
    worker_args,
)
from meshrun.errors import LaunchError, UsageError
from meshrun.jobs import control, submission
from meshrun.mesh import status
from meshrun.mesh.coordinator import admin


class _Capture:
    """Keeps the bench job's output, picks out the result line, echoes progress lines."""

    def __init__(self, echo=None) -> None:
        self.lines: list[str] = []
        self.result: dict | None = None
        self.echo = echo

    def line(self, text: str) -> None:
        if RESULT_MARK in text:
            try:
                self.result = json.loads(text.split(RESULT_MARK, 1)[1])
                return
            except ValueError:
                pass
        self.lines.append(text)
        # Progress only (pair results, sizes done, the job's own lines): torch's warnings stay in
        # the buffer and are shown if the job fails.
        if self.echo and any(k in text for k in PROGRESS_MARKS):
            self.echo(text)


def run(
    state,
    *,
    sizes: str = DEFAULT_SIZES,
    duration: float | None = None,
    streams: int = DEFAULT_STREAMS,
    iters: int = 10,
    nodes: list[str] | None = None,
    nproc_per_node: int | None = 1,
    wait_timeout: float = 60,
    echo=None,
    env: dict[str, str] | None = None,
) -> dict:
    """Run the benchmark from the coordinator; returns `summarize`'s dict (plus "elapsed_s").

    Without `duration`, pair tests share about 20 s (`auto_duration`); each all-reduce size gets a
    time budget and a size slower than it is the last, so that 4 nodes finish in under a minute.
    Raises LaunchError with the workers' last output when the job fails.
    """
    t0 = time.monotonic()
    _, members = admin.members(state)
    n_nodes = len([m for m in members if not m.is_coordinator and (not nodes or m.name in nodes)])
    if n_nodes < 2:
        raise UsageError(
            f"meshrun bench needs at least 2 nodes, the network has {n_nodes}",
            "join more nodes with `meshrun join TOKEN`",
        )
    budget = 3.0 if n_nodes <= 4 else 2.0
    if duration is None:
        duration = auto_duration(n_nodes)
    args = worker_args(sizes, duration, streams, iters, budget)
    spec = submission.job_spec(
        {
            "script": "meshrun.bench.worker",
            "script_args": args,
            "nodes": nodes,
            "nproc_per_node": nproc_per_node,
            "wait_timeout": wait_timeout,
            "no_sync": True,
            "env": dict(env or {}),
            "job_id": submission.new_job_id("bench"),
            "module": True,
        },
        Path("/"),
    )
    submission.check(state, spec)
    cap = _Capture(echo)
    rec = control.follow(state, control.submit(state, spec), lambda line, ours: cap.line(line))
    if rec.exit_code != 0 or cap.result is None:
        tail = "\n".join(cap.lines[-15:])
        raise LaunchError(
            f"the benchmark job failed ({rec.message or rec.state}); last output:\n{tail}",
            "check `meshrun status` and that every node can run `meshrun train`",
        )
    labels = status.pair_labels(state)
    for pair in cap.result.get("pairs", []):
        pair["path"] = labels.get(frozenset((pair["src"], pair["dst"])), "unknown")
    res = summarize(cap.result)
    res["elapsed_s"] = round(time.monotonic() - t0, 2)
    res["measured_at"] = time.time()
    state.write_json(submission.BENCH_RESULT, res)
    return res
