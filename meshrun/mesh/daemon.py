"""Background daemons: start one for a state directory, wait until it is ready, stop it.

`meshrun init`/`join`/`up` start `python -m meshrun daemon --state-dir DIR` in its own
session. The daemon takes an exclusive lock on DIR/daemon.lock (one daemon per state
directory), writes daemon.pid, and writes daemon.ready once it serves. Stopping sends
SIGTERM to the recorded PID (and SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time

from meshrun.errors import MeshrunError, StateError
from meshrun.system.store import StateDir

log = logging.getLogger("meshrun.mesh.daemon")


def spawn(state: StateDir, timeout: float = 60) -> int:
    """Start the daemon for `state` and return its PID once it reports ready.

    Raises MeshrunError with the daemon's own last error line if it exits or does not
    become ready in time (then it is stopped).
    """
    state.remove("daemon.ready", "daemon.error")
    logf = open(state / "daemon.log", "ab")
    os.chmod(state / "daemon.log", 0o600)
    proc = subprocess.Popen([sys.executable, "-m", "meshrun", "daemon", "--state-dir", str(state.path)],
                            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True)
    logf.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (state / "daemon.ready").exists():
            return proc.pid
        if proc.poll() is not None:
            raise _daemon_error(state, f"the meshrun daemon exited with code {proc.returncode}")
        time.sleep(0.05)
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    if proc.poll() is None:
        proc.kill()
    raise _daemon_error(state, f"the meshrun daemon was not ready within {timeout:.0f} s")


def _daemon_error(state: StateDir, what: str) -> MeshrunError:
    """The daemon writes its fatal error as JSON to daemon.error; rebuild it for the user."""
    try:
        data = state.read_json("daemon.error")
        return MeshrunError(str(data.get("error")), str(data.get("fix", "")))
    except StateError:
        return MeshrunError(what, f"see {state / 'daemon.log'}")


def stop(state: StateDir, timeout: float = 10) -> bool:
    """Stop the daemon of `state` if one runs; True if one was running."""
    pid = state.read_pid()
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    # Wait for the process itself, not its pid file: the daemon removes that file on its way
    # out, and callers go on to delete the interface it may still be touching.
    if not _gone(pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _gone(pid, 2)
    state.remove("daemon.pid", "daemon.ready")
    return True


def _gone(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `pid` to exit; True if it did."""
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def hold_lock(state: StateDir) -> int:
    """Take the daemon lock for this process's lifetime; StateError if another daemon holds it."""
    fd = os.open(state / "daemon.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateError(f"another meshrun daemon already runs for {state.path}",
                         "stop it with `meshrun leave`/`meshrun down`, or use another --state-dir") from None
    state.write("daemon.pid", f"{os.getpid()}\n")
    return fd


def mark_ready(state: StateDir) -> None:
    state.write("daemon.ready", f"{os.getpid()}\n")


def record_fatal(state: StateDir, err: MeshrunError) -> None:
    with contextlib.suppress(MeshrunError):
        state.write_json("daemon.error", {"error": err.message, "fix": err.fix})


def setup_logging() -> None:
    level = logging.DEBUG if os.environ.get("MESHRUN_DEBUG") else logging.INFO
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
