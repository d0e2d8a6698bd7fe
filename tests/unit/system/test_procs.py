"""meshrun.system.machine.procs: readiness through a pipe, liveness and stop through the daemon lock, kill_tree,
stop_tree.

Real processes (the test's own Python), real flocks; every process is killed by the PID started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshrun.errors import MeshrunError, StateError, UsageError
from meshrun.system.machine import procs

# A daemon stand-in: takes the lock, says ready (or fails), then waits for SIGTERM.
DAEMON = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    from meshrun.errors import MeshrunError, UsageError
    from meshrun.system.machine import procs
    mode, lock_path = sys.argv[1], Path(sys.argv[2])
    if mode == "fail":
        procs.notify_error(MeshrunError("port 51821 is taken", "free it"))
        sys.exit(3)
    if mode == "usage":
        procs.notify_error(UsageError("--port 70000 is not a port", "give a port in 1-65535"))
        sys.exit(2)
    if mode == "silent":
        time.sleep(60)
    if mode == "exit":
        sys.exit(5)
    lock = procs.DaemonLock(lock_path).acquire()
    if mode == "wait":  # runs, waits for other machines, then serves
        procs.notify_waiting("a majority is not answering yet", "start the others")
        time.sleep(float(sys.argv[3]))
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    procs.notify_ready()
    time.sleep(60)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "daemon.py"
    path.write_text(DAEMON)
    return path


def spawn(script, tmp_path, mode: str, timeout: float = 30) -> int:
    return procs.spawn_daemon(
        [sys.executable, str(script), mode, str(tmp_path / "d.lock")],
        tmp_path / "d.out",
        timeout=timeout,
        what="the test daemon",
    )


def test_spawn_returns_once_ready_and_the_lock_names_the_daemon(script, tmp_path):
    pid = spawn(script, tmp_path, "ok")
    try:
        lock = procs.DaemonLock(tmp_path / "d.lock")
        assert procs.alive(pid) and lock.holder() == pid and lock.held()
        assert oct((tmp_path / "d.out").stat().st_mode & 0o777) == "0o600"
        assert lock.stop(timeout=5) is True
        assert not procs.alive(pid) and lock.holder() is None
        assert lock.stop() is False  # nothing runs any more
    finally:
        procs.signal_pid(pid, signal.SIGKILL)


def test_the_childs_own_error_reaches_the_caller(script, tmp_path):
    with pytest.raises(MeshrunError) as exc:
        spawn(script, tmp_path, "fail")
    assert str(exc.value) == "port 51821 is taken; free it"


def test_the_childs_usage_error_reaches_the_caller_as_a_usage_error(script, tmp_path):
    """A daemon's UsageError crosses the readiness pipe with its class, so the CLI exits 2, not 1."""
    with pytest.raises(UsageError) as exc:
        spawn(script, tmp_path, "usage")
    assert type(exc.value) is UsageError
    assert exc.value.exit_code == 2
    assert str(exc.value) == "--port 70000 is not a port; give a port in 1-65535"
    assert exc.value.status is None  # no HTTP answer carried it


def test_exit_before_ready_and_silence_past_the_deadline(script, tmp_path):
    with pytest.raises(MeshrunError, match="the test daemon exited with code 5 before it was ready"):
        spawn(script, tmp_path, "exit")
    t0 = time.monotonic()
    with pytest.raises(MeshrunError, match="the test daemon was not ready within 1 s") as exc:
        procs.spawn_daemon(
            [sys.executable, str(script), "silent", str(tmp_path / "d.lock")],
            tmp_path / "d.out",
            timeout=1,
            what="the test daemon",
            slow_fix="give it longer with --wait",
        )
    assert time.monotonic() - t0 < 10  # and it was stopped, not waited for
    assert exc.value.fix == f"see {tmp_path / 'd.out'}; give it longer with --wait"


def test_a_daemon_that_waits_for_other_machines_is_left_running_and_says_what_it_waits_for(script, tmp_path):
    told: list[tuple[str, str]] = []
    argv = [sys.executable, str(script), "wait", str(tmp_path / "d.lock")]
    t0 = time.monotonic()
    pid = procs.spawn_daemon([*argv, "60"], tmp_path / "d.out", timeout=30, on_wait=lambda *w: told.append(w))
    try:
        assert time.monotonic() - t0 < 20  # at once, not after the 60 s it waits
        assert told == [("a majority is not answering yet", "start the others")]
        assert procs.alive(pid) and procs.DaemonLock(tmp_path / "d.lock").holder() == pid
    finally:
        procs.DaemonLock(tmp_path / "d.lock").stop(timeout=5)
    # A caller that does not take the notice waits on for ready (the daemon's later line still arrives).
    pid = procs.spawn_daemon([*argv, "0.3"], tmp_path / "d.out", timeout=30)
    try:
        assert procs.DaemonLock(tmp_path / "d.lock").holder() == pid
    finally:
        procs.DaemonLock(tmp_path / "d.lock").stop(timeout=5)


def test_stop_kills_a_daemon_that_ignores_sigterm(script, tmp_path):
    pid = spawn(script, tmp_path, "stubborn")
    try:
        lock = procs.DaemonLock(tmp_path / "d.lock")
        t0 = time.monotonic()
        assert lock.stop(timeout=1) is True
        assert not procs.alive(pid) and time.monotonic() - t0 < 8
    finally:
        procs.signal_pid(pid, signal.SIGKILL)


