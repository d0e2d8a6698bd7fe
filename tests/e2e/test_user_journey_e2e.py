"""A new user's first hour, as sessions: `meshrun train` from a real project directory.

The project looks like one: a script importing a sibling module, reading its arguments and
environment, drawing a tqdm progress bar, writing checkpoints into its working directory; a 200 MB
data directory the .gitignore leaves out; the output redirected into the project (`> train.log`,
`| tee train.log`). Real meshrun, wireguard-go and torch.distributed (gloo) in a NAT'd namespace
world: hq (coordinator) and two datacenters. Each test asserts the job's exit code, every rank's
last line, and what was shipped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from support import joined_mesh

from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec

TRAIN = textwrap.dedent('''\
    """A user's training script: a sibling module, its own arguments and environment, a progress bar,
    checkpoints in its working directory (every node keeps one; the next run resumes from it)."""
    import argparse
    import os
    import sys

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from model import make_model                # a sibling module of the script

    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--tag", default="")
    p.add_argument("--bar", type=int, default=0, help="progress-bar updates on rank 0")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    print(f"tag={args.tag} env={os.environ.get('JOURNEY_ENV')} "
          f"cwd_is_output_dir={os.getcwd() == os.environ.get('MESHRUN_OUTPUT_DIR')} "
          f"project={os.environ.get('MESHRUN_PROJECT')}", flush=True)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = os.path.join("checkpoints", "last.pt")
    start = 0
    if os.path.exists(ckpt):                    # every node wrote the same one: the parameters are identical
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        start = int(state["epoch"])
    agreed = torch.tensor([start])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    assert int(agreed) == start, f"rank {rank} found epoch {start}, another rank {int(agreed)}"
    g = torch.Generator().manual_seed(rank)
    for epoch in range(start, args.epochs):
        for _ in range(5):
            x = torch.randn(16, 8, generator=g)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            for q in model.parameters():
                dist.all_reduce(q.grad)
                q.grad /= world
            opt.step()
        if local == 0:
            os.makedirs("checkpoints", exist_ok=True)
            torch.save({"epoch": epoch + 1, "model": model.state_dict()}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        print(f"epoch {epoch + 1} loss {loss.item():.4f}", flush=True)
    if args.bar and rank == 0:
        for _ in tqdm(range(args.bar), mininterval=0, miniters=1, ncols=100, desc="eval"):
            pass
    digest = sum(float(q.detach().double().sum()) for q in model.parameters())
    dist.barrier()
    print(f"last line: rank {rank} of {world} finished from epoch {start} to {args.epochs} params {digest:.6f}",
          flush=True)
''')
MODEL = (
    "import torch\n\n\ndef make_model():\n"
    "    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))\n"
)
LAST = re.compile(
    r"^\[(\S+) r(\d+)\] last line: rank (\d+) of (\d+) finished from epoch (\d+) to (\d+) params (\S+)$", re.M
)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with joined_mesh(
        tmp_path_factory, [DatacenterSpec(n) for n in ("hq", "dc1", "dc2")], "hq-a", ("dc1-a", "dc2-a")
    ) as m:
        yield m


def project(root: Path, name: str, git: bool) -> Path:
    """A user's project directory; with `git`, a work tree whose .gitignore leaves out data/ (200 MB)."""
    proj = root / name
    (proj / "data").mkdir(parents=True)
    (proj / "train.py").write_text(TRAIN)
    (proj / "model.py").write_text(MODEL)
    with open(proj / "data" / "corpus.bin", "wb") as f:  # 200 MB as the listing sees it
        f.truncate(200 * 1000 * 1000)
    if git:
        (proj / ".gitignore").write_text("data/\n__pycache__/\n")
        env = {
            **os.environ,
            "GIT_AUTHOR_NAME": "u",
            "GIT_AUTHOR_EMAIL": "u@x",
            "GIT_COMMITTER_NAME": "u",
            "GIT_COMMITTER_EMAIL": "u@x",
        }
        for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "start"]):
            subprocess.run(["git", "-C", str(proj), *cmd], check=True, env=env, capture_output=True)
    else:
        (proj / ".meshrunignore").write_text("data/\n")
    return proj


