"""Pre-flight in the namespace world: a job with three real mismatches is refused at once, starting nothing.

- dc2-a sees another copy of the --no-sync code (a tmpfs mounted over the directory in its own mount
  namespace, with a different train.py);
- dc3-a's job directory is on a full tmpfs;
- dc4-a's agent runs under another Python environment (a Python 3.10 venv without torch): the job's
  interpreter there is that one, and the probe reads it from that interpreter.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import time
from pathlib import Path

import pytest
from support import hang_guard, joined_mesh

from meshrun.lab.mesh import Mesh

TRAIN = "import torch\nprint('training', torch.__version__)\n"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with joined_mesh(tmp_path_factory, 4, "dc1-a", ("dc2-a", "dc3-a", "dc4-a")) as m:
        yield m


def _procs_in(mesh: Mesh, name: str, needle: str) -> list[str]:
    pids = subprocess.run(
        ["ip", "netns", "pids", mesh.world.node(name).netns], capture_output=True, text=True
    ).stdout.split()
    out = []
    for pid in pids:
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in line:
            out.append(line)
    return out


def test_a_job_with_three_mismatched_nodes_is_refused_within_5_s_starting_nothing(mesh, torchless_venv):
    code = Path(f"/var/tmp/meshrun-preflight-{secrets.token_hex(3)}")
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    dc2, dc3, dc4 = (mesh.world.node(n) for n in ("dc2-a", "dc3-a", "dc4-a"))
    jobs3 = mesh.state_dir(dc3) / "jobs"
    jobs3.mkdir(exist_ok=True)
    try:
        # dc2-a: another copy of the code at the same path
        dc2.run("mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(code))
        dc2.run("sh", "-c", f"printf 'print(\"an older train.py\")\\n' > {code}/train.py")
        # dc3-a: its job directory on a full disk
        dc3.run("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(jobs3))
        dc3.run("sh", "-c", f"dd if=/dev/zero of={jobs3}/filler bs=64k 2>/dev/null; true")
        # dc4-a: its agent, and so its jobs, under another Python environment without torch
        mesh.meshrun(dc4, "leave")
        dc4.run(str(torchless_venv), "-m", "meshrun", "up", env={"MESHRUN_STATE_DIR": str(mesh.state_dir(dc4))})

        t0 = time.monotonic()
        res = mesh.meshrun(mesh.coordinator, "train", "--no-sync", "train.py", cwd=code, check=False, timeout=60)
        took = time.monotonic() - t0
        out = res.stdout + res.stderr
        # Refused by the pre-flight, before any node starts torch: 1-10 s seen (a cold first job on a loaded
        # machine the slowest; benchmarks/preflight_time.py measures it); a job that started would take its
        # rendezvous timeout, minutes.
        assert res.returncode != 0 and took < hang_guard(15), (res.returncode, took, out)
        blocks = dict(re.findall(r"^meshrun: BLOCK (dc\d-a): (.*)$", res.stderr, re.M))
        assert set(blocks) == {"dc2-a", "dc3-a", "dc4-a"}, out
        assert blocks["dc2-a"].startswith(
            "its copy of the code differs from the coordinator's: train.py; drop --no-sync"
        ), blocks["dc2-a"]
        assert re.match(r"\d+ MiB free in the job directory; free disk space on dc3-a", blocks["dc3-a"])
        assert blocks["dc4-a"].startswith(f"torch is not installed for {torchless_venv}")
        assert re.search(r"^meshrun: NODE +PYTHON +TORCH .*\nmeshrun: dc2-a +3\.11\.\d+ +2\.13\.0", res.stderr, re.M)
        assert re.search(r"^meshrun: dc4-a +3\.1\d\.\d+ +missing", res.stderr, re.M), res.stderr
        assert "pass --skip-preflight if you know better" in res.stderr
        # nothing started anywhere
        for n in ("dc2-a", "dc3-a", "dc4-a"):
            assert not _procs_in(mesh, n, "meshrun.jobs.agent") and not _procs_in(mesh, n, "meshrun.jobs.share")
        assert not list((mesh.state_dir(dc2) / "jobs").glob("*/share.json"))
        # --dry-run shows the same table
        dry = mesh.meshrun(mesh.coordinator, "train", "--no-sync", "--dry-run", "train.py", cwd=code, check=False)
        assert set(re.findall(r"^#   BLOCK (dc\d-a):", dry.stdout, re.M)) == {"dc2-a", "dc3-a", "dc4-a"}, dry.stdout
    finally:
        dc2.run("umount", str(code), check=False)
        dc3.run("umount", str(jobs3), check=False)
        mesh.meshrun(dc4, "leave", check=False)
        mesh.meshrun(dc4, "up", check=False)
        for f in code.iterdir():
            f.unlink()
        code.rmdir()
