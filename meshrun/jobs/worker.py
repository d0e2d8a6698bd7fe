"""Runs as each torchrun worker: ``python -m meshrun.jobs.worker [--module] SCRIPT ARGS...`` (a cold worker:
a new interpreter), or `forked` (a warm one: meshrun.jobs.agent forks it from a forkserver that imported torch).

Either way the script runs in a fork of this process (`run_as_main` through warmfork.fork_call), as
``python -u SCRIPT ARGS`` (``-u -m MODULE ARGS``) would run it, and ends as that interpreter would end without
tearing the script's objects down (warmfork.exit_as_interpreter: threads joined, atexit, files flushed). This
wrapper copies the script's stdout/stderr to ours as lines prefixed ``[NODE rRANK] ``
(meshrun.core.termtext: read in bounded chunks, lines capped, carriage-return redraws such as a tqdm bar
passed on at most twice a second and marked, control sequences but colours removed), forwards
SIGTERM/SIGINT/SIGHUP to it, and exits as it did: same exit code, or the same signal
re-raised on ourselves so torchrun sees the same death. When ``MESHRUN_JOB_DIR`` is set the
child's exit is recorded in ``$MESHRUN_JOB_DIR/exit-r{RANK}-a{RESTART}.json`` for the agent.
Stdlib only: it must not import torch (the script does, or the forkserver a warm worker came from did).
"""

from __future__ import annotations

import builtins
import functools
import importlib.util
import io
import json
import marshal
import os
import runpy
import signal
import sys
import threading
import time
import types
import zipfile
from importlib.machinery import SourceFileLoader

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
    """Run SCRIPT (with `module`, MODULE) with ARGS in this process as ``python -u`` would in a new one, and
    return the exit code the interpreter would end with (-SIGINT for an uncaught KeyboardInterrupt: Python then
    ends by that signal).

    As the interpreter does: sys.argv, sys.path[0] (the script's real directory; the working directory for a
    module), the code run in a new ``__main__`` module that stays in sys.modules (atexit handlers, pickle and
    the spawn start method find it there), SystemExit's code, an uncaught exception printed through
    sys.excepthook and kept in sys.last_* (exit 1). Nothing the script made is freed here: its globals, and
    an uncaught exception's frames, live until the process ends (warmfork.exit_as_interpreter says why)."""
    target = args[0]
    sys.argv = list(args)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    try:
        if module:
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target, alter_argv=True)  # noqa: SLF001 - what ``python -m`` runs
        elif os.path.isdir(target) or zipfile.is_zipfile(target):  # python runs its __main__.py
            sys.path[0] = target
            runpy._run_module_as_main("__main__", alter_argv=False)  # noqa: SLF001
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            main.__dict__.update(__file__=target, __cached__=None, __loader__=SourceFileLoader("__main__", target))
            exec(_code_of(target), main.__dict__)  # noqa: S102 - running the user's script is the point
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return 1
    except BaseException as exc:  # noqa: BLE001 - as the interpreter would: print it, exit 1
        # PyErr_Print keeps the exception, and so its frames and their objects, in sys.last_*.
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        if hasattr(sys, "last_exc"):  # Python 3.12+
            sys.last_exc = exc
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _code_of(path: str):
    """The code object of the script at `path`: its source compiled as the interpreter compiles a script
    (encoding cookie honoured, no __future__ of ours), or a .pyc's code. A file that cannot be read ends the
    run as the interpreter's does: its message and exit code 2."""
    try:
        with io.open_code(path) as f:
            data = f.read()
    except OSError as exc:
        sys.stderr.write(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}\n")
        raise SystemExit(2) from None
    if data[:4] == importlib.util.MAGIC_NUMBER:
        return marshal.loads(data[16:])
    return compile(data, path, "exec", dont_inherit=True)


def _fork(module: bool, args: list[str]):
    return warmfork.fork_call(functools.partial(run_as_main, module, args))


def cuda_initialised() -> bool:
    """True when this process has initialised CUDA, or is a fork of one that asked CUDA anything (torch's "bad
    fork"; only possible once torch is imported): it could not use the GPU (CUDA's state does not survive a
    fork)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and (torch.cuda.is_initialized() or torch.cuda._is_in_bad_fork()))  # noqa: SLF001


def threads_from_environment() -> None:
    """Size torch's intra-op thread pool by OMP_NUM_THREADS, as a new interpreter's import of torch would: the
    process this worker was forked from imported torch before torchrun set the variable (one thread per worker
    when a node runs several)."""
    torch = sys.modules.get("torch")
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and wanted.isdigit() and int(wanted) > 0 and torch.get_num_threads() != int(wanted):
        torch.set_num_threads(int(wanted))


def forked(*argv: str) -> None:
    """The entrypoint of meshrun.jobs.agent's warm workers (in a fork of its forkserver): `main`, the script
    inheriting this process's imports (torch); exits as the script did. Refuses, naming the fix, when the
    forkserver initialised CUDA, which nothing meshrun preloads does."""
    if cuda_initialised():
        sys.stderr.write(
            "meshrun.jobs.worker: CUDA was initialised before this warm worker was forked, so the script could not"
            " use the GPU; run the job with `meshrun train --workers cold`\n"
        )
        record_exit(1, None)
        sys.exit(1)
    threads_from_environment()
    rc = main(list(argv))
    if rc:
        sys.exit(rc)


def main(argv: list[str] | None = None, start=_fork) -> int:
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
    # A signal sent to this process goes to one of its threads that does not block it; a pump thread taking it
    # would leave the main thread in wait() with the handler not run, so the child would not get it. The
    # threads inherit the mask they start with.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        for t in threads:
            t.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
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
