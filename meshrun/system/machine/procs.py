"""Processes: start, watch and stop them. The only module that forks, signals or waits.

- `spawn_daemon` starts a long-lived process in its own session and waits until it says it is
  ready through an inherited pipe (`MESHRUN_READY_FD`): no polling for a file. A child that fails
  before it is ready writes its error to the same pipe (`notify_error`), so the caller can show
  the real reason.
- `DaemonLock` is the liveness of a daemon: an exclusive flock on a file in its state directory,
  held for the daemon's lifetime. The holder's PID is read from the kernel's lock table
  (/proc/locks), never from a command-line match, so `stop` signals exactly the process that
  holds the lock.
- `alive`, `descendants`, `kill_tree` and `stop_tree` work on /proc; both snapshot a process tree
  before signalling it and re-check start times before SIGKILL, so a reused PID is never hit.
  `kill_tree` signals every process of the tree; `stop_tree` only its root, which passes the signal on
  (a job's launcher: each of its processes must get it once).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from meshrun.errors import MeshrunError, StateError, from_wire, to_wire

READY_ENV = "MESHRUN_READY_FD"
KILL_GRACE_S = 5.0


# --------------------------------------------------------------------------- looking at processes


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state is [0], ppid [1], start time [19])."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def comm(pid: int) -> str | None:
    """The process's command name (/proc/PID/comm), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _nul_list(pid: int, what: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return [p.decode(errors="replace") for p in f.read().split(b"\0") if p]
    except OSError:
        return None


def argv(pid: int) -> list[str] | None:
    """The process's command line (argv[0] as it was started: a venv's python keeps its path)."""
    return _nul_list(pid, "cmdline")


def environ(pid: int) -> dict[str, str] | None:
    """The environment the process started with, or None if it is gone or not ours to read."""
    items = _nul_list(pid, "environ")
    return None if items is None else dict(i.split("=", 1) for i in items if "=" in i)


def alive(pid: int | None) -> bool:
    """True while `pid` exists and is not a zombie (an orphan's zombie may linger under pid 1)."""
    if not pid or pid < 1:
        return False
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused PID apart), or None."""
    st = _stat(pid)
    return st[19] if st else None


def started_at(pid: int) -> float | None:
    """When the process started, in unix seconds (boot time plus its start in clock ticks), or None."""
    st = _stat(pid)
    if st is None:
        return None
    try:
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    return boot + int(st[19]) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The direct children of `pid`."""
    return sorted(p for p, (ppid, _) in _proc_table().items() if ppid == pid)


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, start time) for every process we can see."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                table[int(entry)] = (int(st[1]), st[19])
    return table


