"""torchrun with warm or cold workers: ``python -m meshrun.jobs.agent [--workers warm|cold] [torchrun's options]
[-m] SCRIPT ARGS...``.

torch's own elastic agent (torch.distributed.run's options, rendezvous, restarts and exit). Each worker is
meshrun.jobs.worker's wrapper (prefixed lines, exit records, signals passed on) around the script, which it
forks and runs as ``python -u SCRIPT ARGS`` (``-m MODULE``) would (`worker.run_as_main`), ending it as that
interpreter would without tearing its objects down (warmfork.exit_as_interpreter). The kinds differ only in
where the wrapper comes from:

- warm (the default): forked from a forkserver with torch imported, instead of each being a new Python that
  imports torch again. That import is about 3 s on a 2-core node; after a lost node every survivor's restarted
  workers waited for it before resuming (benchmarks/results/ha_failover.json). The forkserver is itself a fork
  of the agent, which imported torch to parse torchrun's options (warmfork.start_forkserver): the import is
  paid once per node and job. torch._dynamo is not preloaded (PRELOAD says why).
- cold: a new ``python -u -m meshrun.jobs.worker`` per worker, as torchrun starts a script; nothing is forked
  from a process that imported torch, so the script imports it (and initialises CUDA) itself.

The forkserver and multiprocessing's resource tracker are the agent's children; the workers are theirs.
A regroup ends the workers only (meshrun.jobs.share.restart_workers), so the next ones are warm too.
"""

from __future__ import annotations

import logging
import sys
import traceback

from meshrun.core.launch import DEFAULT_WORKERS, WORKER_KINDS
from meshrun.errors import MeshrunError, UsageError
from meshrun.system.machine import warmfork

# What the forkserver imports before it forks a worker: torch and the wrapper each worker runs. Not torch._dynamo,
# which a script's first optimizer imports (2 s more on a 2-core node): with it imported before the fork, the
# tutorial DDP script (tests/corpus/ddp_tutorial_series/multigpu_torchrun.py) deadlocked as its DDP model was freed
# (gloo's thread waiting for the GIL that the reducer's destructor held) in 4 of 12 runs under CPU load, and in
# 0 of 12 without it, alternating (benchmarks/exit_stress.py screening, 2026-11-29).
PRELOAD = ("torch", "torch.distributed", "meshrun.jobs.worker")
START_METHOD = "forkserver"
WORKER_MODULE = "meshrun.jobs.worker"  # a cold worker: ``python -u -m WORKER_MODULE``


def _preformat(record: logging.LogRecord) -> bool:
    """A logging filter: a record's traceback turned into its text here, with the standard formatter's format.

    torch's log formatter imports torch._dynamo (about 3.5 s on a 2-core node) to format any traceback, and
    the agent logs one for every worker that failed or was ended by a regroup: the restart waited for it."""
    if record.exc_info and not record.exc_text:
        record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
    record.exc_info = None
    return True


# The logger of the agent's "failed (exitcode: ...)" line, which carries the traceback of its own wait.
FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def quick_tracebacks() -> None:
    """Put `_preformat` on the failure line's logger and on every handler of torch's loggers and the root's."""
    logging.getLogger(FAILURE_LOGGER).addFilter(_preformat)
    loggers = [logging.getLogger()] + [
        lg for name, lg in logging.Logger.manager.loggerDict.items() if name.split(".")[0] == "torch"
    ]
    for lg in loggers:
        for handler in getattr(lg, "handlers", ()):  # a PlaceHolder has none
            if _preformat not in handler.filters:
                handler.addFilter(_preformat)


def worker_args(module: bool, script: str, script_args: list[str]) -> tuple[str, ...]:
    """The arguments of `meshrun.jobs.worker.forked` for SCRIPT (or MODULE) and its arguments."""
    return ("--module" if module else "--", script, *script_args)


def split_workers(argv: list[str]) -> tuple[str, list[str]]:
    """(the worker kind, torchrun's arguments) from the agent's command line: ``--workers KIND`` may come
    first (meshrun.core.launch puts it there) [launch.DEFAULT_WORKERS]. UsageError for an unknown kind."""
    kind = DEFAULT_WORKERS
    if argv[:1] == ["--workers"] or (argv and argv[0].startswith("--workers=")):
        if "=" in argv[0]:
            kind, argv = argv[0].split("=", 1)[1], argv[1:]
        elif len(argv) > 1:
            kind, argv = argv[1], argv[2:]
        else:
            kind, argv = "", argv[1:]
        if kind not in WORKER_KINDS:
            raise UsageError(f"--workers {kind!r} is not one of {', '.join(WORKER_KINDS)}", "use warm or cold")
    return kind, argv


def entrypoint(kind: str, module: bool, script: str, script_args: list[str]) -> tuple[object, tuple[str, ...]]:
    """What torch's elastic launch runs as each worker of `kind`, and its arguments: warm, `worker.forked` in
    a fork of the forkserver; cold, a new ``python -u -m meshrun.jobs.worker`` (a command, as torchrun runs a
    script)."""
    args = worker_args(module, script, script_args)
    if kind == "cold":
        return sys.executable, ("-u", "-m", WORKER_MODULE, *args)
    from meshrun.jobs import worker

    return worker.forked, args


def main(argv: list[str] | None = None) -> None:
    """Parse torchrun's command line, start the warm forkserver (warm workers), run torch's elastic launch;
    raises as torchrun does (ChildFailedError when the workers failed: the exit status is then 1)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    kind, rest = split_workers(list(sys.argv[1:] if argv is None else argv))
    args = torchrun.parse_args(rest)
    if args.no_python:
        raise UsageError("meshrun.jobs.agent runs Python scripts only (--no-python given)", "drop --no-python")
    if args.standalone:
        raise UsageError(
            "meshrun.jobs.agent takes its rendezvous from the command line (--standalone given)",
            "pass --rdzv-backend and --rdzv-endpoint (meshrun's launch plan does)",
        )
    if args.master_port is None:  # as torchrun's run() does (used by the static backend only)
        args.master_port = 29500
    if kind == "warm":
        args.start_method = START_METHOD
        # Before config_from_args: its launch config asks CUDA for the device count on a CUDA build, after which
        # no fork of this process could use the GPU. The OMP_NUM_THREADS it then sets reaches each worker in
        # torch's per-worker environment, which the worker applies (meshrun.jobs.worker.forked).
        warmfork.start_forkserver(PRELOAD)
    config, _cmd, _cmd_args = torchrun.config_from_args(args)  # also sets OMP_NUM_THREADS as torchrun does
    quick_tracebacks()  # once torch's loggers are all made
    run, run_args = entrypoint(kind, args.module, args.training_script, list(args.training_script_args))

    @record  # torchrun's error summary when workers fail
    def launch() -> None:
        elastic_launch(config=config, entrypoint=run)(*run_args)

    launch()


if __name__ == "__main__":
    try:
        main()
    except MeshrunError as exc:
        sys.stderr.write(f"meshrun.jobs.agent: {exc}\n")
        sys.exit(2)
