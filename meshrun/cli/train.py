"""Commands that run work on the nodes: train."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from meshrun.cli.app import Application, StateOpt, handled, root


@root.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True,
                                "allow_extra_args": True})
@handled
def train(
    ctx: typer.Context,
    script: Annotated[Optional[str], typer.Argument(
        help="Training script (a module name with --module); its args follow it. [the job file's]")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="TOML job file with these options (configs/job.example.toml); the command line wins.")] = None,
    nnodes: Annotated[Optional[str], typer.Option(help="Nodes to train on: N or MIN:MAX (elastic) [all joined].")] = None,
    nproc_per_node: Annotated[Optional[int], typer.Option(help="Workers per node [GPUs on the node, else 1].")] = None,
    max_restarts: Annotated[Optional[int], typer.Option(help="torchrun --max-restarts: restarts after a failure. [0]")] = None,
    nodes: Annotated[Optional[str], typer.Option(help="Comma-separated node names to use [all].")] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", help="KEY=VALUE for every worker (repeatable).")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Seconds to wait for the nodes to be ready. [120]")] = None,
    rdzv_timeout: Annotated[Optional[int], typer.Option(help="Seconds the rendezvous waits for every node. [900]")] = None,
    module: Annotated[bool, typer.Option("--module", help="SCRIPT is a module name, run as python -m SCRIPT.")] = False,
    no_sync: Annotated[bool, typer.Option("--no-sync", help="Do not ship code: it already is at this path on every node.")] = False,
    sync_limit: Annotated[Optional[int], typer.Option(help="Most MiB of code to ship. [50]")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each node's command and environment, run nothing.")] = False,
    local: Annotated[bool, typer.Option("--local", help="Run only this node's share (you start every node yourself).")] = False,
    job_id: Annotated[Optional[str], typer.Option(help="Rendezvous id (needed with --local; same on every node).")] = None,
    python: Annotated[Optional[str], typer.Option(help="Python interpreter on the nodes [the agent's].")] = None,
    state_dir: StateOpt = None,
) -> None:
    """Train across every node: torchrun on each, rendezvous at the coordinator, NCCL/Gloo pinned to the overlay.

    \b
    Meshrun's options come before the script; everything after it goes to the script.
    Examples:
      meshrun train train.py --epochs 3
      meshrun train --nnodes 2 --nproc-per-node 4 train.py --epochs 3
      meshrun train --config job.toml                 # options from a job file
      meshrun train --dry-run train.py
      meshrun train --local --nnodes 2 --job-id exp7 train.py     # on each node, e.g. from a batch job
    Exits with the first failing rank's exit code; Ctrl-C stops the job on every node.
    """
    from meshrun.core import jobfile
    from meshrun.jobs import runner
    from meshrun.system.store import read_user_file
    app = Application.for_command(state_dir)
    cli = {"script": script, "script_args": list(ctx.args) if script is not None else None, "nnodes": nnodes,
           "nproc_per_node": nproc_per_node, "max_restarts": max_restarts,
           "nodes": [n.strip() for n in nodes.split(",") if n.strip()] if nodes else None,
           "wait_timeout": timeout, "rdzv_timeout": rdzv_timeout, "module": module, "no_sync": no_sync,
           "sync_limit_mb": sync_limit, "dry_run": dry_run, "env": runner.parse_env_pairs(env or []),
           "job_id": job_id, "python": python}
    from_file = jobfile.parse(read_user_file(config, "job file", "--config"), f"job file {str(config)!r}") if config else {}
    req = runner.TrainRequest(**jobfile.merge(from_file, cli))
    app.exit(runner.train_local(app.state, req) if local else runner.train(app.state, req))
