"""meshrun.jobs.agent: torchrun whose workers are forked with torch already imported, restarts included.

A real agent on loopback (meshrun's rendezvous backend at a local store, two workers): the scripts see torch
imported before their first line, a failed attempt is restarted the same way, and a regroup
(meshrun.jobs.share.restart_workers) ends the workers but not the forkserver that keeps torch imported.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.elastic")  # the agent is torchrun's

from realetcd import free_port  # noqa: E402
from support import REPO_ROOT  # noqa: E402

from meshrun.jobs import agent, share  # noqa: E402
from meshrun.system.files.statedir import StateDir  # noqa: E402
from meshrun.system.machine import procs, warmfork  # noqa: E402

SCRIPT = """\
import os, sys, time
warm = "torch" in sys.modules  # before this script imported anything: the fork brought it
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"rank={os.environ['RANK']} attempt={attempt} warm={warm} main={__name__} path0={sys.path[0]}", flush=True)
import torch.distributed as dist
dist.init_process_group("gloo")
t = __import__("torch").ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
threads = __import__("torch").get_num_threads()  # torchrun's OMP_NUM_THREADS=1 for two workers on a node
print(f"rank={dist.get_rank()} sum={int(t.item())} threads={threads}", flush=True)
if os.environ.get("FAIL_FIRST") and attempt == "0" and dist.get_rank() == 1:
    sys.exit(3)
if os.environ.get("WAIT_FOR_REGROUP") and attempt == "0":
    time.sleep(120)
if os.environ.get("RELEASE") and attempt == "1":  # held until the test has looked at the agent
    deadline = time.time() + 120
    while not os.path.exists(os.environ["RELEASE"]) and time.time() < deadline:
        time.sleep(0.05)
dist.destroy_process_group()
"""


# The exit race of a DDP script whose model is a global (pytorch examples' shape), forced: when the script
# returns, gloo's thread is freeing a finished all-reduce, which needs the GIL (its tensor has a Python object),
# and the model's reducer holds the last reference to the group, whose destructor joins that thread. A DDP model
# is a reference cycle, so the garbage collector frees it once nothing else holds it, at whatever allocation
# starts a full collection; here an exit hook starts one, first thing after the script. Freeing the script's
# globals with the GIL held (the forked worker before the fix) hung for ever; the interpreter's own finalization
# aborts ("terminate called without an active exception") when gloo's thread gets the GIL too late.
FORCED_EXIT_RACE = """\
import atexit, gc, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 8))
model(torch.randn(4, 8)).sum().backward()
print(f"rank={dist.get_rank()} returning", flush=True)  # the last output: writing it would let go of the GIL
sys.setswitchinterval(60)  # this thread keeps the GIL while it runs Python code: gloo's thread waits for it
work = dist.all_reduce(torch.ones(4), group=model.process_group, async_op=True)
del work  # gloo's thread now holds the last reference to the work and its tensor
dist.destroy_process_group()  # the model's reducer now holds the last reference to the group
atexit.register(gc.collect)  # a full collection once the script is done: frees the model if nothing holds it
end = time.monotonic() + 1.0
while time.monotonic() < end:  # the all-reduce completes meanwhile; freeing it waits for the GIL
    pass
"""


def agent_cmd(script: Path, port: int, restarts: int = 1, workers: str = "warm") -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshrun.jobs.agent",
        "--workers",
        workers,
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "meshrun",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "t",
        "--rdzv-conf",
        "is_host=0",
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.1",
        str(script),
    ]


@pytest.fixture
def store_port():
    """A rendezvous store as a coordinator hosts it (meshrun's backend: a store per round for the workers;
    torch's c10d backend hands restarted workers the first round's addresses, pytorch/pytorch#135712)."""
    from torch.distributed import TCPStore

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield port
    del server


def agent_env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "MESHRUN_", "TORCHELASTIC", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "PYTHONPATH": str(REPO_ROOT), "MESHRUN_NODE_NAME": "n1", **extra}


def stop(p: subprocess.Popen) -> None:
    """End an agent that is still running with everything below it: its forkserver lives as long as the
    workers it forked hold their end of its pipe, and they outlive an agent killed alone."""
    if p.poll() is None:
        procs.kill_tree(p.pid, grace=5)
        p.wait()


def start_agent(tmp_path: Path, port: int, stderr: int, **env: str) -> subprocess.Popen:
    """An agent running SCRIPT with two workers, its output read as text."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.Popen(
        agent_cmd(script, port), cwd=tmp_path, env=agent_env(**env), stdout=subprocess.PIPE, stderr=stderr, text=True
    )


def agent_helpers(agent: int) -> set[int]:
    """The agent's forkserver and resource tracker, as a regroup tells them from its workers."""
    return {pid for pid in procs.children(agent) if warmfork.is_helper(procs.argv(pid), procs.argv(agent))}


