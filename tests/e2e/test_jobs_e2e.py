"""Jobs belong to the mesh: they outlive the terminal and the coordinator daemon; failures are found
fast and named; the coordinator can take a share.

Real meshrun, wireguard-go and torch.distributed in a NAT'd namespace world (hq = coordinator,
dc1..dc3 = nodes). Every process is started and killed by PID.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time

import pytest
from support import REPO_ROOT, hang_guard, joined_mesh, meshrun_process

from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec
from meshrun.system.machine.procs import alive, descendants

EXAMPLES = REPO_ROOT / "examples"
CHECKSUM = re.compile(r"\[(\S+) r(\d+)\] param_checksum rank=\d+ value=(\w+)")
# A job that lost a node (below MIN, or any for a fixed size) stops within this (docs/jobs.md); the detection
# alone is measured by benchmarks/loss_detection.py (2.7 s).
STOP_S = 30


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with joined_mesh(
        tmp_path_factory, [DatacenterSpec(n) for n in ("hq", "dc1", "dc2", "dc3")], "hq-a", ("dc1-a", "dc2-a", "dc3-a")
    ) as m:
        yield m


class Running:
    """`meshrun train` (or `meshrun logs -f`) started in the coordinator; its lines collected as they come."""

    def __init__(self, mesh: Mesh, *args: str) -> None:
        self.mesh = mesh
        self.proc = mesh.meshrun_popen(
            mesh.coordinator,
            *args,
            cwd=EXAMPLES,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # As a terminal's shell starts it: SIGHUP at its default. A suite run under nohup would otherwise hand
            # its ignored SIGHUP down to `meshrun train`, and the closed-terminal test would hang up nothing.
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text)
            if m:
                return m
            assert self.proc.poll() is None or re.search(pattern, self.text), self.text[-4000:]
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.text[-4000:]}")

    def meshrun_pid(self) -> int:
        return meshrun_process(self.proc)

    def finish(self, timeout: float = 240) -> int:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(10)
        return self.proc.returncode


def job_of(run: Running) -> str:
    return run.wait_for(r"meshrun: job (\S+) submitted").group(1)


def record(mesh: Mesh, job: str) -> dict:
    return next(r for r in json.loads(mesh.meshrun(mesh.coordinator, "jobs", "--json").stdout) if r["job_id"] == job)


def wait_final(mesh: Mesh, job: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = record(mesh, job)
        if r["state"] in ("succeeded", "failed", "cancelled", "lost"):
            return r
        time.sleep(1)
    raise AssertionError(f"job {job} did not end within {timeout} s: {record(mesh, job)}")


def checksums(text: str) -> dict[str, str]:
    return {f"{node} r{rank}": value for node, rank, value in CHECKSUM.findall(text)}


LONG = (
    "ddp_train.py",
    "--epochs",
    "3",
    "--steps-per-epoch",
    "20",
    "--sleep-per-step",
    "0.4",
    "--log-steps",
    "--checkpoint",
    "",
)


def test_closing_the_terminal_leaves_the_job_running(mesh):
    run = Running(mesh, "train", *LONG)
    job = job_of(run)
    run.wait_for(r"\] step 5\b")
    pid = run.meshrun_pid()
    import os

    os.kill(pid, signal.SIGHUP)  # what an SSH drop sends
    run.finish(timeout=30)
    assert not alive(pid)
    r = wait_final(mesh, job)
    assert r["state"] == "succeeded" and r["exit_code"] == 0, r
    assert sorted(r["nodes"]) == ["dc1-a", "dc2-a", "dc3-a"] and r["ranks"] == 3
    # How far it got, as the example reports it (meshrun.train.report each epoch, rank 0): in the record and the
    # table, not in the logs.
    progress = r["progress"]
    assert (progress["step"], progress["total"]) == (60, 60) and progress["numbers"]["loss"] > 0, r
    assert progress["rate"] > 0 and r["rank0"] in r["nodes"] and r["last_output"] >= progress["at"], r
    table = mesh.meshrun(mesh.coordinator, "jobs").stdout
    assert re.search(rf"^{re.escape(job)} .* 60/60 .* {r['rank0']} ", table, re.M), table
    logs = mesh.meshrun(mesh.coordinator, "logs", job)
    assert "@meshrun:progress" not in logs.stdout + logs.stderr
    sums = checksums(logs.stdout)
    # --since and --tail choose where the replay starts: all of it from 30 days ago, none of it at its last 0 lines.
    assert mesh.meshrun(mesh.coordinator, "logs", job, "--since", "30d").stdout == logs.stdout
    assert mesh.meshrun(mesh.coordinator, "logs", job, "--tail", "0").stdout == ""
    # Every node, every rank, once each (which node got which rank is the rendezvous' choice).
    assert sorted(k.split()[0] for k in sums) == ["dc1-a", "dc2-a", "dc3-a"], logs.stdout[-3000:]
    assert sorted(k.split()[1] for k in sums) == ["r0", "r1", "r2"], logs.stdout[-3000:]
    assert len(set(sums.values())) == 1
    for rank in range(3):  # every rank's full output, from its first step
        steps = re.findall(rf"^\[\S+ r{rank}\] step (\d+)$", logs.stdout, re.M)
        assert [int(s) for s in steps] == list(range(1, 61)), (rank, steps)
    only = mesh.meshrun(mesh.coordinator, "logs", job, "--node", "dc2-a").stdout
    assert only and all(line.startswith("[dc2-a") for line in only.splitlines())
    table = mesh.meshrun(mesh.coordinator, "jobs").stdout
    assert re.search(rf"^{re.escape(job)}\s+succeeded\s+\S+\s+3\s", table, re.M), table


def test_the_job_survives_a_coordinator_daemon_restart(mesh):
    coord_pid = mesh.status(mesh.coordinator)["daemon_pid"]
    run = Running(mesh, "train", *LONG)
    job = job_of(run)
    run.wait_for(r"\] step 5\b")
    import os

    os.kill(coord_pid, signal.SIGKILL)
    time.sleep(2)
    assert "up at" in mesh.meshrun(mesh.coordinator, "up").stdout
    follow = Running(mesh, "logs", "-f", job)  # attaches after the restart, replays from the start
    assert follow.finish() == 0
    assert run.finish() == 0, run.text[-4000:]
    for text in (run.text, follow.text):
        sums = checksums(text)
        assert len(sums) == 3 and len(set(sums.values())) == 1, text[-3000:]
    assert wait_final(mesh, job)["state"] == "succeeded"
    assert mesh.status(mesh.coordinator)["daemon_pid"] not in (None, coord_pid)


def _kill_nodes(mesh: Mesh, *names: str) -> float:
    """SIGKILL the nodes' agents and everything under them (their shares, torchrun, the workers) at once;
    returns the monotonic time of the kill (each agent is looked up first: a status takes seconds)."""
    import os

    agents = [mesh.status(name)["daemon_pid"] for name in names]
    at = time.monotonic()
    for pid in [p for agent in agents for p in descendants(agent)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return at


def test_a_lost_node_stops_a_fixed_size_job_naming_it(mesh):
    run = Running(mesh, "train", *LONG)
    run.wait_for(r"\] step 5\b")
    try:
        t0 = _kill_nodes(mesh, "dc2-a")
        code = run.finish(timeout=hang_guard(STOP_S) + 30)
    finally:
        mesh.meshrun("dc2-a", "up")
    took = time.monotonic() - t0
    assert code != 0 and took < hang_guard(STOP_S), (code, took, run.text[-3000:])
    assert re.search(r"meshrun: job \S+ failed: lost node dc2-a \(its agent stopped answering\)", run.text), run.text[
        -3000:
    ]


def test_an_elastic_job_below_min_stops_saying_how_many_nodes_are_left(mesh):
    run = Running(mesh, "train", "--nnodes", "2:3", "--max-restarts", "3", *LONG)
    run.wait_for(r"\] step 5\b")
    try:
        t0 = _kill_nodes(mesh, "dc2-a", "dc3-a")
        code = run.finish(timeout=hang_guard(STOP_S) + 30)
        took = time.monotonic() - t0  # the job's stop alone: bringing the nodes back below is not part of it
    finally:
        for n in ("dc2-a", "dc3-a"):
            mesh.meshrun(n, "up")
    assert code != 0 and took < hang_guard(STOP_S), (code, took, run.text[-3000:])
    assert re.search(r"meshrun: job \S+ stopped: 1 of 2 nodes left", run.text), run.text[-3000:]


def test_the_coordinator_takes_a_share(mesh):
    dry = mesh.meshrun(
        mesh.coordinator,
        "train",
        "--with-coordinator",
        "--nodes",
        "dc1-a,dc2-a",
        "--dry-run",
        "ddp_train.py",
        cwd=EXAMPLES,
    ).stdout
    # The pre-flight table first (every node checked, the coordinator included), then one block per node.
    assert re.findall(r"^# (\S+)$", dry, re.M) == ["code", "pre-flight", "coordinator", "dc1-a", "dc2-a"]
    coord_block = dry.split("# coordinator\n")[1].split("\n# ")[0]
    for pin in (
        "--local-addr 10.213.0.1",
        "NCCL_SOCKET_IFNAME==meshrun0",
        "GLOO_SOCKET_IFNAME=meshrun0",
        "--rdzv-endpoint 10.213.0.1:29401",
        "--rdzv-backend meshrun",
    ):
        assert pin in coord_block, coord_block
    res = mesh.meshrun(
        mesh.coordinator,
        "train",
        "--with-coordinator",
        "--nodes",
        "dc1-a,dc2-a",
        "ddp_train.py",
        "--epochs",
        "2",
        "--steps-per-epoch",
        "5",
        cwd=EXAMPLES,
        check=False,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sums = checksums(res.stdout)
    assert {k.split()[0] for k in sums} == {"coordinator", "dc1-a", "dc2-a"} and len(set(sums.values())) == 1
    assert "training on 3 rank(s)" in res.stdout
