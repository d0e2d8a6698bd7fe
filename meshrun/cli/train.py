"""Commands that run work on the nodes: train, jobs, logs, cancel."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from meshrun.cli.app import Application, JsonOpt, StateOpt, handled, root

JobArg = Annotated[str, typer.Argument(help="A job id (see `meshrun jobs`).")]


@root.command(
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True, "allow_extra_args": True}
)
@handled
def train(
    ctx: typer.Context,
    script: Annotated[
        Optional[str],
        typer.Argument(help="Training script (a module name with --module); its args follow it. [the job file's]"),
    ] = None,
    config: Annotated[
        Optional[Path],
        typer.Option(
            "--config", help="TOML job file with these options (configs/job.example.toml); the command line wins."
        ),
    ] = None,
    nnodes: Annotated[
        Optional[str], typer.Option(help="Nodes to train on: N or MIN:MAX (elastic) [all joined].")
    ] = None,
    nproc_per_node: Annotated[Optional[int], typer.Option(help="Workers per node [GPUs on the node, else 1].")] = None,
    max_restarts: Annotated[
        Optional[int], typer.Option(help="torchrun --max-restarts: restarts after a failure. [0]")
    ] = None,
    nodes: Annotated[Optional[str], typer.Option(help="Comma-separated node names to use [all].")] = None,
    env: Annotated[Optional[list[str]], typer.Option("--env", help="KEY=VALUE for every worker (repeatable).")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Seconds to wait for the nodes to be ready. [120]")] = None,
    rdzv_timeout: Annotated[
        Optional[int], typer.Option(help="Seconds the rendezvous waits for every node. [900]")
    ] = None,
    module: Annotated[bool, typer.Option("--module", help="SCRIPT is a module name, run as python -m SCRIPT.")] = False,
    no_sync: Annotated[
        bool, typer.Option("--no-sync", help="Do not ship code: it already is at this path on every node.")
    ] = False,
    sync_limit: Annotated[Optional[int], typer.Option(help="Most MiB of code to ship. [50]")] = None,
    with_coordinator: Annotated[
        bool, typer.Option("--with-coordinator", help="The coordinator takes a share too.")
    ] = False,
    detach: Annotated[bool, typer.Option("--detach", help="Print the job id once it started and return.")] = False,
    skip_preflight: Annotated[
        bool, typer.Option("--skip-preflight", help="Start even if the nodes' environments disagree.")
    ] = False,
    site_fabric: Annotated[
        bool,
        typer.Option(
            "--site-fabric",
            help="Let NCCL use InfiniBand/RoCE in meshrun.train.sites' site groups (every other NCCL "
            "communicator stays on the overlay's sockets).",
        ),
    ] = False,
    compression: Annotated[
        Optional[str],
        typer.Option(
            help="DiLoCo preset for the script's DiLoCo (H, fragments, format through MESHRUN_DILOCO_*): "
            "auto|none|low|medium|high; auto picks from the latest `meshrun bench` and --model-size.",
        ),
    ] = None,
    model_size: Annotated[
        Optional[str], typer.Option(help="Parameters of the model, e.g. 1.3B or 350M (for --compression auto).")
    ] = None,
    step_time: Annotated[
        Optional[float],
        typer.Option(help="Seconds per training step, for --compression auto [1.0, assumed]."),
    ] = None,
    use_shell_ifname: Annotated[
        bool,
        typer.Option(
            "--use-shell-ifname",
            help="Pass this shell's NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to the workers over meshrun's pinning "
            "(refused without it: such a variable sends collectives off the overlay).",
        ),
    ] = False,
    mixed_accelerators: Annotated[
        bool,
        typer.Option(
            "--mixed-accelerators",
            help="CUDA, ROCm and CPU nodes in one job whose collectives run over gloo (DiLoCo): the pre-flight "
            "only warns when torch builds differ.",
        ),
    ] = False,
    workers: Annotated[
        Optional[str],
        typer.Option(
            help="How each worker starts: warm (forked from a process per node that imported torch once: no "
            "import at a start or restart) or cold (a new Python per worker, as torchrun starts one). Both run "
            "the script and end it as `python -u` would (docs/jobs.md). [warm]",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print each node's command and environment, run nothing.")
    ] = False,
    local: Annotated[
        bool, typer.Option("--local", help="Run only this node's share (you start every node yourself).")
    ] = False,
    job_id: Annotated[
        Optional[str], typer.Option(help="The job's id [SCRIPT-DATE-TIME-RANDOM]; needed with --local.")
    ] = None,
    python: Annotated[Optional[str], typer.Option(help="Python interpreter on the nodes [the agent's].")] = None,
    project: Annotated[
        Optional[str],
        typer.Option(
            help="The job's persistent directory on every node, kept for the next job of the project "
            "[the code directory's name]."
        ),
    ] = None,
    resume: Annotated[
        Optional[str],
        typer.Option(
            metavar="JOB",
            help="Continue JOB's run in its project, with its options unless given here: $MESHRUN_RUN_ID is JOB's "
            "run, so checkpoints kept under it (DiLoCo's snapshots) are found. Without it a job starts a fresh run.",
        ),
    ] = None,
    state_dir: StateOpt = None,
) -> None:
    """Train across every node: torchrun on each, rendezvous at the coordinator, NCCL/Gloo pinned to the overlay.

    \b
    Meshrun's options come before the script; everything after it goes to the script.
    Examples:
      meshrun train train.py --epochs 3
      meshrun train --nnodes 2 --nproc-per-node 4 train.py --epochs 3
      meshrun train --config job.toml                 # options from a job file
      meshrun train --detach train.py                 # then: meshrun logs -f JOB
      meshrun train --dry-run train.py                # also shows what is shipped and what is not
      meshrun train --resume JOB                      # continue JOB's run, from its checkpoints
      meshrun train --local --nnodes 2 --job-id exp7 train.py     # on each node, e.g. from a batch job
      meshrun train --compression auto --model-size 350M diloco.py   # DiLoCo H/format from the link
      meshrun train --mixed-accelerators diloco.py    # CUDA, ROCm and CPU nodes; collectives over gloo
    The script's directory is shipped (what git would track, minus .meshrunignore) into the
    project's directory on every node, which is kept between jobs ($MESHRUN_OUTPUT_DIR; `meshrun
    pull` fetches files). Each job is a fresh run unless --resume: $MESHRUN_RUN_ID is the job's id, or
    the resumed job's run; checkpoints kept under it are continued only by resumes (DiLoCo's are).
    Before anything starts, every node's environment is compared (Python, torch and its build, NCCL,
    GPUs, free disk, the code, the clock): a mismatch that breaks collectives stops the job with a
    table of what differs and the fix (--dry-run shows it too; --skip-preflight to start anyway).
    The job belongs to the coordinator, not to this terminal: closing it leaves the job running.
    Ctrl-C cancels the job on every node (as torchrun does). Exits with the job's exit code.
    """
    from meshrun.core import jobconfig
    from meshrun.jobs import control, submission
    from meshrun.system.files.statedir import read_user_file

    app = Application.for_command(state_dir)
    cli = {
        "script": script,
        "script_args": list(ctx.args) if script is not None else None,
        "nnodes": nnodes,
        "nproc_per_node": nproc_per_node,
        "max_restarts": max_restarts,
        "nodes": [n.strip() for n in nodes.split(",") if n.strip()] if nodes else None,
        "wait_timeout": timeout,
        "rdzv_timeout": rdzv_timeout,
        "module": module,
        "no_sync": no_sync,
        "sync_limit_mb": sync_limit,
        "dry_run": dry_run,
        "env": submission.parse_env_pairs(env or []),
        "job_id": job_id,
        "python": python,
        "with_coordinator": with_coordinator,
        "detach": detach,
        "skip_preflight": skip_preflight,
        "site_fabric": site_fabric,
        "project": project,
        "compression": compression,
        "model_size": model_size,
        "step_time": step_time,
        "mixed_accelerators": mixed_accelerators,
        "workers": workers,
        "use_shell_ifname": use_shell_ifname or None,
    }
    from_file = (
        jobconfig.parse(read_user_file(config, "job file", "--config"), f"job file {str(config)!r}") if config else {}
    )
    cwd = Path.cwd()
    if resume:
        earlier, earlier_cwd = submission.resumed(app.state, resume)
        if script is None and not from_file.get("script"):
            cwd = earlier_cwd  # the same code, from where it was submitted
        else:
            earlier.pop("script_args", None)
        from_file = {**earlier, **from_file, "env": {**earlier.get("env", {}), **from_file.get("env", {})}}
    options = jobconfig.merge(from_file, cli)
    notice = submission.shell_notice(options)  # the shell's variables, said before anything starts
    if local:
        options["job_id"] = submission.local_job_id(options.get("job_id"))
        spec = submission.job_spec(options, cwd)
        if notice:
            app.echo(notice, err=True)
        choice = submission.choose_compression(app.state, spec, spec.bounds(1)[1])
        if choice is not None:
            app.echo(f"meshrun: {choice.line()}", err=True)
        p = submission.local_launch(app.state, spec)
        if options.get("dry_run"):
            app.echo(p.shell())
            return
        submission.exec_local(p)
    spec = submission.job_spec(options, cwd)
    if notice:
        app.echo(notice, err=True)
    if options.get("dry_run"):
        from meshrun.core import termtext

        # The pre-flight table and the commands carry what nodes reported (versions, GPU names, errors,
        # file names, interpreter paths): nothing in them may rewrite this terminal.
        for line in submission.dry_run(app.state, spec):
            app.echo(termtext.clean(line))
        return
    _, shares = submission.check(app.state, spec)
    choice = submission.choose_compression(app.state, spec, min(spec.bounds(len(shares))[1], len(shares)))
    if choice is not None:
        app.echo(f"meshrun: {choice.line()}", err=True)
    job = control.submit(app.state, spec)
    if options.get("detach"):
        app.echo(job)
        return
    app.echo(
        f"meshrun: job {job} submitted. Ctrl-C cancels it on every node (as with torchrun); if this "
        f"terminal closes, the job keeps running: `meshrun logs -f {job}`, `meshrun cancel {job}`",
        err=True,
    )
    app.exit(_follow(app, job, cancel_on_interrupt=True).exit_code or 0)


def _follow(
    app: Application,
    job: str,
    cancel_on_interrupt: bool,
    node: str | None = None,
    rank: int | None = None,
    tail: int | None = None,
    since: float | None = None,
):
    """Print the job as it runs until it ends; Ctrl-C cancels it (train) or stops following (logs)."""
    from meshrun.jobs import control

    stop = threading.Event()
    printer = JobPrinter(app)

    def interrupted(*_) -> None:
        if not cancel_on_interrupt:
            stop.set()
            return
        printer.say(f"meshrun: cancelling job {job} on every node ...")  # below the bars, not among them
        threading.Thread(target=control.cancel, args=(app.state, job), daemon=True).start()

    old = signal.signal(signal.SIGINT, interrupted)
    try:
        rec = control.follow(app.state, job, printer, node, rank, stop=stop, tail=tail, since=since)
    finally:
        printer.finish()
        signal.signal(signal.SIGINT, old)
    if stop.is_set():
        app.echo(f"meshrun: stopped following job {job} (it goes on: `meshrun logs -f {job}`)", err=True)
        app.exit(0)
    return rec


class JobPrinter:
    """Shows a job's stored lines on this terminal: nodes' lines on stdout, meshrun's own on stderr, control
    sequences but colours removed, progress-bar redraws as a terminal shows them (meshrun.core.termtext:
    on a terminal each bar redrawn in place on a row of its own, in a file or a pipe only its states that
    were not superseded)."""

    def __init__(self, app: Application) -> None:
        from meshrun.core import termtext

        self.app = app
        self.redraws = termtext.Redraws(tty=app.is_tty())

    def __call__(self, line: str, ours: bool) -> None:
        from meshrun.core.termtext import LINE_RE

        if ours:
            self.say(line)
            return
        m = LINE_RE.match(line)
        prefix, rest = (m.group(0), line[m.end() :]) if m else ("", line)
        if self.redraws.tty:  # asked each time: the window may have been resized
            self.redraws.width = shutil.get_terminal_size().columns
        for text in self.redraws.line(prefix, prefix, rest, time.monotonic()):
            self.app.write(text)

    def say(self, line: str) -> None:
        """A line of meshrun's own on stderr; the bars on the screen step aside for it."""
        from meshrun.core import termtext

        for text in self.redraws.interrupt():
            self.app.write(text)
        self.app.echo(termtext.clean(line), err=True)
        for text in self.redraws.resume():
            self.app.write(text)

    def finish(self) -> None:
        for text in self.redraws.finish():
            self.app.write(text)


@root.command()
@handled
def jobs(
    json_out: JsonOpt = False,
    prune: Annotated[
        bool,
        typer.Option(
            "--prune",
            help="Delete every finished job's logs here and its job directory on its nodes "
            "(projects and their checkpoints stay).",
        ),
    ] = False,
    prune_project: Annotated[
        Optional[str],
        typer.Option(
            metavar="PROJECT", help="Delete PROJECT's directory (checkpoints included) on every node that ran it."
        ),
    ] = None,
    state_dir: StateOpt = None,
) -> None:
    """List the jobs on this coordinator: id, state, nodes, ranks, started, duration, how far (the step and
    steps a second, where the script reports them with meshrun.train.report or a tqdm bar), its last output,
    the node with rank 0, how often its group re-formed, exit, worker kind.

    \b
    Examples:
      meshrun jobs
      meshrun jobs --json | jq '.[] | select(.state == "running")'
      meshrun jobs --prune                  # finished jobs' logs and job directories
      meshrun jobs --prune-project charlm   # a project's working directory on every node
    """
    from meshrun.core import progress
    from meshrun.jobs import control, outputs

    app = Application.for_command(state_dir)
    if prune or prune_project:
        if prune:
            done = outputs.prune(app.state, lambda line: app.echo(f"meshrun: {line}", err=True))
            app.echo(f"pruned {len(done)} finished job(s)" + (f": {', '.join(done)}" if done else ""))
        if prune_project:
            where = outputs.remove_project(app.state, prune_project)
            app.echo(f"removed project {prune_project} on {', '.join(where) if where else 'no member'}")
        return
    recs = control.list_jobs(app.state)
    if json_out:
        app.echo(json.dumps([r.to_dict() for r in recs], indent=2))
        return
    now = time.time()
    rows = [
        [
            r.job_id,
            r.state,
            ",".join(r.nodes) or "-",
            str(r.ranks or "-"),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started)) if r.started else "-",
            _duration(r.duration(now)) if r.started else "-",
            *progress.cells(r.progress, r.last_output, now),
            r.rank0 or "-",
            str(r.regroups),
            "-" if r.exit_code is None else str(r.exit_code),
            r.workers or "-",
        ]
        for r in recs
    ]
    cols = ["JOB", "STATE", "NODES", "RANKS", "STARTED", "DURATION", "STEP", "RATE", "LAST OUTPUT", "RANK 0"]
    cols += ["REGROUPS", "EXIT", "WORKERS"]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]
    for row in [cols] + rows:
        app.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    if not rows:
        app.echo("(no jobs yet)")


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@root.command()
@handled
def logs(
    job: JobArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    node: Annotated[Optional[str], typer.Option(help="Only this node's lines.")] = None,
    rank: Annotated[Optional[int], typer.Option(help="Only this rank's lines.")] = None,
    tail: Annotated[
        Optional[int], typer.Option("--tail", "-n", min=0, help="Start with the last N lines (then -f goes on).")
    ] = None,
    since: Annotated[
        Optional[str], typer.Option(help="Only lines from this long ago on: 90s, 30m, 12h, 7d.", show_default=False)
    ] = None,
    state_dir: StateOpt = None,
) -> None:
    """Print a job's output from its start (every rank, prefixed [node rRANK]); -f follows it.

    \b
    Works while the job runs, after it ended, and after a coordinator restart. Examples:
      meshrun logs ddp_train-20261122-101500-ab12 -f
      meshrun logs JOB --node gpu-a --rank 3
      meshrun logs JOB -f --tail 50           # a long job: its last 50 lines, then what comes
      meshrun logs JOB --since 2h             # what arrived in the last two hours
    """
    from meshrun.core.token import parse_duration
    from meshrun.jobs import control

    start = time.time() - parse_duration(since, "--since") if since is not None else None
    app = Application.for_command(state_dir)
    if follow:
        rec = _follow(app, job, cancel_on_interrupt=False, node=node, rank=rank, tail=tail, since=start)
    else:
        printer = JobPrinter(app)
        rec = control.follow(app.state, job, printer, node, rank, keep_going=False, tail=tail, since=start)
        printer.finish()
    if rec.final:
        app.echo(
            f"meshrun: job {job} {rec.state}" + (f" (exit {rec.exit_code})" if rec.exit_code is not None else ""),
            err=True,
        )


@root.command()
@handled
def cancel(job: JobArg, state_dir: StateOpt = None) -> None:
    """Cancel a running job on every node.

    \b
    Example:
      meshrun cancel ddp_train-20261122-101500-ab12
    """
    from meshrun.jobs import control

    app = Application.for_command(state_dir)
    if control.cancel(app.state, job):
        app.echo(f"cancelled {job}")
    else:
        rec = control.record(app.state, job)
        app.echo(f"job {job} is not running ({rec.state})")


@root.command()
@handled
def pull(
    job: JobArg,
    path: Annotated[str, typer.Argument(help="A file or directory, relative to the job's working directory.")],
    node: Annotated[Optional[str], typer.Option(help="Only from this node [every node of the job].")] = None,
    dest: Annotated[
        Optional[Path], typer.Option(help="Where to put the files: DEST/NODE/PATH. [./meshrun-pulled/JOB]")
    ] = None,
    max_mb: Annotated[int, typer.Option(help="Most MiB to fetch from each node.")] = 1024,
    state_dir: StateOpt = None,
) -> None:
    """Fetch files a job wrote on its nodes (checkpoints, logs) to this machine, over the overlay.

    \b
    The job's working directory on each node is its project's, kept after the job; each node has its
    own (a file only rank 0 saved is on rank 0's node). The code sync never ships ./meshrun-pulled.
    Examples:
      meshrun pull JOB checkpoints/last.pt     # ./meshrun-pulled/JOB/NODE/checkpoints/last.pt per node
      meshrun pull JOB runs --node gpu-a --dest ./results
    """
    from meshrun.core import termtext
    from meshrun.jobs import outputs

    app = Application.for_command(state_dir)
    if max_mb < 1:
        from meshrun.errors import UsageError

        raise UsageError(f"--max-mb {max_mb} is less than 1", "e.g. --max-mb 1024")
    results = outputs.pull(app.state, job, path, dest, node=node, max_mb=max_mb)
    for r in results:
        if r.error:  # the node's words: nothing in them may rewrite this terminal
            app.echo(termtext.clean(f"{r.node}: {r.error}"), err=True)
        else:
            app.echo(f"{r.node}: {r.files} file(s) in {r.dest}")
    if any(r.error for r in results):
        app.exit(1)


local_store_app = typer.Typer(no_args_is_help=True, help="The rendezvous store for `meshrun train --local` (opt-in).")
root.add_typer(local_store_app, name="local-store")


@local_store_app.command("start")
@handled
def local_store_start(
    max_mb: Annotated[int, typer.Option(help="Most MiB of data the store may hold.")] = 256, state_dir: StateOpt = None
) -> None:
    """Start, on the coordinator, the store `--local` shares meet at (every member can reach it).

    \b
    Jobs run by `meshrun train` do not need it: each has its own store that only its nodes reach.
    Start this only for shares you launch on every node yourself (batch schedulers). Example:
      meshrun local-store start --max-mb 128
    """
    from meshrun.errors import UsageError
    from meshrun.jobs import localstore

    app = Application.for_command(state_dir)
    if max_mb < 1:
        raise UsageError(f"--max-mb {max_mb} is less than 1", "e.g. --max-mb 256")
    pid = localstore.start(app.state, max_mb)
    app.echo(
        f"local rendezvous store running (pid {pid}), data capped at {max_mb} MiB; `meshrun local-store stop` ends it"
    )


@local_store_app.command("stop")
@handled
def local_store_stop(state_dir: StateOpt = None) -> None:
    """Stop the store for `--local` shares.

    \b
    Example:
      meshrun local-store stop
    """
    from meshrun.jobs import localstore

    app = Application.for_command(state_dir)
    app.echo("stopped" if localstore.stop(app.state) else "it was not running")
