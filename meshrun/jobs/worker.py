"""Runs as each torchrun worker: ``python -m meshrun.jobs.worker [--module] SCRIPT ARGS...``, or `forked`.

Starts the script as a child (``sys.executable -u SCRIPT ARGS`` or ``-u -m MODULE ARGS``; under
meshrun.jobs.agent, `forked`: a fork of this process, which already imported torch, running the script as
that command would, `run_as_main`), copies its stdout/stderr to ours as lines prefixed ``[NODE rRANK] ``
(meshrun.core.termtext: read in bounded chunks, lines capped, carriage-return redraws such as a tqdm bar
passed on at most twice a second and marked, control sequences but colours removed), forwards
SIGTERM/SIGINT/SIGHUP to it, and exits as it did: same exit code, or the same signal
re-raised on ourselves so torchrun sees the same death. When ``MESHRUN_JOB_DIR`` is set the
child's exit is recorded in ``$MESHRUN_JOB_DIR/exit-r{RANK}-a{RESTART}.json`` for the agent.
Stdlib only: it must not import torch (the child does, or the forkserver it came from did).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

from meshrun.core import termtext
from meshrun.errors import StateError
from meshrun.system.files.statedir import atomic_write
from meshrun.system.machine import procs, warmfork

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
USAGE = "usage: python -m meshrun.jobs.worker [--module] SCRIPT [ARGS...]"


def prefix() -> bytes:
    node = os.environ.get("MESHRUN_NODE_NAME") or os.uname().nodename
    rank = os.environ.get("RANK", "?")
    return f"[{node} r{rank}] ".encode()


def pump(src, dst, pre: bytes, clock=time.monotonic) -> None:
    """Copy `src` (a binary pipe) to `dst` (binary) as prefixed lines; a last partial line gets a newline.

    Never holds more than a chunk and a capped line: output without newlines (a progress bar) moves on
    as redraws, at most every termtext.REDRAW_EVERY seconds, the latest one always last.
    """
    lines = termtext.LineAssembler()
    fd = src.fileno()

    def put(events) -> None:
        for kind, text in events:
            mark = termtext.REDRAW if kind == "redraw" else ""
            dst.write(pre + (mark + text).encode("utf-8", errors="replace") + b"\n")
        if events:
            dst.flush()

    while True:
        data = procs.read_some(fd, termtext.REDRAW_EVERY)
        if data is None:
            put(lines.tick(clock()))
            continue
        if not data:
            break
        put(lines.feed(data, clock()))
    put(lines.close())
    src.close()


def _signame(sig: int | None) -> str | None:
    if not sig:
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def record_exit(code: int | None, sig: int | None) -> None:
    """Write the child's exit to $MESHRUN_JOB_DIR atomically (tmp + rename); no-op when unset."""
    job_dir = os.environ.get("MESHRUN_JOB_DIR")
    if not job_dir:
        return
    rank = os.environ.get("RANK", "0")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rec = {
        "rank": int(rank) if rank.isdigit() else rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0),
        "node": os.environ.get("MESHRUN_NODE_NAME", ""),
        "exit_code": code,
        "signal": _signame(sig),
        "time": time.time(),
    }
    path = os.path.join(job_dir, f"exit-r{rank}-a{attempt}.json")
    try:
        atomic_write(path, json.dumps(rec), 0o644)
    except StateError as exc:
        sys.stderr.write(f"meshrun.jobs.worker: cannot record the exit: {exc}\n")


def run_as_main(module: bool, args: list[str]) -> int:
    """Run SCRIPT (with `module`, MODULE) with ARGS in this process as ``python -u`` would in a new one:
    argv, sys.path[0], ``__main__``, the exit code of SystemExit, an uncaught exception printed through
    sys.excepthook (exit 1). Returns the exit code; -SIGINT for an uncaught KeyboardInterrupt (Python then
    ends by that signal)."""
    target = args[0]
    sys.argv = list(args)
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.realpath(target))
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _spawn(module: bool, args: list[str]):
    return procs.popen([sys.executable, "-u"] + (["-m"] if module else []) + args, stdout=procs.PIPE, stderr=procs.PIPE)


def _fork(module: bool, args: list[str]):
    return warmfork.fork_call(functools.partial(run_as_main, module, args))


def forked(*argv: str) -> None:
    """The entrypoint of meshrun.jobs.agent's workers (in a fork of its forkserver): `main` with the script
    run in a fork of this process, whose imports (torch) it inherits; exits as the script did."""
    rc = main(list(argv), start=_fork)
    if rc:
        sys.exit(rc)


def main(argv: list[str] | None = None, start=_spawn) -> int:
    """The wrapper: start the script with `start(module, args)` (a Popen-like child with stdout and stderr
    pipes), pass its lines and signals on, record and return its exit (see the module's docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    module = False
    if args and args[0] == "--module":
        module, args = True, args[1:]
    elif args and args[0] == "--":
        args = args[1:]
    if not args:
        sys.stderr.write(USAGE + "\n")
        return 2
    child = None
    pending: list[int] = []

    def forward(signum, _frame):
        if child is None:  # arrived before the child started: deliver it right after
            pending.append(signum)
            return
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    # Installed before the child starts, so no signal can kill us and orphan it.
    for s in FORWARDED:
        signal.signal(s, forward)
    try:
        child = start(module, args)
    except OSError as exc:
        sys.stderr.write(f"meshrun.jobs.worker: cannot start {args[0]}: {exc}\n")
        record_exit(127, None)
        return 127
    for signum in pending:
        child.send_signal(signum)

    pre = prefix()
    threads = [
        threading.Thread(target=pump, args=(child.stdout, sys.stdout.buffer, pre), daemon=True),
        threading.Thread(target=pump, args=(child.stderr, sys.stderr.buffer, pre), daemon=True),
    ]
    for t in threads:
        t.start()
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for safety
            continue
    for t in threads:
        t.join(timeout=10)  # a grandchild that inherited the pipes must not keep us alive
    sig = -rc if rc < 0 else None
    # A signal death is recorded as the shell reports it (128 + N) so "exit_code != 0" means failed.
    record_exit(128 + sig if sig else rc, sig)
    # Nothing left to pass signals on to: they act on this process again (a forked worker's agent stops the
    # finished ones with SIGTERM when another rank failed, and waits for them to go).
    for s in FORWARDED:
        signal.signal(s, signal.SIG_DFL)
    if sig:
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL/SIGSTOP cannot be caught, so they are default already
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        procs.signal_pid(os.getpid(), sig)
        time.sleep(1)  # the signal is delivered before this returns, unless it is ignorable
        return 128 + sig
    return rc


if __name__ == "__main__":
    sys.exit(main())
