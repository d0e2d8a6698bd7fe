"""`meshrun bench`: measure the mesh from the coordinator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from meshrun.cli.app import Application, JsonOpt, StateOpt, handled, root


@root.command()
@handled
def bench(
    sizes: Annotated[str, typer.Option(help="All-reduce sizes, comma-separated (K/M/G binary).")] = "1M,4M,16M,64M",
    duration: Annotated[
        Optional[float],
        typer.Option(help="Seconds of TCP traffic per ordered pair [about 20 s over all pairs, 0.5-2 s each]."),
    ] = None,
    streams: Annotated[int, typer.Option(help="Parallel TCP connections per bandwidth test.")] = 4,
    iters: Annotated[int, typer.Option(help="Most timed all-reduces per size (each size is time-bounded).")] = 10,
    nodes: Annotated[Optional[str], typer.Option(help="Comma-separated node names to test [all].")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the nodes to be ready.")] = 60,
    json_out: JsonOpt = False,
    plot: Annotated[
        Optional[Path], typer.Option("--plot", help="Write a PNG heat-map here (needs matplotlib).")
    ] = None,
    state_dir: StateOpt = None,
) -> None:
    """Measure the mesh (on the coordinator): per node pair RTT, TCP bandwidth, path; then all-reduce busbw.

    \b
    Runs through the same machinery as `meshrun train` (gloo on CPU, NCCL on GPU).
    Examples:
      meshrun bench
      meshrun bench --sizes 1M,16M --duration 1 --json > bench.json
      meshrun bench --plot mesh.png            # pip install meshrun[plot]
    Pairs below half the median bandwidth are flagged SLOW.
    """
    from meshrun.bench import report
    from meshrun.bench.run import run

    app = Application.for_command(state_dir)
    if plot is not None:
        report.require_matplotlib()  # fail before the minute of measuring, not after
    res = run(
        app.state,
        sizes=sizes,
        duration=duration,
        streams=streams,
        iters=iters,
        nodes=[n.strip() for n in nodes.split(",") if n.strip()] if nodes else None,
        wait_timeout=timeout,
        echo=None if json_out else (lambda line: app.echo(line, err=True)),
    )
    if plot is not None:
        report.plot(res, plot)
    app.echo(json.dumps(res, indent=2) if json_out else report.render(res))
    if plot is not None and not json_out:
        app.echo(f"heat-map written to {plot}")