def shell(mesh: Mesh, proj: Path, line: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`line` in a shell on the coordinator, in the project directory, `meshrun` being the real CLI."""
    coord = mesh.coordinator
    meshrun = f"{shlex.quote(mesh.python)} -m meshrun"
    return coord.run(
        "sh",
        "-c",
        f"cd {shlex.quote(str(proj))} && {line.replace('meshrun', meshrun, 1)}",
        check=False,
        timeout=timeout,
        env={"MESHRUN_STATE_DIR": str(mesh.state_dir(coord))},
    )


def last_lines(out: str) -> dict[int, tuple]:
    return {int(m.group(3)): m.groups() for m in LAST.finditer(out)}


def work_dir(mesh: Mesh, node: str, name: str) -> Path:
    return mesh.state_dir(mesh.world.node(node)) / "projects" / name / "work"


def test_a_git_project_with_its_log_redirected_into_it_runs_ships_only_code_and_shows_the_bar(mesh, tmp_path):
    proj = project(tmp_path, "charlm", git=True)
    dry = shell(mesh, proj, "meshrun train --dry-run train.py --epochs 2")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert re.search(r"^#   ships 3 file\(s\), .* from .*charlm \(git's ignore rules\)", dry.stdout, re.M), dry.stdout
    assert re.search(r"^#   not shipped: data/ 190\.7 MiB \(1 files\)", dry.stdout, re.M), dry.stdout

    res = shell(
        mesh, proj, "meshrun train --env JOURNEY_ENV=hello train.py --epochs 2 --tag first --bar 4000 > train.log 2>&1"
    )
    log = (proj / "train.log").read_text()
    assert res.returncode == 0, log
    assert "pre-flight refused" not in log and "differs" not in log
    # the log itself was untracked and not ignored: it shipped as it was when packed, and the pre-flight
    # compared exactly those bytes; the data did not ship
    assert re.search(r"meshrun: shipping 4 file\(s\), .* to project 'charlm'", log), log
    lasts = last_lines(log)
    assert sorted(lasts) == [0, 1], log
    assert {g[0] for g in lasts.values()} == {"dc1-a", "dc2-a"}
    assert {g[5:] for g in lasts.values()} == {("2", next(iter(lasts.values()))[6])}  # same epochs and params
    assert all(g[4] == "0" for g in lasts.values())  # a fresh start
    assert log.count("tag=first env=hello cwd_is_output_dir=True project=charlm") == 2
    # the progress bar: its final state arrived, not thousands of redraws
    assert re.search(r"eval: 100%.*4000/4000", log), log[-3000:]
    assert len(log.splitlines()) < 200, len(log.splitlines())
    for node in ("dc1-a", "dc2-a"):
        work = work_dir(mesh, node, "charlm")
        shipped = json.loads((work.parent / "shipped.json").read_text())["names"]
        assert shipped == [".gitignore", "model.py", "train.log", "train.py"]
        assert sorted(p.name for p in work.iterdir()) == [
            ".gitignore",
            "checkpoints",
            "model.py",
            "train.log",
            "train.py",
        ]
    assert re.search(r"meshrun: job \S+ finished on 2 node\(s\)", log)


def test_the_next_job_resumes_from_the_checkpoints_and_they_can_be_pulled(mesh, tmp_path):
    """A project without git (.meshrunignore leaves data/ out), `| tee` into it, the coordinator training
    too; the next job resumes where the first stopped; `meshrun pull` brings the checkpoints back."""
    proj = project(tmp_path, "resumable", git=False)
    first = shell(
        mesh,
        proj,
        "meshrun train --with-coordinator --job-id journey-a train.py --epochs 2 --tag a 2>&1 | tee train.log",
    )
    assert first.returncode == 0, first.stdout
    assert (proj / "train.log").read_text() == first.stdout
    lasts = last_lines(first.stdout)
    assert sorted(lasts) == [0, 1, 2] and {g[0] for g in lasts.values()} == {"coordinator", "dc1-a", "dc2-a"}, (
        first.stdout
    )
    assert re.search(r"meshrun: shipping 4 file\(s\)", first.stdout)  # .meshrunignore, model.py, train.log, train.py

    second = shell(
        mesh,
        proj,
        "meshrun train --resume journey-a --job-id journey-b train.py --epochs 4 --tag b 2>&1 | tee train.log",
    )
    assert second.returncode == 0, second.stdout
    lasts = last_lines(second.stdout)
    assert sorted(lasts) == [0, 1, 2], second.stdout
    assert {(g[4], g[5]) for g in lasts.values()} == {("2", "4")}, second.stdout  # from epoch 2, everywhere
    assert len({g[6] for g in lasts.values()}) == 1

    dest = tmp_path / "pulled"
    pulled = shell(mesh, proj, f"meshrun pull journey-b checkpoints/last.pt --dest {dest}")
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    for node in ("coordinator", "dc1-a", "dc2-a"):
        state = torch.load(dest / node / "checkpoints" / "last.pt", weights_only=True)
        assert state["epoch"] == 4
    bad = shell(mesh, proj, "meshrun pull journey-b ../../../member.json")
    assert bad.returncode != 0 and "not inside the job's directory" in bad.stderr

    pruned = shell(mesh, proj, "meshrun jobs --prune")
    assert pruned.returncode == 0 and "journey-a" in pruned.stdout and "journey-b" in pruned.stdout, pruned.stdout
    for node in ("dc1-a", "dc2-a"):
        assert not (mesh.state_dir(mesh.world.node(node)) / "jobs" / "journey-b").exists()
        assert (work_dir(mesh, node, "resumable") / "checkpoints" / "last.pt").exists()  # the project stays
    removed = shell(mesh, proj, "meshrun jobs --prune-project resumable")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert not work_dir(mesh, "dc1-a", "resumable").exists()
