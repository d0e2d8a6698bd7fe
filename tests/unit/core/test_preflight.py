"""meshrun.core.preflight: which differences between nodes stop a job and which only warn (pure)."""

from __future__ import annotations

import pytest

from meshrun.core import codeset, preflight
from meshrun.core.preflight import BLOCK, WARN, EnvReport, blocking, compare, table

GIB = 1 << 30


def node(name: str, **kw) -> EnvReport:
    base = dict(
        python="/opt/venv/bin/python",
        python_version="3.11.7",
        torch="2.13.0+cpu",
        gloo=True,
        gpus=0,
        free_bytes=50 * GIB,
        code_hash="c0de",
        clock_offset_s=0.01,
    )
    base.update(kw)
    return EnvReport(name, **base)


def cuda(name: str, **kw) -> EnvReport:
    return node(
        name,
        **{
            "torch": "2.13.0+cu128",
            "cuda": "12.8",
            "nccl": "2.27.3",
            "gpus": 8,
            "gpu_names": ["NVIDIA H100 80GB HBM3"] * 8,
            **kw,
        },
    )


def findings(*reports, code_hash="c0de", nproc_auto=True):
    return {(f.level, f.nodes, f.what.split(" ")[0]) for f in compare(list(reports), code_hash, nproc_auto)}


def test_identical_nodes_have_nothing_to_say():
    assert compare([node("a"), node("b"), node("c")], "c0de") == []
    assert compare([cuda("a"), cuda("b")], "c0de") == []


@pytest.mark.parametrize(
    "odd, words",
    [
        (node("c", torch="2.12.1+cpu"), "torch 2.12.1+cpu where the others have torch 2.13.x"),
        (node("c", torch=None), "torch is not installed for /opt/venv/bin/python"),
        (cuda("c", gpus=1, gpu_names=["x"]), "a CUDA 12.8 build of torch where the others have CPU"),
        (node("c", gloo=False), "torch has no gloo backend and no CUDA"),
        (node("c", code_hash="beef"), "its copy of the code differs from the coordinator's"),
        (node("c", free_bytes=5 << 20), "5 MiB free in the job directory"),
        (node("c", clock_offset_s=-400.0), "its clock is -400.0 s off the coordinator's"),
        (node("c", error="No such file or directory"), "the pre-flight probe failed with /opt/venv/bin/python"),
    ],
)
def test_what_breaks_a_job_blocks_it_naming_the_node(odd, words):
    found = compare([node("a"), node("b"), odd], "c0de")
    block = [f for f in found if f.level == BLOCK]
    assert blocking(found) and any(f.nodes == ("c",) and words in f.what for f in block), found
    assert all(f.fix for f in found)


def test_nccl_major_differs_blocks_minor_does_not():
    assert (BLOCK, ("c",), "NCCL") in findings(cuda("a"), cuda("b"), cuda("c", nccl="3.0.1"))
    assert not blocking(compare([cuda("a"), cuda("b", nccl="2.21.5")], "c0de"))


def test_torch_patch_or_build_tag_within_a_minor_is_fine():
    assert compare([node("a"), node("b", torch="2.13.1+cpu")], "c0de") == []