def test_a_second_holder_is_refused_naming_the_first(script, tmp_path):
    pid = spawn(script, tmp_path, "ok")
    try:
        with pytest.raises(StateError, match=f"already runs for {tmp_path} \\(pid {pid}\\)"):
            procs.DaemonLock(tmp_path / "d.lock").acquire()
    finally:
        procs.DaemonLock(tmp_path / "d.lock").stop(timeout=5)


def test_a_process_that_merely_looks_like_a_daemon_is_never_signalled(tmp_path):
    """The old check trusted any PID whose command line said "meshrun"; the lock does not."""
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "meshrun", "daemon"])
    try:
        (tmp_path / "d.lock").write_text(f"{decoy.pid}\n")  # a stale pid in the lock file
        lock = procs.DaemonLock(tmp_path / "d.lock")
        assert lock.holder() is None and lock.stop() is False
        assert decoy.poll() is None
    finally:
        decoy.kill()
        decoy.wait()


def test_kill_tree_stops_grandchildren_in_other_sessions(tmp_path):
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "print('up', flush=True); time.sleep(60)"
    )
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "up"
        tree = procs.descendants(root.pid)
        assert len(tree) == 2
        procs.kill_tree(root.pid, grace=2)
        root.wait(5)
        assert not any(procs.alive(p) for p in tree)
    finally:
        for p in procs.descendants(root.pid):
            os.kill(p, signal.SIGKILL)
        root.kill()


# A script that counts the SIGTERMs it gets (each run of its handler appends an "x") and ends 1 s after the first.
COUNTER = (
    "import signal, sys, time\n"
    "def term(*_):\n"
    "    open(sys.argv[1], 'a').write('x'); time.sleep(1); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "print('ready', flush=True); time.sleep(60)\n"
)


def start_under(tmp_path: Path, launcher: list[str]) -> tuple[subprocess.Popen, Path]:
    """COUNTER under `launcher` (its argv prefix), in a session of its own as a share starts torchrun."""
    (tmp_path / "counter.py").write_text(COUNTER)
    counts = tmp_path / "terms"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), RANK="0")
    root = subprocess.Popen(
        [*launcher, str(tmp_path / "counter.py"), str(counts)], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    assert root.stdout.readline().endswith(b"ready\n")
    return root, counts


def test_stop_tree_lets_the_launcher_pass_the_signal_on_once(tmp_path):
    """meshrun.jobs.worker passes SIGTERM on to its script: stop_tree signals the launcher alone and the
    script's handler runs once. (kill_tree signals both: the kernel merges the two while neither is handled,
    so here it mostly runs once too; in a job the third, through torchrun, came later and it ran up to 3 times.)"""
    root, counts = start_under(tmp_path, [sys.executable, "-m", "meshrun.jobs.worker"])
    tree = procs.descendants(root.pid)
    try:
        procs.stop_tree(root.pid, grace=10)
        assert root.wait(5) == 0
        assert counts.read_text() == "x"
    finally:
        for p in tree:
            procs.signal_pid(p, signal.SIGKILL)
        root.wait(5)


def test_what_outlives_a_root_that_passed_nothing_on_gets_the_signal_once(tmp_path):
    """A root that dies of the signal at once (torchrun before its handler is set): its child, in a session of
    its own, is told once the root has gone; one that ignores it is killed after the grace."""
    spawn_child = (
        "import subprocess, sys\n"
        "c = subprocess.Popen([sys.executable] + sys.argv[1:], stdout=subprocess.PIPE, start_new_session=True)\n"
        "print(c.stdout.readline().decode().strip(), flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    root, counts = start_under(tmp_path, [sys.executable, "-c", spawn_child])
    tree = procs.descendants(root.pid)
    assert len(tree) == 2
    try:
        procs.stop_tree(root.pid, grace=10)
        root.wait(5)
        assert root.returncode == -signal.SIGTERM
        assert counts.read_text() == "x"
        assert not any(procs.alive(p) for p in tree)
    finally:
        for p in tree:
            procs.signal_pid(p, signal.SIGKILL)


def test_stop_tree_kills_a_root_that_ignores_the_signal_after_the_grace(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert root.stdout.readline() == b"up\n"
        started = time.monotonic()
        procs.stop_tree(root.pid, grace=1)
        assert root.wait(5) == -signal.SIGKILL
        assert time.monotonic() - started < 5
    finally:
        root.kill()
        root.wait()


def test_the_lock_names_its_holder_on_an_overlay_file_system(script, tmp_path):
    """State on overlayfs (a container's root, the test VM's /tmp): /proc/locks names the upper layer's
    device, stat() the overlay's. Liveness (status, stop) must still find the daemon: it did not in the VM."""
    if os.geteuid() != 0:
        pytest.skip("mounting an overlay needs root")
    lower = tmp_path / "lower"  # lower on another file system than upper: the devices then differ
    for d in ("upper", "work", "merged"):
        (tmp_path / d).mkdir()
    lower.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(lower)], check=True)
    try:
        subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={lower},upperdir={tmp_path / 'upper'},workdir={tmp_path / 'work'}",
                str(tmp_path / "merged"),
            ],
            check=True,
        )
        try:
            merged = tmp_path / "merged"
            pid = spawn(script, merged, "ok")
            try:
                st = (merged / "d.lock").stat()
                locks = Path("/proc/locks").read_text()
                assert f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}" not in locks  # the trap
                lock = procs.DaemonLock(merged / "d.lock")
                assert lock.holder() == pid
                assert lock.stop(timeout=5) is True and not procs.alive(pid)
            finally:
                procs.signal_pid(pid, signal.SIGKILL)
        finally:
            subprocess.run(["umount", str(tmp_path / "merged")], check=True)
    finally:
        subprocess.run(["umount", str(lower)], check=True)
