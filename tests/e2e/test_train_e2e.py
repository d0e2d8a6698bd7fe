"""End-to-end `meshrun train` on a 3-datacenter NAT world (+ a coordinator datacenter)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import REPO_ROOT, hang_guard, joined_mesh, meshrun_process

from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec

EXAMPLES = REPO_ROOT / "examples"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with joined_mesh(
        tmp_path_factory, [DatacenterSpec(n) for n in ("hq", "dc1", "dc2", "dc3")], "hq-a", ("dc1-a", "dc2-a", "dc3-a")
    ) as m:
        yield m


def train(mesh: Mesh, *args: str, check: bool = False, timeout: float = 240) -> subprocess.CompletedProcess:
    return mesh.meshrun(mesh.coordinator, "train", *args, check=check, timeout=timeout, cwd=EXAMPLES)


def test_ddp_three_ranks_end_identical(mesh):
    """3 ranks in 3 datacenters train to completion; every rank holds the same parameters."""
    res = train(mesh, "ddp_train.py", "--epochs", "3", "--steps-per-epoch", "10")
    assert res.returncode == 0, res.stdout + res.stderr
    sums = dict(re.findall(r"\[(dc\d-a) r\d\] param_checksum rank=\d value=(\w+)", res.stdout))
    assert set(sums) == {"dc1-a", "dc2-a", "dc3-a"}
    assert len(set(sums.values())) == 1
    losses = [float(x) for x in re.findall(r"epoch \d+ loss ([0-9.]+)", res.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "3/3 nodes ready" in res.stderr
    assert re.search(r"meshrun: job \S+ finished on 3 node\(s\)", res.stderr)


def test_failing_rank_sets_exit_code_and_is_named(mesh):
    """Rank 1 exits 3: `meshrun train` exits 3 and names rank 1 and its node."""
    t0 = time.monotonic()
    res = train(mesh, "--nnodes", "2", "exit_code.py", "--rank", "1", "--code", "3")
    assert res.returncode == 3, res.stdout + res.stderr
    m = re.search(r"failed: rank 1 on (dc\d-a) exited with code 3 \(first failure\)", res.stderr)
    assert m, res.stderr
    # The surviving node is stopped (10-20 s here), not left in torchrun's exit barrier (300 s).
    assert time.monotonic() - t0 < hang_guard(30)


def _workers(mesh: Mesh) -> list[str]:
    """Command lines of worker/torchrun processes in any training node's network namespace (not the
    whole machine's: other jobs may run torchrun beside the tests)."""
    found = []
    for node in mesh.world.nodes[1:]:
        pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            # Forked workers and their scripts show the forkserver's command line (meshrun.jobs.agent).
            if any(k in line for k in ("meshrun.jobs.", "multiprocessing", "torch.distributed.run", "ddp_train.py")):
                found.append(f"{pid} {line}")
    return found