@pytest.mark.parametrize(
    "reports, words",
    [
        ([cuda("a"), cuda("b", gpu_names=["NVIDIA A100-SXM4-80GB"] * 8)], "GPU models differ"),
        ([cuda("a"), cuda("b", gpus=4, gpu_names=["NVIDIA H100 80GB HBM3"] * 4)], "GPU counts differ (a: 8, b: 4)"),
        ([node("a"), node("b", python_version="3.11.9")], "Python 3.11.9 where the others run 3.11.7"),
        ([node("a"), node("b", free_bytes=GIB // 2)], "only 512 MiB free in the job directory"),
        ([node("a"), node("b", clock_offset_s=12.0)], "its clock is +12.0 s off"),
        (
            [node("a"), cuda("b", gpus=0, gpu_names=[]), cuda("c", gpus=0, gpu_names=[])],
            "a CUDA build of torch but no GPU",
        ),
    ],
)
def test_what_only_costs_speed_warns(reports, words):
    found = compare(reports, "c0de")
    assert any(f.level == WARN and words in f.what for f in found), found


def test_gpu_counts_matter_only_when_workers_follow_them():
    counts = [cuda("a"), cuda("b", gpus=4, gpu_names=["NVIDIA H100 80GB HBM3"] * 4)]
    assert any("GPU counts" in f.what for f in compare(counts, "c0de", nproc_auto=True))
    assert not any("GPU counts" in f.what for f in compare(counts, "c0de", nproc_auto=False))


def test_without_a_reference_copy_the_odd_node_out_is_named():
    found = compare([node("a"), node("b"), node("c", code_hash="beef")], code_hash=None)
    assert [f.nodes for f in found if f.level == BLOCK] == [("c",)]


def test_the_table_lists_every_node_then_blocks_before_warnings():
    found = compare([node("a"), node("b", python_version="3.11.9"), node("c", torch="2.12.0+cpu")], "c0de")
    lines = table([node("a"), node("b", python_version="3.11.9"), node("c", torch="2.12.0+cpu")], found)
    assert lines[0].split() == ["NODE", "PYTHON", "TORCH", "BUILD", "NCCL", "GPUS", "FREE", "CODE", "CLOCK"]
    assert [line.split()[0] for line in lines[1:4]] == ["a", "b", "c"]
    assert lines[4].startswith("BLOCK c: torch 2.12.0+cpu") and lines[5].startswith("warn  b: Python 3.11.9")


def test_clock_offset_discounts_the_remote_s_work_from_the_round_trip():
    # a node 3 s ahead, 0.1 s of network each way, 20 s importing torch before it answered
    sent = 1000.0
    remote_time = sent + 0.1 + 20.0 + 3.0
    received = sent + 0.1 + 20.0 + 0.1
    assert preflight.clock_offset(sent, received, remote_time, remote_took=20.0) == pytest.approx(3.0)
    # without the work accounted for, the midpoint would be 10 s off: that was the bug
    assert abs(preflight.clock_offset(sent, received, remote_time) - 3.0) > 9
    # a remote that claims more work than the round trip cannot make the network negative
    assert preflight.clock_offset(sent, sent + 1.0, sent + 1.0, remote_took=5.0) == pytest.approx(0.0)


def _copy(files: dict[str, str], name: str) -> EnvReport:
    """A node whose --no-sync copy of the code holds `files` ({name: content hash})."""
    return node(name, code_hash=codeset.digest(files), code_files=files)


COORDINATOR = {"train.py": "aa" * 32, "model.py": "bb" * 32, "train.log": "cc" * 32, "nohup.out": "dd" * 32}


def test_files_only_the_coordinator_has_that_are_not_code_warn_naming_them():
    # `meshrun train --no-sync train.py > train.log`: the log exists only in the coordinator's copy
    nodes = {"train.py": "aa" * 32, "model.py": "bb" * 32}
    found = compare([_copy(nodes, "a"), _copy(nodes, "b")], codeset.digest(COORDINATOR), reference_files=COORDINATOR)
    assert not blocking(found), found
    assert [(f.level, f.nodes) for f in found] == [(WARN, ("a",)), (WARN, ("b",))]
    assert "nohup.out (missing), train.log (missing)" in found[0].what and found[0].fix


@pytest.mark.parametrize(
    "theirs, named",
    [
        ({"train.py": "ee" * 32, "model.py": "bb" * 32}, "train.log (missing), train.py"),  # code differs
        ({"train.py": "aa" * 32}, "model.py (missing)"),  # code missing
        ({"train.py": "aa" * 32, "model.py": "bb" * 32, "old.py": "ff" * 32}, "old.py (extra)"),  # code extra
    ],
)
def test_a_code_difference_blocks_naming_the_files(theirs, named):
    found = compare(
        [_copy(COORDINATOR, "a"), _copy(theirs, "b")], codeset.digest(COORDINATOR), reference_files=COORDINATOR
    )
    block = [f for f in found if f.level == BLOCK]
    assert [f.nodes for f in block] == [("b",)], found
    assert block[0].what.startswith("its copy of the code differs from the coordinator's: ") and named in block[0].what


def test_the_table_removes_escape_sequences_a_node_reported_and_keeps_its_columns():
    evil = "\x1b[2J\x1b]0;pwned\x07\x1b[1A\r"
    odd = node("b", torch=f"2.12.0+cpu{evil}", gpus=1, gpu_names=[f"H100{evil}"], error="")
    files = {f"x{evil}.py": "ee" * 32}
    odd.code_hash, odd.code_files = codeset.digest(files), files
    reference = {"train.py": "aa" * 32}
    lines = table([node("a"), odd], compare([node("a"), odd], codeset.digest(reference), reference_files=reference))
    assert not any(c in line for line in lines for c in "\x1b\x07\r"), lines
    # cleaned before measured: the columns line up
    assert lines[0].index("TORCH") == lines[1].index("2.13.0+cpu") == lines[2].index("2.12.0+cpu")
    assert lines[0].index("FREE") == lines[1].index("51200 MiB") == lines[2].index("51200 MiB")
    assert any(line.startswith("BLOCK b: its copy of the code differs") and "x.py (extra)" in line for line in lines)


# --------------------------------------------------------------------------- mixed accelerators
def rocm(name: str, **kw) -> EnvReport:
    return node(name, **{"torch": "2.13.0+rocm6.2", "hip": "6.2", "gpus": 8, "gpu_names": ["AMD MI300X"] * 8, **kw})


def test_a_job_declared_mixed_only_warns_when_builds_differ():
    reports = [node("a"), cuda("b"), rocm("c")]
    plain = compare(reports, "c0de", nproc_auto=False)
    assert blocking(plain)
    block = [f for f in plain if f.level == BLOCK]
    assert {f.nodes for f in block} == {("b",), ("c",)}
    assert all("--mixed-accelerators" in f.fix for f in block)  # the fix names the way out
    mixed = compare(reports, "c0de", nproc_auto=False, mixed_accelerators=True)
    assert not blocking(mixed), mixed
    warned = {f.nodes: f for f in mixed if "build of torch" in f.what}
    assert set(warned) == {("b",), ("c",)} and all(f.level == WARN for f in warned.values())
    assert "a CUDA 12.8 build of torch where the others have CPU: allowed" in warned[("b",)].what
    assert "gloo" in warned[("c",)].fix


def test_a_mixed_job_still_needs_one_torch_version_and_gloo_everywhere():
    version = compare([node("a"), node("b"), cuda("c", torch="2.12.0+cu128")], "c0de", mixed_accelerators=True)
    assert (BLOCK, ("c",)) in {(f.level, f.nodes) for f in version}
    no_gloo = compare([node("a"), cuda("b", gloo=False)], "c0de", nproc_auto=False, mixed_accelerators=True)
    block = [f for f in no_gloo if f.level == BLOCK]
    assert [f.nodes for f in block] == [("b",)] and block[0].what == "torch has no gloo backend"
    # a plain CUDA job does not need gloo on its GPU nodes
    assert not blocking(compare([cuda("a", gloo=False), cuda("b", gloo=False)], "c0de"))
