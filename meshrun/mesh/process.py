"""A member's daemon: start it in the background, know whether it runs, stop it, run it.

`meshrun init`/`join`/`up` start `python -m meshrun daemon --state-dir DIR` in its own session
(`spawn`) and wait until it reports ready through a pipe. The daemon holds an exclusive lock on
DIR/daemon.lock for its lifetime: that lock is its liveness (`pid`), and `stop` signals the
process the kernel says holds it. Its log is DIR/daemon.log: timestamped INFO lines, rotated
(LOG_BYTES x LOG_BACKUPS), mode 0600; anything it prints outside logging (a crash) goes to
DIR/daemon.out.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import sys
from collections.abc import Callable, Iterator
from typing import Protocol

from meshrun.core.model import Network
from meshrun.errors import MeshrunError
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine import procs

log = logging.getLogger("meshrun.mesh.process")

LOG_BYTES = 5 << 20
LOG_BACKUPS = 3
FILES = ("daemon.log", *(f"daemon.log.{i}" for i in range(1, LOG_BACKUPS + 1)), "daemon.out", "daemon.lock")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _lock(state: StateDir) -> procs.DaemonLock:
    return procs.DaemonLock(state / "daemon.lock")


def pid(state: StateDir) -> int | None:
    """The PID of the daemon running for `state` (the holder of its lock), or None."""
    return _lock(state).holder()


def spawn(state: StateDir, timeout: float = 60, fix: str = "", on_wait=None) -> int:
    """Start the daemon for `state` and return its PID once it reports ready.

    Raises MeshrunError with the daemon's own error if it fails to start (it is stopped if it
    does not become ready in time; `fix` is added to that error's advice). A daemon that says it waits
    for other machines (`waiting`) is left running and its PID returned after `on_wait(message, fix)`
    where that is given (else the wait for ready goes on).
    """
    return procs.spawn_daemon(
        [sys.executable, "-m", "meshrun", "daemon", "--state-dir", str(state.path)],
        state / "daemon.out",
        timeout=timeout,
        slow_fix=fix,
        on_wait=on_wait,
    )


def stop(state: StateDir, timeout: float = 10) -> bool:
    """Stop the daemon of `state` if one runs; True if one was running."""
    return _lock(state).stop(timeout)


_HELD: set[str] = set()  # the state directories whose daemon lock this process holds (running() nests)


@contextlib.contextmanager
def running(state: StateDir) -> Iterator[None]:
    """Hold the daemon lock while the block runs; a MeshrunError escaping it is reported to the
    process that spawned us (the user sees that message) before it propagates.

    Nested (the service's run() inside `meshrun.mesh.run.serve`, which takes the lock before the service is
    built: a coordinator may wait there for the others to come back, and a second `meshrun up` must see a
    daemon), the inner block keeps the outer one's lock."""
    key = str(state.path)
    if key in _HELD:
        yield
        return
    try:
        lock = _lock(state).acquire()
    except MeshrunError as exc:
        procs.notify_error(exc)
        raise
    _HELD.add(key)
    try:
        yield
    except MeshrunError as exc:
        procs.notify_error(exc)
        raise
    finally:
        _HELD.discard(key)
        lock.release()


def ready() -> None:
    """Tell `spawn` (if it started us) that the daemon serves now."""
    procs.notify_ready()


WAITING = "waiting.json"  # while the daemon runs but cannot serve: what it waits for (`waiting`, `waiting_for`)


def waiting(state: StateDir, message: str, fix: str) -> None:
    """Tell `spawn` (if it started us), and a later `meshrun up` (`waiting_for`), that the daemon runs but
    cannot serve until other machines are back."""
    with contextlib.suppress(MeshrunError):  # only a note for a later `up`: a full disk must not stop the daemon
        state.write_json(WAITING, {"message": message, "fix": fix})
    procs.notify_waiting(message, fix)


def done_waiting(state: StateDir) -> None:
    """The daemon serves (or starts again): nothing is waited for."""
    state.remove(WAITING)


def waiting_for(state: StateDir) -> tuple[str, str] | None:
    """(message, fix) of what the running daemon of `state` waits for, or None (it serves, or none runs)."""
    if pid(state) is None or not (state / WAITING).exists():
        return None
    try:
        d = state.read_json(WAITING)
        return str(d["message"]), str(d["fix"])
    except (MeshrunError, KeyError, TypeError):
        return None


def failed(err: MeshrunError) -> None:
    """Tell `spawn` (if it started us) why the daemon cannot start."""
    procs.notify_error(err)


def setup_logging(state: StateDir, foreground: bool = False) -> None:
    """Log INFO (DEBUG with MESHRUN_DEBUG) with timestamps to DIR/daemon.log, rotated; in the
    foreground (systemd) also to stderr, which the journal keeps."""
    os.umask(0o077)  # every file the daemon makes (logs included) is private
    handlers: list[logging.Handler] = [
        logging.handlers.RotatingFileHandler(state / "daemon.log", maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS)
    ]
    if foreground:
        handlers.append(logging.StreamHandler(sys.stderr))
    # force: the CLI configured WARNING-level logging before the daemon took over this process.
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("MESHRUN_DEBUG") else logging.INFO,
        format=LOG_FORMAT,
        handlers=handlers,
        force=True,
    )


class Extension(Protocol):
    """Something a member's daemon runs beside the mesh (a node's job API, the coordinator's job control):
    started with the daemon, closed with it. `cli` composes them in, so `mesh` never imports `jobs`."""

    def close(self) -> None: ...


# (state, network, member record) -> a started Extension; MeshrunError if it cannot start
ExtensionFactory = Callable[[StateDir, Network, dict], Extension]
