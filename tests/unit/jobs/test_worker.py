"""meshrun.jobs.worker: prefixes, exit code and signal passthrough, exit records, a script run and ended as
``python -u`` runs and ends it.

Every test runs the wrapper both ways it is used: ``python -m meshrun.jobs.worker`` (a cold worker: a new
interpreter) and `worker.forked` (a warm worker's entrypoint, as meshrun.jobs.agent's forkserver runs it); in
both the script runs in a fork of the wrapper.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from support import REPO_ROOT

ROOT = REPO_ROOT
SPAWNED = [sys.executable, "-m", "meshrun.jobs.worker"]
FORKED = [sys.executable, "-c", "import sys; from meshrun.jobs import worker; worker.forked(*sys.argv[1:])"]
WORKER = SPAWNED


@pytest.fixture(autouse=True, params=["spawned", "forked"])
def how(request, monkeypatch):
    """Which way the wrapper starts the script in this test."""
    monkeypatch.setattr(sys.modules[__name__], "WORKER", SPAWNED if request.param == "spawned" else FORKED)
    return request.param


def run_worker(
    tmp_path: Path, code: str, *args: str, module: bool = False, env: dict | None = None, timeout: float = 30
) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "MESHRUN_JOB_DIR", "TORCHELASTIC_RESTART_COUNT")
    }
    full_env.update({"PYTHONPATH": str(ROOT), "MESHRUN_NODE_NAME": "dc1-gpu0", "RANK": "3", "LOCAL_RANK": "1"})
    full_env.update(env or {})
    target = ["--module", "child"] if module else [str(script)]
    return subprocess.run(
        [*WORKER, *target, *args],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        timeout=timeout,
    )


def test_prefixes_stdout_and_stderr(tmp_path):
    r = run_worker(
        tmp_path,
        """
        import sys
        print("hello")
        print("oops", file=sys.stderr)
        print("args", sys.argv[1:])
    """,
        "--epochs",
        "3",
    )
    assert r.returncode == 0
    assert r.stdout.decode().splitlines() == ["[dc1-gpu0 r3] hello", "[dc1-gpu0 r3] args ['--epochs', '3']"]
    assert r.stderr.decode().splitlines() == ["[dc1-gpu0 r3] oops"]


def test_module_mode(tmp_path):
    r = run_worker(tmp_path, "import sys; print('as module', __name__, sys.argv[1:])", "x", module=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == "[dc1-gpu0 r3] as module __main__ ['x']\n"


def test_partial_last_line_and_binary(tmp_path):
    r = run_worker(
        tmp_path,
        r"""
        import sys
        sys.stdout.buffer.write(b"line1\nbad \xff byte\nno newline at end")
    """,
    )
    assert r.returncode == 0
    assert r.stdout.decode().splitlines() == [
        "[dc1-gpu0 r3] line1",
        "[dc1-gpu0 r3] bad \ufffd byte",
        "[dc1-gpu0 r3] no newline at end",
    ]
    assert r.stdout.endswith(b"\n")


def test_exit_code_passthrough_and_record(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    before = time.time()
    r = run_worker(
        tmp_path,
        "import sys; print('bye'); sys.exit(3)",
        env={"MESHRUN_JOB_DIR": str(job), "TORCHELASTIC_RESTART_COUNT": "2"},
    )
    assert r.returncode == 3
    assert r.stdout.decode() == "[dc1-gpu0 r3] bye\n"
    rec = json.loads((job / "exit-r3-a2.json").read_text())
    assert rec["rank"] == 3 and rec["local_rank"] == 1 and rec["node"] == "dc1-gpu0"
    assert rec["exit_code"] == 3 and rec["signal"] is None
    assert before <= rec["time"] <= time.time()
    assert [p.name for p in job.iterdir()] == ["exit-r3-a2.json"]  # no temp file left behind


def test_no_record_without_job_dir(tmp_path):
    r = run_worker(tmp_path, "pass")
    assert r.returncode == 0
    assert not list(tmp_path.glob("exit-*.json"))


def test_signal_death_passthrough(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    r = run_worker(
        tmp_path,
        "import os, signal; print('dying', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
        env={"MESHRUN_JOB_DIR": str(job)},
    )
    assert r.returncode == -signal.SIGKILL
    assert r.stdout.decode() == "[dc1-gpu0 r3] dying\n"
    rec = json.loads((job / "exit-r3-a0.json").read_text())
    assert rec["signal"] == "SIGKILL" and rec["exit_code"] == 128 + signal.SIGKILL


def blocked_signals(pid: int, tid: int) -> set[int]:
    """The signals thread `tid` of process `pid` blocks (its SigBlk in /proc)."""
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError(f"no SigBlk for thread {tid} of {pid}")


def sigterm_worker(tmp_path: Path, code: str, inspect=None, group: bool = False) -> tuple[bytes, int]:
    """Run `code` under the worker, SIGTERM the worker once the child printed "ready"; (rest of stdout, exit code).
    `inspect(pid)`, when given, runs on the worker's pid before the signal is sent. `group`: the worker runs in a
    session of its own and the signal goes to its process group, as torchrun stops a worker."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHRUN_NODE_NAME="n1", RANK="0")
    p = subprocess.Popen(
        [*WORKER, str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=group,
    )
    try:
        assert p.stdout.readline() == b"[n1 r0] ready\n"
        if inspect:
            inspect(p.pid)
        if group:
            os.killpg(p.pid, signal.SIGTERM)
        else:
            p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return out, p.returncode


def test_sigterm_is_forwarded_to_the_child(tmp_path):
    out, code = sigterm_worker(
        tmp_path,
        """
        import signal, sys, time
        def bye(signum, frame):
            print("child got", signal.Signals(signum).name, flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(30)
    """,
    )
    assert out == b"[n1 r0] child got SIGTERM\n"
    assert code == 7


def test_torchruns_stop_reaches_the_script_and_its_children_once(tmp_path):
    """torchrun stops a worker with a signal to its process group. The script leads a group of its own, which
    the worker signals: its handler runs once (it ran twice when the script shared the worker's group, and
    three times under a stopped share), and a child of the script, in the script's group, gets it too."""
    out, code = sigterm_worker(
        tmp_path,
        """
        import os, signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\\n"
            "signal.signal(signal.SIGTERM, lambda *_: (open('child.term', 'a').write('x'), sys.exit(0)))\\n"
            "print('up', flush=True); time.sleep(30)"], stdout=subprocess.PIPE)
        child.stdout.readline()
        def bye(signum, frame):
            with open("script.term", "a") as f:
                f.write("x")
            time.sleep(0.5)  # a second signal would run this again, nested, while it sleeps
            child.wait(10)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(30)
    """,
        group=True,
    )
    assert code == 0, out
    assert (tmp_path / "script.term").read_text() == "x"
    assert (tmp_path / "child.term").read_text() == "x"


def test_unhandled_sigterm_kills_child_and_worker_alike(tmp_path):
    _, code = sigterm_worker(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(30)\n")
    assert code == -signal.SIGTERM


def test_only_the_main_thread_can_take_the_signals_it_passes_on(tmp_path):
    """The kernel hands a signal sent to the worker to any thread that does not block it: taken by an output
    pump, the handler would wait for the main thread to leave wait(), i.e. for the script to end on its own (the
    floor run once waited out its 20 s here). The pumps block them; the main thread does not."""
    seen = {}
    forwarded = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}

    def inspect(pid):
        # The first pump may pass "ready" on before the second has started (the main thread blocks the
        # signals while it starts them): read once both are up.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen.clear()
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
            seen.update({tid: blocked_signals(pid, tid) for tid in tids})
            if len(seen) >= 3 and not forwarded & seen[pid]:
                return
            time.sleep(0.05)

    _, code = sigterm_worker(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(30)\n", inspect)
    assert code == -signal.SIGTERM
    pid = min(seen)  # the main thread's tid is the pid, the lowest
    assert len(seen) >= 3, seen  # main and the two pumps
    assert not forwarded & seen[pid]
    for tid, blocked in seen.items():
        if tid != pid:
            assert forwarded <= blocked, (tid, blocked)


def test_usage_without_script():
    r = subprocess.run(
        WORKER,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert b"usage" in r.stderr


@pytest.mark.parametrize("mod", ["meshrun.jobs.worker", "meshrun.core.launch"])
def test_does_not_import_torch(mod):
    code = f"import sys, {mod}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True, timeout=30)


def test_a_progress_bar_becomes_a_few_marked_redraws_and_its_final_state(tmp_path):
    """400 KiB of tqdm-style redraws without a newline, then one line: bounded output, nothing held back."""
    t0 = time.monotonic()
    r = run_worker(
        tmp_path,
        r"""
        import sys, time
        for i in range(13_000):
            sys.stderr.write(f"\r eval {i * 100 // 12_999:3d}%|{'#' * (i * 20 // 12_999):<20}| {i + 1}/13000")
            sys.stderr.flush()
            if i % 2000 == 0:
                time.sleep(0.3)
        sys.stderr.write("\n")
        print("done")
    """,
    )
    assert r.returncode == 0 and time.monotonic() - t0 < 20
    err = r.stderr.decode().split("\n")[:-1]  # not splitlines(): a redraw keeps its "\r" marker
    assert 1 <= len(err) <= 30, len(err)  # not thousands of redraws
    assert all(line.startswith("[dc1-gpu0 r3] ") for line in err)
    assert err[-1] == "[dc1-gpu0 r3]  eval 100%|####################| 13000/13000"  # the bar's final state
    assert all(line.startswith("[dc1-gpu0 r3] \r") for line in err[:-1])  # earlier ones: redraws
    assert r.stdout.decode() == "[dc1-gpu0 r3] done\n"


def test_a_long_line_is_split_and_control_sequences_are_removed(tmp_path):
    r = run_worker(
        tmp_path,
        r"""
        import sys
        sys.stdout.write("x" * 40_000 + "\n")
        print("\x1b[2J\x1b]0;owned\x07\x1b[32mgreen\x1b[0m")
    """,
    )
    lines = r.stdout.decode().splitlines()
    assert [len(x) for x in lines[:3]] == [len("[dc1-gpu0 r3] ") + n for n in (16384, 16384, 40_000 - 32768)]
    assert lines[3] == "[dc1-gpu0 r3] \x1b[32mgreen\x1b[0m"


def test_a_rank_cannot_forge_a_line_of_another_node(tmp_path):
    """An embedded newline, carriage return or cursor movement cannot start a line that is not this rank's."""
    r = run_worker(
        tmp_path,
        r"""
        import sys
        sys.stdout.write("mine\n[dc2-a r0] forged by a newline\n")
        sys.stdout.write("x\r[dc2-a r0] forged by a carriage return\n")
        sys.stdout.write("y\x1b[1A\x1b[2K\x1b[G[dc2-a r0] forged by cursor movement\n")
        sys.stdout.write("z\x08\x08\x08[dc2-a r0] forged by backspaces\u2028[dc2-a r0] and a separator\n")
    """,
    )
    assert r.returncode == 0
    assert r.stdout.decode().split("\n") == [
        "[dc1-gpu0 r3] mine",
        "[dc1-gpu0 r3] [dc2-a r0] forged by a newline",
        "[dc1-gpu0 r3] [dc2-a r0] forged by a carriage return",
        "[dc1-gpu0 r3] y[dc2-a r0] forged by cursor movement",
        "[dc1-gpu0 r3] z[dc2-a r0] forged by backspaces[dc2-a r0] and a separator",
        "",
    ]


def test_a_character_split_between_writes_arrives_whole(tmp_path):
    r = run_worker(
        tmp_path,
        r"""
        import sys, time
        for part in (b"price \xe2\x82", b"\xac 5\n"):
            sys.stdout.buffer.write(part)
            sys.stdout.flush()
            time.sleep(0.7)             # the worker reads (and ticks) in between
    """,
    )
    assert r.returncode == 0 and r.stdout.decode() == "[dc1-gpu0 r3] price € 5\n"


def test_a_slow_progress_bar_reaches_the_reader_while_it_runs(tmp_path):
    """One redraw, then minutes of work: its current state is passed on within about a second."""
    script = tmp_path / "child.py"
    script.write_text("import sys, time\nsys.stderr.write('\\repoch 1/3'); sys.stderr.flush()\ntime.sleep(30)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHRUN_NODE_NAME="n1", RANK="0")
    p = subprocess.Popen(
        [*WORKER, str(script)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(p.stderr.readline()), daemon=True)
    try:
        t0 = time.monotonic()
        reader.start()
        reader.join(10)
        assert got == [b"[n1 r0] \repoch 1/3\n"] and time.monotonic() - t0 < 10
    finally:
        p.send_signal(signal.SIGTERM)  # forwarded: the child goes too
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stderr.close()


def test_the_script_runs_as_python_would_run_it(tmp_path):
    """__main__, argv, the script's directory first on sys.path, its own start method and a child of its own."""
    (tmp_path / "helper.py").write_text("VALUE = 'from beside the script'\n")
    r = run_worker(
        tmp_path,
        """
        import multiprocessing as mp, os, sys
        import helper

        def square(x):
            return x * x

        if __name__ == "__main__":
            mp.set_start_method("spawn")
            with mp.Pool(1) as pool:
                squared = pool.map(square, [3])
            print(__name__, os.path.basename(__file__), sys.argv[1:], helper.VALUE, squared, mp.current_process().name)
        """,
        "--lr",
        "0.1",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == (
        "[dc1-gpu0 r3] __main__ child.py ['--lr', '0.1'] from beside the script [9] MainProcess\n"
    )


@pytest.mark.parametrize(
    "code, rc, err",
    [
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("import sys; sys.exit('bad config: lr')", 1, "bad config: lr"),
        ("raise SystemExit(None)", 0, ""),
        ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ],
)
def test_an_ending_is_passed_on_as_python_ends(tmp_path, code, rc, err):
    r = run_worker(tmp_path, code)
    assert r.returncode == rc
    assert err in r.stderr.decode()
    assert all(line.startswith("[dc1-gpu0 r3] ") for line in r.stderr.decode().splitlines())


def test_output_is_unbuffered_and_exit_hooks_run(tmp_path):
    r = run_worker(
        tmp_path,
        """
        import atexit, os, signal, sys
        atexit.register(lambda: print("exit hook ran"))
        print("before the end")          # no flush: -u passes it on at once
        sys.stderr.write("half a line")
        if len(sys.argv) > 1:
            os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    assert r.returncode == 0
    assert r.stdout.decode() == "[dc1-gpu0 r3] before the end\n[dc1-gpu0 r3] exit hook ran\n"
    r = run_worker(tmp_path, (tmp_path / "child.py").read_text(), "die")
    assert r.returncode == -signal.SIGKILL
    assert r.stdout.decode() == "[dc1-gpu0 r3] before the end\n"
    assert r.stderr.decode() == "[dc1-gpu0 r3] half a line\n"


def test_work_the_interpreter_waits_for_is_done_after_the_script_returns(tmp_path):
    """A non-daemon thread, a ThreadPoolExecutor's queued work, an atexit handler that reads the script's
    globals and a log file the script never closed: each finishes after the script's last line, as under
    ``python -u`` (the forked path used to kill the first two and lose the third's module)."""
    r = run_worker(
        tmp_path,
        """
        import atexit, sys, threading, time
        from concurrent.futures import ThreadPoolExecutor

        MARK = "globals kept"

        def later(name):
            time.sleep(1)
            with open(name, "w") as f:
                f.write("done")

        threading.Thread(target=later, args=("thread.out",)).start()
        ThreadPoolExecutor(1).submit(later, "executor.out")
        atexit.register(lambda: print("atexit sees", sys.modules["__main__"].MARK))
        log = open("train.log", "w")
        log.write("last line, never flushed by the script")
        print("returning")
        """,
    )
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == "[dc1-gpu0 r3] returning\n[dc1-gpu0 r3] atexit sees globals kept\n"
    assert (tmp_path / "thread.out").read_text() == "done"
    assert (tmp_path / "executor.out").read_text() == "done"
    assert (tmp_path / "train.log").read_text() == "last line, never flushed by the script"


def test_a_script_that_cannot_be_opened_ends_as_python_says(tmp_path):
    r = subprocess.run(
        [*WORKER, str(tmp_path / "missing.py")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MESHRUN_NODE_NAME": "n", "RANK": "0"},
        capture_output=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert r.stderr.decode().endswith(
        f"can't open file {str(tmp_path / 'missing.py')!r}: [Errno 2] No such file or directory\n"
    )


def test_an_uncaught_exception_keeps_its_frames_as_python_does(tmp_path):
    """Python keeps the last exception (sys.last_*), so the objects in its frames are not freed before the
    interpreter ends: a function's local DDP model is not torn down with the GIL held either."""
    r = run_worker(
        tmp_path,
        """
        import atexit, sys

        class Held:
            def __del__(self):
                print("freed before the end")

        def train():
            model = Held()
            raise RuntimeError("diverged")

        atexit.register(lambda: print("atexit: last exception", type(sys.last_value).__name__))
        train()
        """,
    )
    assert r.returncode == 1
    assert "RuntimeError: diverged" in r.stderr.decode()
    assert r.stdout.decode() == "[dc1-gpu0 r3] atexit: last exception RuntimeError\n"
