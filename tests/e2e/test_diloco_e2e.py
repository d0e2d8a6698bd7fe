"""End-to-end: examples/diloco_charlm.py trained with DiLoCo under `meshrun train` over the real mesh."""

from __future__ import annotations

import re

import pytest
from support import CHARLM_SMALL, REPO_ROOT, TrainJob, joined_mesh

EXAMPLES = REPO_ROOT / "examples"
FINAL = re.compile(
    r"^\[(dc\d-a) r0\] final val_loss=(\d+\.\d+) bytes_sent=(\d+) .*\bmode=diloco world_size=2 "
    r"steps=20\b",
    re.M,
)


def test_diloco_charlm_trains_across_two_datacenters(fresh_mesh):
    """Coordinator + 2 NAT'd nodes: `meshrun train` ships examples/, runs 2 DiLoCo workers, exits 0.

    rank 0's final line parses, its loss is finite and it sent pseudo-gradients (bytes_sent > 0);
    two syncs of fp16 pseudo-gradients go out, so bytes_sent is exactly 2 * 2 bytes * params.
    """
    mesh = fresh_mesh(3, "dc1-a")
    for n in ("dc2-a", "dc3-a"):
        mesh.join(n)
    res = train(
        mesh, "diloco_charlm.py", "--mode", "diloco", "--steps", "20", "--sync-every", "10", *CHARLM_SMALL,
        "--compression", "fp16",  # the last one given wins: fp16 (two syncs of exactly 2 bytes a parameter)
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    m = FINAL.search(res.stdout)
    assert m, f"no final line from rank 0 in:\n{res.stdout[-3000:]}"
    val_loss, sent = float(m.group(2)), int(m.group(3))
    assert 0 < val_loss < 10
    assert sent > 0
    params = int(re.search(r"\bparams=(\d+)", res.stdout).group(1))
    assert sent == 2 * 2 * params
    assert "finished on 2 node(s)" in res.stderr
    assert "resumed rank=" not in res.stdout  # the project's first job: nothing to resume
    first = re.search(r"meshrun: job (\S+) submitted", res.stderr).group(1)

    # The project's next job starts a fresh run, with another compression too (the first job's snapshots,
    # made for fp16's outer state, are not read); resuming the first job continues its run at its last sync.
    again = train(
        mesh,
        "diloco_charlm.py",
        "--mode",
        "diloco",
        "--steps",
        "20",
        "--sync-every",
        "10",
        *CHARLM_SMALL,
        "--compression",
        "sparse-int2",
    )
    assert again.returncode == 0 and "resumed rank=" not in again.stdout, (again.stdout + again.stderr)[-3000:]
    resumed = train(mesh, "--resume", first)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert re.search(r"\] resumed rank=0 world_size=2 sync=\d+ step=20 ", resumed.stdout), resumed.stdout[-3000:]


def train(mesh, *args: str):
    """`meshrun train ARGS` on the coordinator, from examples/ (--state-dir before the script: everything after
    the script goes to it, so Mesh.meshrun, which appends --state-dir, cannot be used)."""
    coord = mesh.coordinator
    return coord.run(
        mesh.python,
        "-m",
        "meshrun",
        "train",
        "--state-dir",
        str(mesh.state_dir(coord)),
        "--timeout",
        "60",
        *args,
        cwd=EXAMPLES,
        check=False,
        timeout=120,
    )


# --------------------------------------------------------------------------- membership changes under meshrun train

ELASTIC = (
    "--nnodes",
    "2:3",
    "--nodes",
    "dc2-a,dc3-a,dc4-a",
    "--max-restarts",
    "3",
    "--timeout",
    "90",
    "diloco_charlm.py",
    "--mode",
    "diloco",
    "--steps",
    "300",
    "--sync-every",
    "20",
    *CHARLM_SMALL,
)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    with joined_mesh(tmp_path_factory, 4, "dc1-a", ("dc2-a", "dc3-a", "dc4-a")) as m:
        yield m


def _outer_steps(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\] outer_step (\d+) ", text)]


def test_an_elastic_diloco_job_loses_a_node_and_finishes_on_two_losing_at_most_one_outer_step(four):
    import os
    import signal

    from meshrun.system.machine.procs import descendants

    agent = four.status("dc4-a")["daemon_pid"]
    job = TrainJob(four, *ELASTIC)
    try:
        job.wait_for(r"\] outer_step 4 ", 180)
        for pid in descendants(agent):  # the node is gone: agent, share, workers
            os.kill(pid, signal.SIGKILL)
        code = job.finish(420)
    finally:
        four.meshrun("dc4-a", "up")
    text = job.text
    assert code == 0, text[-4000:]
    assert re.search(r"meshrun: job \S+ finished on 2 node\(s\) \(lost dc4-a mid-job", text), text[-3000:]
    # Progress lost: the last outer step the 3-node group logged before the survivors resumed, less the
    # step they resumed at (output arrives in order per node, so the lines before "resumed" are the old group's).
    # One step beyond it is no loss: the old group finished that step, and a rank that had written its snapshot
    # passes it on, but rank 0 was ended (the group re-forming) before printing its line, so nobody printed it.
    m = re.search(r"\] resumed rank=0 world_size=2 sync=(\d+) ", text)
    assert m, text[-3000:]
    resumed, last_old = int(m.group(1)), max(_outer_steps(text[: m.start()]))
    assert last_old - 1 <= resumed <= last_old + 1, (last_old, m.group(0), text[-3000:])  # at most one lost
    logged = _outer_steps(text)
    assert sorted(set(logged) | {resumed}) == list(range(1, 300 // 20 + 1))  # no outer step skipped
    digests = set(re.findall(r"\] param_checksum rank=\d+ sync=15 digest=(\w+)", text))
    assert len(digests) == 1, text[-3000:]


def test_a_node_that_joins_an_elastic_diloco_job_ends_identical(four):
    assert four.meshrun("dc4-a", "leave").returncode == 0  # down when the job starts
    # Steps padded to 0.1 s: unpadded, the 240 steps left after outer step 3 take ~8 s, and on a loaded
    # 2-core CI machine the job could finish before the returning node's agent was up (seen once in CI).
    job = TrainJob(four, *ELASTIC, "--step-time", "0.1")
    try:
        job.wait_for(r"\] outer_step 3 ", 240)
        four.meshrun("dc4-a", "up")  # back: the job takes it
        code = job.finish(420)
    finally:
        four.meshrun("dc4-a", "up")
    text = job.text
    assert code == 0, text[-4000:]
    assert "dc4-a joined the job (elastic)" in text, text[-3000:]
    assert re.search(
        r"\[dc4-a r\d\] resumed rank=\d world_size=3 sync=\d+ step=\d+ source_rank=\d received=yes", text
    ), text[-3000:]
    digests = dict(re.findall(r"\[(dc\d-a) r\d\] param_checksum rank=\d+ sync=15 digest=(\w+)", text))
    assert set(digests) == {"dc2-a", "dc3-a", "dc4-a"} and len(set(digests.values())) == 1, digests