def test_sigint_stops_every_worker(mesh):
    """SIGINT to `meshrun train` on the coordinator leaves no worker process on any node."""
    coord = mesh.coordinator
    proc = coord.popen(
        mesh.python,
        "-m",
        "meshrun",
        "train",
        "--state-dir",
        str(mesh.state_dir(coord)),
        "ddp_train.py",
        "--epochs",
        "100",
        "--sleep-per-step",
        "0.2",
        cwd=EXAMPLES,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "training on 3 rank(s)" in line:
                break
            assert time.monotonic() < deadline, "".join(seen)
        assert len(_workers(mesh)) >= 6  # torchrun + worker wrapper + script per node
        import os

        os.kill(meshrun_process(proc), signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 130, "".join(seen) + rest
        assert re.search(r"meshrun: job \S+ cancelled", rest), rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 15
    while _workers(mesh) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _workers(mesh) == []


def test_dry_run_prints_each_nodes_command(mesh):
    res = train(
        mesh, "--dry-run", "--nproc-per-node", "2", "ddp_train.py", "--epochs", "2", "--nnodes", "9", check=True
    )
    blocks = re.findall(r"^# (dc\d-a)$", res.stdout, re.M)
    assert blocks == ["dc1-a", "dc2-a", "dc3-a"]
    for ip in ("10.213.0.2", "10.213.0.3", "10.213.0.4"):
        assert f"--local-addr {ip}" in res.stdout
    assert res.stdout.count("--rdzv-endpoint 10.213.0.1:29401") == 3  # the job's own store
    assert res.stdout.count("--rdzv-backend meshrun") == 3  # its agent store on the overlay only
    assert res.stdout.count("NCCL_SOCKET_IFNAME==meshrun0") == 3
    assert res.stdout.count("GLOO_SOCKET_IFNAME=meshrun0") == 3
    assert res.stdout.count("is_host=0") == 3
    # Options after the script belong to the script, even meshrun's own names.
    assert res.stdout.count("ddp_train.py --epochs 2 --nnodes 9") == 3


def test_job_file_runs_a_module_and_the_command_line_wins(mesh, tmp_path):
    """--config: a job file's settings reach every node; options on the command line override it."""
    job = tmp_path / "job.toml"
    job.write_text(
        'script = "ddp_train"\nmodule = true\nargs = ["--epochs", "1", "--steps-per-epoch", "5"]\n'
        'nnodes = 2\nnodes = ["dc1-a", "dc2-a"]\nrdzv_timeout = 600\n[env]\nMESHRUN_JOBFILE_TEST = "yes"\n'
    )
    res = train(mesh, "--config", str(job), "--dry-run", "--rdzv-timeout", "77", check=True)
    assert re.findall(r"^# (dc\d-a)$", res.stdout, re.M) == ["dc1-a", "dc2-a"]
    assert res.stdout.count("join_timeout=77") == 2 and "join_timeout=600" not in res.stdout
    assert res.stdout.count("MESHRUN_JOBFILE_TEST=yes") == 2
    assert res.stdout.count("meshrun.jobs.agent ") == 2
    assert res.stdout.count(" -m ddp_train --epochs 1 --steps-per-epoch 5") == 2
    res = train(mesh, "--config", str(job))
    assert res.returncode == 0, res.stdout + res.stderr
    sums = dict(re.findall(r"\[(dc\d-a) r\d\] param_checksum rank=\d value=(\w+)", res.stdout))
    assert set(sums) == {"dc1-a", "dc2-a"} and len(set(sums.values())) == 1
    assert re.search(r"meshrun: job \S+ finished on 2 node\(s\)", res.stderr)


def test_missing_node_times_out_naming_it(mesh):
    res = train(
        mesh, "--nodes", "dc1-a,dc2-a", "--nnodes", "2", "--timeout", "3", "--dry-run", "ddp_train.py", check=True
    )
    assert "# dc3-a" not in res.stdout
    res = train(mesh, "--nodes", "nosuch", "ddp_train.py")
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [
        "meshrun: error: --nodes names unknown node(s): nosuch; members are: dc1-a, dc2-a, dc3-a"
    ]


def test_elastic_job_starts_without_a_node_that_is_down(mesh):
    """--nnodes MIN:MAX: with one agent stopped, the job starts on the nodes that answer after
    the grace period instead of waiting for the missing one until the timeout."""
    assert mesh.meshrun("dc3-a", "leave").returncode == 0
    try:
        t0 = time.monotonic()
        res = train(
            mesh, "--nnodes", "1:3", "--timeout", "120", "ddp_train.py", "--epochs", "1", "--steps-per-epoch", "5"
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert "2/3 nodes ready (waiting for: dc3-a)" in res.stderr
        assert re.search(r"meshrun: job \S+ finished on 2 node\(s\)", res.stderr), res.stderr
        assert time.monotonic() - t0 < hang_guard(35)  # the grace period, then a 5-step job
    finally:
        mesh.meshrun("dc3-a", "up")
