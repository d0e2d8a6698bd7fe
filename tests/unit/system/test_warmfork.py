"""meshrun.system.machine.warmfork: what a forked child writes is its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from support import REPO_ROOT

from meshrun.system.machine import procs

PARENT = textwrap.dedent(
    """
    import sys
    from meshrun.system.machine import warmfork
    sys.stdout.write("parent's line\\n")  # a pipe: block-buffered, still in the buffer at the fork
    child = warmfork.fork_call(lambda: print("child's line") or 0)
    got = child.stdout.read()
    child.wait()
    sys.stderr.write(repr(got))
    """
)


def test_the_parents_buffered_output_is_not_written_again_by_the_child():
    """The child flushes every open file at its end (as the interpreter's exit would); the parent's stdout
    buffer, copied by the fork, must already be empty then, or its lines come out twice."""
    r = subprocess.run(
        [sys.executable, "-c", PARENT],
        # Buffered as a script's stdout is by default (PYTHONUNBUFFERED would write each line at once).
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"parent's line\n"
    assert r.stderr == repr(b"child's line\n").encode()


# A parent that marks a module it imported, starts the forkserver (`thread`: with a Python thread running), and
# has a forkserver worker say whether it sees the mark (only a fork of the parent does), and the forkserver's pid.
FORKSERVER_PARENT = textwrap.dedent(
    """
    import json, multiprocessing, sys, threading, time
    from meshrun.system.machine import warmfork
    import probe
    json.meshrun_mark = "marked in the parent"
    if sys.argv[1] == "thread":
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    if sys.argv[1] == "unusable":  # as after torch asked CUDA for its devices: the fork must not serve
        warmfork._usable_fork = lambda: False
    warmfork.start_forkserver(["json", "probe"])
    queue = multiprocessing.get_context("forkserver").SimpleQueue()
    worker = multiprocessing.get_context("forkserver").Process(target=probe.report, args=(queue,))
    worker.start()
    worker.join(60)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    helper = warmfork.is_helper(open(f"/proc/{server}/cmdline").read().split("\\0"))
    print(queue.get(), server, worker.exitcode, helper, flush=True)
    """
)
PROBE = 'def report(queue):\n    import json\n    queue.put(getattr(json, "meshrun_mark", None))\n'


def run_forkserver_parent(tmp_path, mode: str) -> tuple[str, int, bool]:
    (tmp_path / "probe.py").write_text(PROBE)
    r = subprocess.run(
        [sys.executable, "-c", FORKSERVER_PARENT, mode],
        env={**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{tmp_path}"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    *mark, server, exitcode, helper = r.stdout.split()
    assert exitcode == "0", r.stdout
    return " ".join(mark), int(server), helper == "True"


def test_the_forkserver_is_a_fork_of_its_starter_and_ends_with_it(tmp_path):
    """What the parent imported and set, the workers have (the import is paid once); once the parent is gone
    the forkserver ends (nothing holds the alive pipe's write end, not even the fork itself)."""
    mark, server, new_interpreter = run_forkserver_parent(tmp_path, "alone")
    assert mark == "marked in the parent" and not new_interpreter
    assert procs.wait_gone(server, timeout=30), f"the forkserver {server} outlived its parent"


def test_with_a_thread_running_the_forkserver_is_a_new_interpreter(tmp_path):
    """A fork copies only the calling thread: with another Python thread running, multiprocessing's own
    forkserver (a new interpreter, which imports the preload itself) is started instead."""
    mark, server, new_interpreter = run_forkserver_parent(tmp_path, "thread")
    assert mark == "None" and new_interpreter
    assert procs.wait_gone(server, timeout=30)


def test_a_fork_that_could_not_use_cuda_becomes_a_new_interpreter(tmp_path):
    """Once the parent asked CUDA for its devices, its forks cannot use the GPU: the forked forkserver replaces
    itself by multiprocessing's own (same pid and socket), whose workers import torch themselves."""
    mark, server, new_interpreter = run_forkserver_parent(tmp_path, "unusable")
    assert mark == "None" and new_interpreter
    assert procs.wait_gone(server, timeout=30)