def test_workers_start_warm_and_a_failed_attempt_restarts_warm(tmp_path, store_port):
    p = start_agent(tmp_path, store_port, subprocess.PIPE, FAIL_FIRST="1")
    try:
        out, err = p.communicate(timeout=240)
    finally:
        stop(p)
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    assert r.returncode == 0, r.stdout + r.stderr
    starts = re.findall(r"^\[n1 r(\d)\] rank=\1 attempt=(\d) warm=(\w+) main=(\S+) path0=(\S+)$", r.stdout, re.M)
    assert sorted((rank, attempt) for rank, attempt, *_ in starts) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {(warm, main, path0) for *_, warm, main, path0 in starts} == {("True", "__main__", str(tmp_path))}
    assert r.stdout.count("sum=3") == 4  # both ranks, both attempts: a working gloo group each time
    assert re.findall(r"sum=3 threads=(\d+)", r.stdout) == ["1"] * 4, r.stdout
    assert "exitcode: 3" in r.stderr  # torch's own account of the failed attempt


def test_a_regroup_ends_the_workers_but_not_the_forkserver(tmp_path, store_port):
    """restart_workers, as a node's share runs it: the workers go and come back warm; torch's helpers stay."""
    job = StateDir(tmp_path / "job")
    job.create()
    lock = procs.DaemonLock(job / "share.lock").acquire("the test's share")  # this process plays the share
    release = tmp_path / "release"
    p = start_agent(tmp_path, store_port, subprocess.DEVNULL, WAIT_FOR_REGROUP="1", RELEASE=str(release))
    try:
        seen = [p.stdout.readline() for _ in range(4)]  # two starts, two sums
        assert sum("sum=3" in line for line in seen) == 2, seen
        helpers = agent_helpers(p.pid)
        # The forkserver is a fork of the agent (torch imported once, not twice): the agent's own command line.
        assert [pid for pid in helpers if procs.argv(pid) == procs.argv(p.pid)], procs.descendants(p.pid)
        assert share.restart_workers(job, time.time()) == 2  # both workers; each passes it on to its script
        # Two starts and two sums, in no fixed order across ranks: each rank's lines reach the agent's
        # output through its own reader, so rank 0's sum can come before rank 1's start.
        restarted = [p.stdout.readline() for _ in range(4)]
        assert sum("attempt=1" in line for line in restarted) == 2, restarted
        # The same forkserver forked the new workers: it was not ended and made again. The workers wait for
        # `release` before they end, so the agent and its helpers are still there to be looked at.
        assert all(procs.alive(pid) for pid in helpers)
        assert agent_helpers(p.pid) == helpers
        release.touch()
        out, _ = p.communicate(timeout=120)
        out = "".join(restarted) + out
    finally:
        stop(p)
        lock.release()
    assert p.returncode == 0, out
    assert re.findall(r"attempt=1 warm=(\w+)", out) == ["True", "True"]
    assert out.count("sum=3") == 2
    # They end with the agent, once they see its end of their pipe close.
    assert all(procs.wait_gone(pid, timeout=30) for pid in helpers)


@pytest.mark.parametrize("workers", ["warm", "cold"])
def test_a_script_returning_while_gloo_frees_its_work_ends(tmp_path, store_port, workers):
    """FORCED_EXIT_RACE ends with code 0 on both ranks, each kind of worker (it hung for ever when warm)."""
    script = tmp_path / "train.py"
    script.write_text(FORCED_EXIT_RACE)
    p = subprocess.Popen(
        agent_cmd(script, store_port, restarts=0, workers=workers),
        cwd=tmp_path,
        env=agent_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = p.communicate(timeout=120)  # a hang guard: it ends in about 5 s alone (8 s cold)
    finally:
        stop(p)
    assert p.returncode == 0, out + err
    assert out.count("returning") == 2, out + err


@pytest.mark.parametrize("argv", [["--workers", "lukewarm", "x.py"], ["--workers"], ["--workers=", "x.py"]])
def test_the_agent_refuses_an_unknown_worker_kind(tmp_path, argv):
    r = subprocess.run(
        [sys.executable, "-m", "meshrun.jobs.agent", *argv],
        cwd=tmp_path,
        env=agent_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.startswith("meshrun.jobs.agent: --workers "), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_agent_refuses_no_python_and_standalone(tmp_path):
    for flag in ("--no-python", "--standalone"):
        r = subprocess.run(
            [sys.executable, "-m", "meshrun.jobs.agent", flag, "--nnodes", "1", "x.py"],
            cwd=tmp_path,
            env=agent_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr.startswith("meshrun.jobs.agent: "), r.stderr
        assert flag in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_traceback_is_formatted_before_torchs_formatter_sees_it():
    """torch's formatter would import torch._dynamo (seconds) for a record that still carries exc_info."""
    try:
        raise RuntimeError("worker 1 failed")
    except RuntimeError:
        record = logging.LogRecord("torch.x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    assert agent._preformat(record) is True
    assert record.exc_info is None
    assert record.exc_text.startswith("Traceback") and record.exc_text.endswith("RuntimeError: worker 1 failed")


@pytest.mark.parametrize("module", [False, True])
def test_worker_args(module):
    assert agent.worker_args(module, "train", ["--x", "1"]) == (("--module" if module else "--"), "train", "--x", "1")
