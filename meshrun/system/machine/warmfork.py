"""Processes forked from a Python that already imported torch, instead of new interpreters that import it again.

A new Python that imports torch takes about 3 s on a 2-core node; a re-formed group's workers all wait for
it after every lost node (benchmarks/results/ha_failover.json). multiprocessing's forkserver, started once
per torchrun agent with torch preloaded, forks each worker from that state instead (meshrun.jobs.agent);
the worker then forks the user's script (`fork_call`), so the script starts with torch already imported.

Each of these touches the interpreter's process state (file descriptors, signals, multiprocessing's
globals), which is why they live in the system layer.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

# multiprocessing's helper processes, started by a torchrun agent that forks its workers (meshrun.jobs.agent):
# they keep torch imported for the next workers, so a regroup must not end them (meshrun.jobs.share).
HELPER_MARK = "from multiprocessing."


def start_forkserver(preload: Sequence[str]) -> None:
    """Start multiprocessing's forkserver now with `preload` imported; later forkserver workers are forked
    from that state. Where it can (`_fork_forkserver`), the forkserver is a fork of this process, which imports
    `preload` first: the import is paid once per agent instead of twice. Elsewhere it is multiprocessing's own,
    a new interpreter that imports `preload` (a module that fails to import is skipped: the workers import it
    themselves). Call it before starting threads and before asking CUDA anything (torch's device count): a fork
    made after that could not use the GPU, so the forkserver would be a new interpreter after all."""
    multiprocessing.set_forkserver_preload(list(preload))
    if not _fork_forkserver(preload):
        multiprocessing.forkserver.ensure_running()


# The forkserver's state that `_fork_forkserver` fills in as ForkServer.ensure_running would (CPython 3.10 to
# 3.13; 3.14 adds an authentication key to it, so there multiprocessing starts its own).
_FORKSERVER_FIELDS = ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")


def _fork_forkserver(preload: Sequence[str]) -> bool:
    """Import `preload` here, then start multiprocessing's forkserver as a fork of this process: what
    ForkServer.ensure_running does with a new interpreter (a listening socket only this user may reach, the
    "alive" pipe whose end closes when every client has gone), without importing torch a second time (about
    1.2 CPU-s; the agent imported it already, to parse torchrun's options). False, having done nothing, where
    the fork would not be safe or the forkserver's internals are not those this knows: a Python thread
    besides this one (the fork would not copy it), a forkserver already running, another CPython."""
    server = multiprocessing.forkserver._forkserver  # noqa: SLF001 - the module's own singleton
    if sys.version_info >= (3, 14) or not all(hasattr(server, f) for f in _FORKSERVER_FIELDS):
        return False
    if server._forkserver_pid is not None or threading.active_count() > 1:  # noqa: SLF001
        return False
    for name in preload:
        try:
            __import__(name)
        except ImportError:  # as multiprocessing's forkserver does: the workers import it themselves
            pass
    with server._lock:  # noqa: SLF001
        multiprocessing.resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = multiprocessing.connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not multiprocessing.util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            _flush_std()
            with warnings.catch_warnings():  # 3.12+: "multi-threaded": torch's idle native pool, as any fork
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                _serve_forkserver(listener.detach(), alive_r, alive_w, preload)
            os.close(alive_r)
        server._forkserver_address = address  # noqa: SLF001
        server._forkserver_alive_fd = alive_w  # noqa: SLF001
        server._forkserver_pid = pid  # noqa: SLF001
    return True


def _serve_forkserver(listener_fd: int, alive_r: int, alive_w: int, preload: Sequence[str]) -> NoReturn:
    """The forked forkserver: multiprocessing's own loop until every client has closed the alive pipe. It never
    returns into the caller's code, nor runs the caller's exit hooks. Where the fork cannot serve (`_usable_fork`),
    it becomes multiprocessing's own forkserver, a new interpreter on the same socket and pipe."""
    code = 0
    try:
        os.close(alive_w)  # the clients' end: held here too, the pipe would never close
        if not _usable_fork():
            _exec_forkserver(listener_fd, alive_r, preload)
        multiprocessing.forkserver.main(listener_fd, alive_r, list(preload))
    except SystemExit:  # the loop's end: no client left
        pass
    except BaseException:  # noqa: BLE001 - said on stderr, as multiprocessing's own forkserver would
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _usable_fork() -> bool:
    """False in a fork whose workers could not use the GPU: the parent asked CUDA something (torch's device
    count, as torchrun's launch config does on a CUDA build), which marks every later fork "bad" for CUDA."""
    torch = sys.modules.get("torch")
    return not (torch is not None and torch.cuda._is_in_bad_fork())  # noqa: SLF001 - torch's own fork check


def _exec_forkserver(listener_fd: int, alive_r: int, preload: Sequence[str]) -> NoReturn:
    """Replace this process by multiprocessing's own forkserver on `listener_fd` and `alive_r`: the command line
    ForkServer.ensure_running runs, so the process keeps its pid and the clients their socket."""
    data = multiprocessing.spawn.get_preparation_data("ignore")
    data = {k: v for k, v in data.items() if k in ("main_path", "sys_path")}
    cmd = "from multiprocessing.forkserver import main; main(%d, %d, %r, **%r)"  # noqa: UP031 - multiprocessing's
    for fd in (listener_fd, alive_r):
        os.set_inheritable(fd, True)
    exe = multiprocessing.spawn.get_executable()
    flags = multiprocessing.util._args_from_interpreter_flags()  # noqa: SLF001 - as ensure_running passes them
    os.execv(exe, [exe, *flags, "-c", cmd % (listener_fd, alive_r, list(preload), data)])


def _flush_std(*more: object) -> None:
    """Flush sys.stdout and sys.stderr (and `more`), ignoring a closed or broken one: before a fork (what they
    buffered is this process's, not the child's to write) and at the end."""
    for stream in (sys.stdout, sys.stderr, *more):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def is_helper(argv: Sequence[str] | None, agent_argv: Sequence[str] | None = None) -> bool:
    """True for the command line of multiprocessing's forkserver or resource tracker among an agent's children:
    a new interpreter's (`HELPER_MARK`), or the agent's own (`agent_argv`: a forkserver forked from the agent).
    The workers forked from the forkserver keep its command line too: ask it of the agent's own children only."""
    if not argv:
        return False
    return any(HELPER_MARK in a for a in argv) or (agent_argv is not None and list(argv) == list(agent_argv))


class Forked:
    """A child made by `fork_call`: `pid`, binary `stdout`/`stderr` pipes, and Popen's `send_signal` (to the
    child's process group: the child and the children it did not move elsewhere, as torchrun's stop reaches a
    worker and its children) and `wait` (its exit code, or -N when signal N ended it)."""

    def __init__(self, pid: int, stdout: io.BufferedReader, stderr: io.BufferedReader) -> None:
        self.pid, self.stdout, self.stderr = pid, stdout, stderr
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.killpg(self.pid, sig)

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


# The signals a job's launchers pass on to their children (torchrun to its workers, meshrun.jobs.worker to the
# script): a child of `fork_call` leaves its parent's process group, so each reaches it once, passed on.
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def fork_call(run: Callable[[], int]) -> Forked:
    """Fork; in the child, fds 1 and 2 become new pipes (read through the returned Forked), stdout and stderr
    are unbuffered as under ``python -u``, the job signals have their default actions, multiprocessing
    believes it is a new main process, and `run()`'s return value is the exit code (-N: die of signal N).
    The child never returns from here. Call it before starting threads: only the calling thread is copied."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # What this process buffered is its own: flushed now, the child cannot write it again when it flushes every
    # open file at its end (multiprocessing flushes before it forks, for the same reason).
    _flush_std(sys.__stdout__, sys.__stderr__)
    # Blocked across the fork until the child has its own process group: a stop sent to this process's group
    # meanwhile stays pending here (the caller passes it on) and is dropped in the child, never both.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _PASSED_ON)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    if pid == 0:  # pragma: no cover - the child's exit code is what the tests read
        code = 1
        try:
            _own_group()
            os.close(out_r)
            os.close(err_r)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.close(out_w)
            os.close(err_w)
            _fresh_process()
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            code = run()
        except BaseException:  # noqa: BLE001 - nothing may return into the parent's code
            traceback.print_exc()  # onto the new fd 2: the parent reads it as the child's output
            code = 1
        finally:
            exit_as_interpreter(code)
    with contextlib.suppress(PermissionError, ProcessLookupError):  # the child's own call may have come first
        os.setpgid(pid, pid)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(out_w)
    os.close(err_w)
    return Forked(pid, os.fdopen(out_r, "rb", buffering=0), os.fdopen(err_r, "rb", buffering=0))


def _own_group() -> None:
    """In `fork_call`'s child, signals still blocked: lead a process group of its own (torchrun starts each
    worker in a session of its own for the same reason) and drop the passed-on signals that reached it while it
    was still in its parent's group (the parent got them too, and passes them on). `_fresh_process` then sets
    their actions."""
    with contextlib.suppress(PermissionError):  # the parent's call came first
        os.setpgid(0, 0)
    for sig in set(_PASSED_ON) & signal.sigpending():
        signal.signal(sig, signal.SIG_IGN)  # discards it while pending


def _fresh_process() -> None:
    """What a new ``python -u`` would have that a fork of a forkserver worker does not."""
    enc = sys.stdout.encoding if sys.stdout else "utf-8"
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=enc, write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding=enc, errors="backslashreplace", write_through=True
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    # The script may choose its own start method and have its own children, as in a new interpreter.
    multiprocessing.context._default_context._actual_context = None
    me = multiprocessing.process._current_process
    me._identity, me._name, me._parent_pid, me._parent_name = (), "MainProcess", None, None
    multiprocessing.process._parent_process = None
    multiprocessing.process._children = set()
    multiprocessing.process._process_counter = itertools.count(1)
    # The wrapper's finalizers are its own; the exit hooks stay: the forkserver's imports registered them,
    # as the same imports would have in a new interpreter (torch's DataLoader's among them).
    multiprocessing.util._finalizer_registry.clear()


def exit_as_interpreter(code: int) -> NoReturn:
    """End this process as ``python -u SCRIPT`` ends once the script's code has run, in the interpreter's order
    (CPython's Py_FinalizeEx): non-daemon threads joined (after threading's own exit hooks, concurrent.futures'
    among them, so an executor's queued work completes), atexit handlers, open files flushed, stdout and stderr
    flushed, then exit with `code` (-N: die of signal N, as an uncaught KeyboardInterrupt ends Python).

    What it leaves out is what every multiprocessing child leaves out: the script's objects are not torn down
    (no module teardown, no garbage collection, no ``__del__`` of its globals). Tearing them down is where a
    script's last DDP model, freed with the GIL held, joins gloo's threads while one of them waits for the GIL
    to free a tensor: a hang for ever in a fork, an abort in the interpreter's own finalization
    (docs/jobs.md, "How a worker ends"). Open files are flushed instead, which is what their teardown would
    have written; a wrapper written in Python (gzip, zipfile) keeps whatever it had not flushed."""
    try:
        threading._shutdown()  # noqa: SLF001 - what Py_FinalizeEx and multiprocessing's _bootstrap call
    except BaseException:  # noqa: BLE001 - as the interpreter does: print it and go on ending
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    finally:
        _flush_open_files()
        _flush_std()
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code if 0 <= code < 256 else 1)


# The io classes whose teardown writes what they buffered (their close flushes first); all are C types that the
# garbage collector tracks, so gc.get_objects() finds every one still open.
_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)


def _flush_open_files() -> None:
    """Flush every open file object of the process (what their teardown at exit would have written)."""
    for obj in gc.get_objects():
        if issubclass(type(obj), _BUFFERED):  # type(): isinstance would ask proxies for __class__
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError, AttributeError):  # a broken pipe, a detached buffer: nothing to save
                pass
