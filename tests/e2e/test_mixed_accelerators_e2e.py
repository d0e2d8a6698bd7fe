"""Mixed accelerators in the namespace world: a DiLoCo job declared `--mixed-accelerators` runs on a CPU-only node
and a node whose torch is a CUDA build, with a warning, and ends bit-identical; a DDP job on the same nodes is
still refused.

dc3-a's agent runs under another Python environment in which torch reports a CUDA 12.8 build (as
tests/e2e/test_preflight_e2e.py emulates a node's environment with a separate venv): the venv sees the
checkout's torch and meshrun, and a path hook sets ``torch.version.cuda`` once torch is imported, so the
pre-flight probe, which reads the build from the job's own interpreter, reports "CUDA 12.8". There is no GPU
behind it, so the worker trains on its CPU; what is under test is the pre-flight's decision and that the job's
workers agree on gloo (MESHRUN_MIXED_ACCELERATORS) and end on the same model.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from support import REPO_ROOT, hang_guard, joined_mesh

EXAMPLES = REPO_ROOT / "examples"
FAKE_BUILD = '''"""Test double: torch here reports a CUDA 12.8 build (tests/e2e/test_mixed_accelerators_e2e.py)."""
import importlib.abc
import importlib.machinery
import sys


class _FakeCudaBuild(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.version.cuda = "12.8"

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _FakeCudaBuild())
'''
SCRIPT_ARGS = ("--steps", "8", "--hidden", "32", "--batch-size", "4", "--seq-len", "16", "--val-batches", "1")
SCRIPT_ARGS += ("--threads", "1")


@pytest.fixture(scope="module")
def cuda_build_python(tmp_path_factory) -> Path:
    """An interpreter whose torch says it is a CUDA 12.8 build: a venv over the checkout's packages."""
    where = tmp_path_factory.mktemp("fake-cuda-venv")
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    py = where / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "meshrun_fake_cuda_build.py").write_text(FAKE_BUILD)
    ours = sysconfig.get_paths()["purelib"]  # the checkout's venv: torch, meshrun (editable) and the rest
    (site / "zz_meshrun_fake_cuda_build.pth").write_text(
        f"import site; site.addsitedir({ours!r}); import meshrun_fake_cuda_build\n"
    )
    probe = subprocess.run(
        [str(py), "-c", "import torch, meshrun; print(torch.version.cuda, torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.split() == ["12.8", "False"], probe.stdout + probe.stderr
    return py


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with joined_mesh(tmp_path_factory, 3, "dc1-a", ("dc2-a", "dc3-a")) as m:
        yield m


def _train(mesh, *args: str):
    return mesh.meshrun(mesh.coordinator, "train", "--timeout", "60", *args, cwd=EXAMPLES, check=False, timeout=150)


def test_a_diloco_job_mixes_builds_with_a_warning_and_a_ddp_job_is_still_refused(mesh, cuda_build_python):
    t0 = time.monotonic()
    dc3 = mesh.world.node("dc3-a")
    # dc3-a's agent, and so its jobs, under the environment whose torch is a CUDA build
    mesh.meshrun(dc3, "leave")
    dc3.run(str(cuda_build_python), "-m", "meshrun", "up", env={"MESHRUN_STATE_DIR": str(mesh.state_dir(dc3))})
    try:
        res = _train(
            mesh,
            "--mixed-accelerators",
            "--compression",
            "high",
            "--env",
            "MESHRUN_DILOCO_SYNC_EVERY=4",  # the user's value wins over the preset's H = 20
            "diloco_charlm.py",
            *SCRIPT_ARGS,
        )
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-4000:]
        warns = re.findall(
            r"^meshrun: warn  (dc\d-a): (a .+? build of torch where the others have .*)$", res.stderr, re.M
        )
        assert len(warns) == 1 and "allowed, the job declared --mixed-accelerators" in warns[0][1], res.stderr
        assert re.search(r"^meshrun: dc3-a +3\.\d+\.\d+ +2\.\d+\.\d+\S* +CUDA 12\.8", res.stderr, re.M), res.stderr
        assert "warning(s), the job goes on" in res.stderr
        # the preset was printed at submission and at the job's start, and reached the DiLoCo helper
        assert "meshrun: compression high: DiLoCo H=20, sparse-int2" in res.stderr
        start = re.search(r"\] start mode=diloco world_size=2 .*$", res.stdout, re.M)
        assert start and "sync_every=4 compression=sparse-int2" in start.group(0) and "preset=high" in start.group(0)
        # with SparseLoCo's outer step, which the preset carries too
        assert "outer_lr=1 outer_momentum=0 error_decay=0.95 " in start.group(0), start.group(0)
        # both workers end on the same global model (the state check compared every sync on the way)
        sums = dict(re.findall(r"param_checksum rank=(\d) sync=\d+ digest=([0-9a-f]{16})", res.stdout))
        assert set(sums) == {"0", "1"} and len(set(sums.values())) == 1, res.stdout[-3000:]
        final = re.search(r"final val_loss=([\d.]+) bytes_sent=(\d+) .*\bsyncs=2\b", res.stdout)
        assert final and int(final.group(2)) > 0, res.stdout[-3000:]

        # the same nodes, a plain DDP job: refused before anything starts
        t1 = time.monotonic()
        ddp = _train(mesh, "diloco_charlm.py", "--mode", "ddp", *SCRIPT_ARGS)
        assert ddp.returncode != 0 and time.monotonic() - t1 < hang_guard(10), ddp.stdout + ddp.stderr  # pre-flight
        blocks = re.findall(r"^meshrun: BLOCK (dc\d-a): (.*)$", ddp.stderr, re.M)
        assert len(blocks) == 1 and "build of torch where the others have" in blocks[0][1], ddp.stderr
        assert "declare it with --mixed-accelerators" in blocks[0][1]
        assert "final val_loss" not in ddp.stdout
    finally:
        mesh.meshrun(dc3, "leave", check=False)
        mesh.meshrun(dc3, "up", check=False)
    assert time.monotonic() - t0 < hang_guard(40)