def descendants(root: int) -> dict[int, str]:
    """{pid: start time} of `root` and everything below it."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in out:
            out[pid] = table[pid][1]
            todo.extend(children.get(pid, []))
    return out


def signal_pid(pid: int, sig: int) -> bool:
    """Send `sig` to `pid`; False if it no longer exists (or is not ours to signal)."""
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _still(pid: int, start: str) -> bool:
    """`pid` is alive and is still the process that started at `start` (not a reused PID)."""
    return alive(pid) and start_time(pid) == start


def _tree_alive(tree: Mapping[int, str]) -> bool:
    return any(_still(pid, start) for pid, start in tree.items())


def _signal_left(tree: Mapping[int, str], sig: int, but: int | None = None) -> None:
    """Send `sig` to every process of `tree` that is still itself (`_still`), except `but`."""
    for pid, start in tree.items():
        if pid != but and _still(pid, start):
            signal_pid(pid, sig)


def kill_tree(root: int, grace: float = KILL_GRACE_S, sig: int = signal.SIGTERM) -> None:
    """Stop `root` and all its descendants: `sig` first, SIGKILL to what is left after `grace` s.

    The tree is snapshotted before any signal and re-read while waiting (workers get re-parented
    once their launcher exits, and torchrun starts them in their own sessions, so a process group
    is not enough); start times are re-checked before SIGKILL, so a reused PID is never hit.
    """
    tree = descendants(root)
    for pid in tree:
        signal_pid(pid, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        tree.update({p: s for p, s in descendants(root).items() if p not in tree})
        if not _tree_alive(tree):
            return
        time.sleep(0.1)
    _signal_left(tree, signal.SIGKILL)


def stop_tree(root: int, grace: float = KILL_GRACE_S, sig: int = signal.SIGTERM) -> None:
    """Stop `root` and all its descendants as a supervisor stops torchrun: `sig` to the root alone, SIGKILL to
    what is left of the tree after `grace` s.

    The root passes the signal on (torchrun to each worker's process group, meshrun.jobs.worker to its
    script's), so every process gets it once, as under torchrun; kill_tree's signal to each process would
    reach a script once from us and again through each launcher above it, and a handler that saves a
    checkpoint ran nested up to three times. A process still alive once the root has gone (the root died
    before it could pass anything on, or left it behind) gets `sig` then, once. Start times are checked as
    kill_tree checks them."""
    tree = descendants(root)
    if root not in tree:
        return
    signal_pid(root, sig)
    orphans_told = False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        root_up = _still(root, tree[root])
        if root_up:
            tree.update({p: s for p, s in descendants(root).items() if p not in tree})
        if not _tree_alive(tree):
            return
        if not root_up and not orphans_told:
            orphans_told = True
            _signal_left(tree, sig, but=root)
        time.sleep(0.1)
    _signal_left(tree, signal.SIGKILL)


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `pid` to exit (or turn zombie); True if it did."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


# --------------------------------------------------------------------------- starting processes


def popen(argv: Sequence[str], **kw) -> subprocess.Popen:
    """subprocess.Popen, the one place meshrun starts a child it keeps a handle on."""
    return subprocess.Popen(list(argv), **kw)


def run(argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
    """subprocess.run, for the callers that need a finished process and its output."""
    return subprocess.run(list(argv), **kw)


def exec_replace(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Replace this process with `argv`, `env` merged over the current environment (never returns)."""
    os.execvpe(argv[0], list(argv), {**os.environ, **env})


TimeoutExpired = subprocess.TimeoutExpired
CompletedProcess = subprocess.CompletedProcess
PIPE, DEVNULL, STDOUT = subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT


def spawn_daemon(
    argv: Sequence[str],
    log_path: Path,
    timeout: float = 60,
    env: Mapping[str, str] | None = None,
    what: str = "the meshrun daemon",
    slow_fix: str = "",
    on_wait: Callable[[str, str], None] | None = None,
) -> int:
    """Start `argv` in its own session (output appended to `log_path`, 0600) and wait until ready.

    The child finds a pipe's write end in $MESHRUN_READY_FD and calls `notify_ready()` (or
    `notify_error(err)`). Returns the child's PID. Raises MeshrunError with the child's own error
    if it reports one or exits first, and stops it if it is not ready within `timeout` seconds (that
    error's advice: the log, then `slow_fix`).

    A child that runs but waits for something outside itself (`notify_waiting`: other machines to come
    back) is left running: with `on_wait`, that is called with the child's (message, fix) and the PID
    returned at once; without it, the wait for ready goes on.
    """
    rfd, wfd = os.pipe()
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        child_env = dict(os.environ if env is None else env, **{READY_ENV: str(wfd)})
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(wfd,),
                env=child_env,
            )
        finally:
            os.close(fd)
    except BaseException:
        os.close(rfd)
        os.close(wfd)
        raise
    os.close(wfd)  # only the child holds the write end now: EOF means it exited (or closed it)
    message: dict | None = None
    try:
        for message in _messages(rfd, time.monotonic() + timeout):
            if message is None or "waiting" not in message:
                break
            if on_wait is not None:
                on_wait(str(message["waiting"]), str(message.get("fix") or ""))
                return proc.pid
    finally:
        os.close(rfd)
    if message is not None and message.get("ready"):
        return proc.pid
    if message is None and proc.poll() is None:  # silent past the deadline
        kill_tree(proc.pid, grace=5)
        _reap(proc)
        raise StateError(
            f"{what} was not ready within {timeout:.0f} s", f"see {log_path}" + (f"; {slow_fix}" if slow_fix else "")
        )
    _reap(proc)
    if message and message.get("error"):
        raise from_wire(message, default=MeshrunError)  # the child's own error, its class kept
    raise StateError(f"{what} exited with code {proc.returncode} before it was ready", f"see {log_path}")


def read_some(fd: int, timeout: float, size: int = 65536) -> bytes | None:
    """Up to `size` bytes from `fd` as soon as some arrive; b"" at end of file, None after `timeout` seconds
    without any (the caller does its periodic work and reads again)."""
    if not select.select([fd], [], [], timeout)[0]:
        return None
    try:
        return os.read(fd, size)
    except InterruptedError:  # pragma: no cover - PEP 475 retries os.read itself
        return None


