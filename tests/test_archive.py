"""meshrun.system.archive: shipping a job's code, and unpacking it safely (also without tarfile's filters)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from meshrun.errors import LaunchError, UsageError
from meshrun.system import archive


def _tar(*members: tarfile.TarInfo) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isfile() else None)
    return buf.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 1, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.size, m.linkname = kind, size if kind == tarfile.REGTYPE else 0, link
    return m


def test_pack_and_unpack_round_trip_leave_out_caches(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text("print(1)\n")
    (src / "pkg" / "m.py").write_text("x = 1\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "t.pyc").write_bytes(b"\0")
    assert archive.unpack_code(archive.pack_code(src, 1), tmp_path / "dst") == 3      # train.py, pkg, pkg/m.py
    assert (tmp_path / "dst" / "pkg" / "m.py").read_text() == "x = 1\n"
    assert not (tmp_path / "dst" / "__pycache__").exists()
    (src / "big").write_bytes(b"\0" * (2 << 20))
    with pytest.raises(LaunchError, match="more than 1 MiB"):
        archive.pack_code(src, 1)


def test_an_absolute_name_lands_inside_the_destination(tmp_path):
    archive.unpack_code(_tar(_info("/tmp/meshrun-evil-abs")), tmp_path / "dst")   # the "data" filter strips the /
    assert (tmp_path / "dst" / "tmp" / "meshrun-evil-abs").is_file()
    with pytest.raises(tarfile.TarError):                                          # the fallback refuses it
        archive._check_member(_info("/tmp/meshrun-evil-abs"))


@pytest.mark.parametrize("member", [_info("a/../../up.py"), _info("..", tarfile.DIRTYPE),
                                    _info("l", tarfile.SYMTYPE, link="/etc/passwd"),
                                    _info("h", tarfile.LNKTYPE, link="/etc/passwd"), _info("d", tarfile.CHRTYPE)])
def test_unpacking_refuses_escapes_links_and_devices(tmp_path, member):
    with pytest.raises(UsageError, match="cannot be unpacked"):
        archive.unpack_code(_tar(member), tmp_path / "dst")
    # the checks used where tarfile has no "data" filter (Python before 3.10.12 / 3.11.4) refuse the same
    with pytest.raises(tarfile.TarError):
        archive._check_member(member)


def test_the_fallback_checks_accept_plain_files_and_directories():
    archive._check_member(_info("pkg/m.py"))
    archive._check_member(_info("pkg", tarfile.DIRTYPE))


def test_tree_hash_follows_content_and_gives_up_on_a_large_tree(tmp_path):
    (tmp_path / "a.py").write_text("print(1)\n")
    (tmp_path / "b.py").write_text("print(2)\n")
    first = archive.tree_hash(tmp_path)
    assert first is not None and archive.tree_hash(tmp_path) == first
    (tmp_path / "b.py").write_text("print(3)\n")
    assert archive.tree_hash(tmp_path) not in (None, first)
    # A --no-sync directory with data in it: not read whole, not compared.
    assert archive.tree_hash(tmp_path, max_files=1) is None
    assert archive.tree_hash(tmp_path, max_bytes=10) is None
    assert archive.tree_hash(tmp_path / "absent") is None


def test_a_bench_job_hashes_no_code_a_no_sync_script_job_its_directory(tmp_path):
    from meshrun.jobs import runner, supervisor
    (tmp_path / "train.py").write_text("print(1)\n")
    script = runner.TrainRequest(script="train.py", no_sync=True, job_id="j-1").spec(tmp_path)
    assert supervisor.expected_code_hash(script) == archive.tree_hash(tmp_path)
    bench = runner.TrainRequest(script="meshrun.bench.worker", no_sync=True, module=True,
                                job_id="bench-1").spec(Path("/"))
    assert supervisor.expected_code_hash(bench) is None      # not a walk of "/"