def _reap(proc: subprocess.Popen) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _messages(fd: int, deadline: float) -> Iterator[dict | None]:
    """The child's one-line JSON messages in order; {} at end of file without one (or for a line that is not
    a JSON object), then nothing more; None when `deadline` (monotonic) passes first."""
    buf = b""
    while True:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                yield None
                return
            chunk = os.read(fd, 4096)
            if not chunk:
                yield {}
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        try:
            msg = json.loads(line or b"{}")
        except ValueError:
            msg = {}
        yield msg if isinstance(msg, dict) else {}


def _notify(message: dict, last: bool = True) -> None:
    """Write `message` to the spawner's pipe; the `last` one also closes it (and forgets it)."""
    fd = os.environ.pop(READY_ENV, None) if last else os.environ.get(READY_ENV)
    if fd is None or not fd.isdigit():
        return  # not started by spawn_daemon (systemd, a terminal): nobody waits
    with contextlib.suppress(OSError):  # the spawner may have gone (it returned on an earlier message)
        os.write(int(fd), json.dumps(message).encode() + b"\n")
    if last:
        with contextlib.suppress(OSError):
            os.close(int(fd))


def notify_waiting(message: str, fix: str = "") -> None:
    """Tell the process that spawned us (`spawn_daemon`) that we run but wait for something outside us
    (`message`, what would end the wait: `fix`); a later `notify_ready` or `notify_error` still goes through."""
    _notify({"waiting": message, "fix": fix}, last=False)


def notify_ready() -> None:
    """Tell the process that spawned us (`spawn_daemon`) that we serve now."""
    _notify({"ready": True, "pid": os.getpid()})


def notify_error(err: MeshrunError) -> None:
    """Tell the process that spawned us why we cannot start (the error the user will see, its class kept)."""
    _notify(to_wire(err))


# --------------------------------------------------------------------------- daemon lock


class DaemonLock:
    """An exclusive flock on `path`: held by a daemon for its lifetime; its liveness signal.

    `acquire` takes it (StateError if another process holds it); `holder` says which PID holds it,
    from the kernel's lock table; `stop` signals that PID and waits for the lock to be released.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fd: int | None = None

    def acquire(self, what: str = "another meshrun daemon") -> DaemonLock:
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateError(
                f"{what} already runs for {self.path.parent} (pid {self.holder() or '?'})",
                "stop it first (`meshrun leave`/`meshrun down`), or use another --state-dir",
            ) from None
        os.set_inheritable(fd, False)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def held(self) -> bool:
        """True while some process holds the lock."""
        return self.holder() is not None or self._busy()

    def _busy(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def holder(self) -> int | None:
        """PID of the process holding the lock, from /proc/locks; None when it is free."""
        try:
            st = self.path.stat()
        except OSError:
            return None
        return lock_holder(st.st_dev, st.st_ino)

    def stop(self, timeout: float = 10) -> bool:
        """SIGTERM the holder, wait for the lock to be free, SIGKILL it after `timeout`.

        Returns True if a daemon held the lock. The PID signalled is the lock's holder as the
        kernel reports it, re-read before SIGKILL, so no other process can be hit.
        """
        pid = self.holder()
        if pid is None:
            return False
        signal_pid(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.holder() == pid and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.holder() == pid:
            signal_pid(pid, signal.SIGKILL)
        # The lock goes with the last descriptor; wait for the process itself as well, since
        # callers go on to remove what it may still be touching (its interface, its files).
        wait_gone(pid, 5)
        return True


def lock_holder(dev: int, ino: int) -> int | None:
    """The PID holding a FLOCK write lock on the file (dev, ino) as stat() reports it, from /proc/locks.

    On overlayfs (container root file systems, the test VM's /tmp) /proc/locks names the upper
    layer's device while stat() gives the overlay's: an entry with the right inode but another
    device is confirmed by the holder having that very file open (its /proc/PID/fd entries stat
    to (dev, ino)).
    """
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    maybe: list[int] = []
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (blocked waiters carry a "->" field)
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "WRITE":
            continue
        if not (parts[4].lstrip("-").isdigit() and int(parts[4]) > 0):
            continue
        if parts[5] == want:
            return int(parts[4])
        if parts[5].rsplit(":", 1)[-1] == str(ino):
            maybe.append(int(parts[4]))
    return next((pid for pid in maybe if _has_open(pid, dev, ino)), None)


def _has_open(pid: int, dev: int, ino: int) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (dev, ino):
            return True
    return False
