"""meshrun.system.files.archive: what a project ships (git, .meshrunignore), packing it as read once, laying it
over a node's persistent project directory, pulling files back; unsafe archives refused."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from meshrun.core import codeset
from meshrun.errors import LaunchError, UsageError
from meshrun.system.files import archive

HAVE_GIT = shutil.which("git") is not None


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


def _project(root: Path) -> Path:
    """A user's project: code, a sibling module, a cache, a data directory, a log and a checkpoint."""
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("import pkg.m\nprint(1)\n")
    (root / "pkg" / "m.py").write_text("x = 1\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "t.pyc").write_bytes(b"\0")
    (root / "data").mkdir()
    (root / "data" / "shard0.bin").write_bytes(b"\1" * 300_000)
    (root / "train.log").write_text("epoch 1\n")
    return root


def git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(root), *args],
        check=True,
        capture_output=True,
        env={
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
            "HOME": str(root),
        },
    )


def test_a_plain_directory_ships_everything_but_caches_and_what_meshrunignore_names(tmp_path):
    root = _project(tmp_path / "proj")
    sel = archive.select_files(root)
    assert sel.names == ["data/shard0.bin", "pkg/m.py", "train.log", "train.py"]
    (root / ".meshrunignore").write_text("# data stays here\ndata/\n*.log\n")
    sel = archive.select_files(root)
    assert sel.names == [".meshrunignore", "pkg/m.py", "train.py"]
    assert [(e.name, e.bytes, e.is_dir) for e in sel.ignored] == [("data", 300_000, True), ("train.log", 8, False)]
    assert "no git work tree and .meshrunignore" in sel.rules


def test_state_directories_and_symlinks_are_never_shipped(tmp_path):
    root = _project(tmp_path / "proj")
    state = root / "mesh-state"  # a user put --state-dir inside the project
    state.mkdir()
    (state / "member.json").write_text("{}")
    (state / "private.key").write_text("secret")
    other = root / "old-node"  # another member's state, not the one in use
    other.mkdir()
    (other / "member.json").write_text("{}")
    (other / "private.key").write_text("secret")
    (root / "link.py").symlink_to(root / "train.py")
    (root / "linkdir").symlink_to(root / "pkg")
    sel = archive.select_files(root, exclude=[state])
    assert not any(n.startswith(("mesh-state", "old-node", "link")) for n in sel.names)
    assert sorted(sel.links) == ["link.py", "linkdir"]


@pytest.mark.skipif(not HAVE_GIT, reason="git is not installed")
def test_a_git_work_tree_ships_what_git_would_track(tmp_path):
    root = _project(tmp_path / "proj")
    (root / ".gitignore").write_text("data/\n*.log\n")
    (root / "pkg" / ".gitignore").write_text("secret_*.py\n")
    (root / "pkg" / "secret_x.py").write_text("k = 1\n")
    git(root, "init", "-q")
    (root / "forced.log").write_text("tracked although ignored\n")
    git(root, "add", "-f", "forced.log")
    (root / "untracked.py").write_text("new = 1\n")  # not committed, not ignored: shipped (git would track it)
    sel = archive.select_files(root)
    assert sel.names == [".gitignore", "forced.log", "pkg/.gitignore", "pkg/m.py", "train.py", "untracked.py"]
    ignored = {e.name: e for e in sel.ignored}
    assert ignored["data"].bytes == 300_000 and ignored["data"].is_dir
    assert "train.log" in ignored and "pkg/secret_x.py" in ignored
    assert sel.rules == "git's ignore rules"
    (root / ".meshrunignore").write_text("untracked.py\n")
    assert "untracked.py" not in archive.select_files(root).names


@pytest.mark.skipif(not HAVE_GIT, reason="git is not installed")
def test_the_dry_run_summary_names_an_ignored_200_mb_directory(tmp_path):
    root = _project(tmp_path / "proj")
    (root / ".gitignore").write_text("data/\n")
    with open(root / "data" / "big.bin", "wb") as f:  # sparse: 200 MB listed, nothing written
        f.truncate(200 * 1000 * 1000)
    git(root, "init", "-q")
    lines = archive.select_files(root).summary(50)
    assert lines[0].startswith("ships 4 file(s)") and "--sync-limit 50 MiB" in lines[0]
    assert any(line.startswith("not shipped: data/ 191.0 MiB (2 files)") for line in lines), lines


@pytest.mark.skipif(not HAVE_GIT, reason="git is not installed")
def test_submodules_and_nested_repositories_ship_with_their_own_ignore_rules(tmp_path):
    lib = tmp_path / "lib"  # a library the project vendors as a submodule
    lib.mkdir()
    (lib / "util.py").write_text("def f():\n    return 1\n")
    (lib / ".gitignore").write_text("*.bin\n")
    git(lib, "init", "-q")
    git(lib, "add", ".")
    git(lib, "commit", "-qm", "lib")
    root = _project(tmp_path / "proj")
    (root / ".gitignore").write_text("data/\n*.log\n")
    git(root, "init", "-q")
    git(root, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "vendor/lib")
    (root / "vendor" / "lib" / "weights.bin").write_bytes(b"\0" * 10)  # ignored by the submodule's .gitignore
    (root / "vendor" / "lib" / "new.py").write_text("n = 1\n")  # untracked there: shipped, as at the top
    nested = root / "tools"  # a repository cloned into the project, not registered as a submodule
    nested.mkdir()
    (nested / "fetch.py").write_text("t = 1\n")
    git(nested, "init", "-q")
    sel = archive.select_files(root)
    assert sel.names == [
        ".gitignore",
        ".gitmodules",
        "pkg/m.py",
        "tools/fetch.py",
        "train.py",
        "vendor/lib/.gitignore",
        "vendor/lib/new.py",
        "vendor/lib/util.py",
    ]
    assert "vendor/lib/weights.bin" in {e.name for e in sel.ignored}
    assert archive.select_files(root, use_git=False).names == sel.names  # the same without a git binary


@pytest.mark.parametrize("use_git", [True, False])
def test_files_pulled_back_into_the_project_are_never_shipped_and_say_so(tmp_path, use_git):
    if use_git and not HAVE_GIT:
        pytest.skip("git is not installed")
    root = _project(tmp_path / "proj")
    if use_git:
        git(root, "init", "-q")
    pulled = root / archive.PULLED_DIR / "job-1" / "gpu-a" / "checkpoints"
    pulled.mkdir(parents=True)
    (pulled / "last.pt").write_bytes(b"\0" * 1000)
    (root / "pkg" / archive.PULLED_DIR).mkdir()  # only the project's own is meshrun's
    (root / "pkg" / archive.PULLED_DIR / "x.py").write_text("x = 2\n")
    sel = archive.select_files(root, use_git=use_git)
    assert not any(n.startswith(archive.PULLED_DIR) for n in sel.names)
    assert "pkg/meshrun-pulled/x.py" in sel.names
    assert any(
        line.startswith("not shipped: ") and "meshrun-pulled/ 1000 B (1 files)" in line for line in sel.summary()
    )


def test_pack_hashes_exactly_the_bytes_it_packs_and_unpack_reproduces_them(tmp_path):
    root = _project(tmp_path / "proj")
    sel = archive.select_files(root)
    packed = archive.pack(sel, 1)
    with tarfile.open(fileobj=io.BytesIO(packed.blob)) as tar:
        names = sorted(m.name for m in tar.getmembers())
    assert names == sel.names
    dst = tmp_path / "work"
    assert archive.unpack_into(packed.blob, dst) == sel.names
    assert archive.hash_files(dst, sel.names) == packed.manifest
    assert packed.digest == codeset.digest(packed.manifest)


def test_a_file_growing_after_the_listing_is_packed_as_listed(tmp_path):
    """The log the user's shell writes into the project (`> train.log`): its bytes at listing time go, and the
    manifest describes exactly those bytes (the pre-flight compares what was shipped)."""
    root = _project(tmp_path / "proj")
    sel = archive.select_files(root)
    with open(root / "train.log", "a") as f:
        f.write("epoch 2\n" * 1000)
    packed = archive.pack(sel, 1)
    dst = tmp_path / "work"
    archive.unpack_into(packed.blob, dst)
    assert (dst / "train.log").read_text() == "epoch 1\n"
    assert archive.hash_files(dst, sel.names) == packed.manifest


def test_a_file_swapped_for_a_link_after_the_listing_is_not_followed(tmp_path):
    root = _project(tmp_path / "proj")
    secret = tmp_path / "outside.txt"
    secret.write_text("not part of the project\n")
    sel = archive.select_files(root)
    (root / "train.log").unlink()
    (root / "train.log").symlink_to(secret)
    shutil.rmtree(root / "pkg")
    (root / "pkg").symlink_to(tmp_path)  # a directory component swapped too
    (tmp_path / "m.py").write_text("leak = 1\n")
    packed = archive.pack(sel, 1)
    assert sorted(packed.manifest) == ["data/shard0.bin", "train.py"]


def test_over_the_limit_the_error_names_the_largest_entries_and_the_fixes(tmp_path):
    root = _project(tmp_path / "proj")
    (root / "data" / "shard1.bin").write_bytes(b"\2" * (2 << 20))
    with pytest.raises(LaunchError) as err:
        archive.pack(archive.select_files(root), 1)
    msg = str(err.value)
    assert "over --sync-limit 1 MiB" in msg and "largest: data/ 2.3 MiB (2 files)" in msg
    assert ".meshrunignore" in msg and "--no-sync" in msg


def test_a_shipment_lands_on_a_persistent_directory_and_keeps_what_the_job_wrote(tmp_path):
    root = _project(tmp_path / "proj")
    work = tmp_path / "work"
    first = archive.unpack_into(archive.pack(archive.select_files(root), 1).blob, work)
    (work / "checkpoint.pt").write_bytes(b"ckpt")  # written by the job
    (work / "runs").mkdir()
    (work / "runs" / "events").write_text("e")
    (root / "pkg" / "m.py").unlink()  # dropped from the project
    (root / "train.py").write_text("print(2)\n")
    second = archive.unpack_into(archive.pack(archive.select_files(root), 1).blob, work, first)
    assert (work / "checkpoint.pt").read_bytes() == b"ckpt" and (work / "runs" / "events").exists()
    assert (work / "train.py").read_text() == "print(2)\n"
    assert not (work / "pkg").exists()  # its only file went, so did the directory
    assert "pkg/m.py" not in second
    assert not list(tmp_path.glob(".incoming-*"))


def test_a_link_the_job_left_is_replaced_not_followed(tmp_path):
    root = _project(tmp_path / "proj")
    work = tmp_path / "work"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work.mkdir()
    (work / "pkg").symlink_to(elsewhere)
    (work / "train.py").symlink_to(tmp_path / "victim.py")
    archive.unpack_into(archive.pack(archive.select_files(root), 1).blob, work)
    assert not (work / "pkg").is_symlink() and (work / "pkg" / "m.py").is_file()
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "victim.py").exists()


def test_a_shipped_file_does_not_replace_a_directory_the_job_made(tmp_path):
    root = _project(tmp_path / "proj")
    work = tmp_path / "work"
    (work / "train.log").mkdir(parents=True)
    with pytest.raises(UsageError, match="would replace the directory"):
        archive.unpack_into(archive.pack(archive.select_files(root), 1).blob, work)


def test_hash_files_gives_up_on_a_large_tree(tmp_path):
    (tmp_path / "a.py").write_text("print(1)\n")
    (tmp_path / "b.py").write_text("print(2)\n")
    first = archive.hash_files(tmp_path, ["a.py", "b.py"])
    assert first is not None and set(first) == {"a.py", "b.py"}
    assert archive.hash_files(tmp_path, ["a.py", "b.py"], max_files=1) is None
    assert archive.hash_files(tmp_path, ["a.py", "b.py"], max_bytes=10) is None
    assert archive.hash_files(tmp_path / "absent", ["a.py"]) is None


def test_pulling_a_path_is_bounded_and_stays_inside(tmp_path):
    work = tmp_path / "work"
    (work / "ckpt").mkdir(parents=True)
    (work / "ckpt" / "a.pt").write_bytes(b"a" * 100)
    (work / "ckpt" / "b.pt").write_bytes(b"b" * 100)
    (work / "ckpt" / "leak").symlink_to("/etc/passwd")
    blob, files = archive.pack_paths(work, "ckpt", 1000)
    assert files == 2
    out = tmp_path / "out"
    assert archive.unpack_pulled(blob, out) == ["ckpt/a.pt", "ckpt/b.pt"]
    assert (out / "ckpt" / "a.pt").read_bytes() == b"a" * 100
    with pytest.raises(UsageError, match="more than"):
        archive.pack_paths(work, "ckpt", 150)
    for bad in ("../work", "/etc/passwd", "ckpt/../../x"):
        with pytest.raises(UsageError, match="not inside"):
            archive.pack_paths(work, bad, 1000)
    with pytest.raises(UsageError, match="does not exist"):
        archive.pack_paths(work, "ckpt/leak", 1000)


def test_an_absolute_name_lands_inside_the_destination(tmp_path):
    archive.unpack_into(_tar(_info("/tmp/meshrun-evil-abs")), tmp_path / "dst")  # the "data" filter strips the /
    assert (tmp_path / "dst" / "tmp" / "meshrun-evil-abs").is_file()
    with pytest.raises(tarfile.TarError):  # the fallback refuses it
        archive._check_member(_info("/tmp/meshrun-evil-abs"))


@pytest.mark.parametrize(
    "member",
    [
        _info("a/../../up.py"),
        _info("..", tarfile.DIRTYPE),
        _info("l", tarfile.SYMTYPE, link="/etc/passwd"),
        _info("h", tarfile.LNKTYPE, link="/etc/passwd"),
        _info("d", tarfile.CHRTYPE),
    ],
)
def test_unpacking_refuses_escapes_links_and_devices(tmp_path, member):
    with pytest.raises(UsageError, match="cannot be unpacked"):
        archive.unpack_into(_tar(member), tmp_path / "dst")
    assert not list(tmp_path.glob(".incoming-*"))
    # the checks used where tarfile has no "data" filter (Python before 3.10.12 / 3.11.4) refuse the same
    with pytest.raises(tarfile.TarError):
        archive._check_member(member)


def test_the_fallback_checks_accept_plain_files_and_directories():
    archive._check_member(_info("pkg/m.py"))
    archive._check_member(_info("pkg", tarfile.DIRTYPE))


def test_a_bench_job_hashes_no_code_a_no_sync_script_job_its_directory(tmp_path):
    from meshrun.jobs import planning, submission

    (tmp_path / "train.py").write_text("print(1)\n")
    script = submission.job_spec({"script": "train.py", "no_sync": True, "job_id": "j-1"}, tmp_path)
    assert planning.coordinator_copy(script) == archive.hash_files(tmp_path, ["train.py"])
    bench = submission.job_spec(
        {"script": "meshrun.bench.worker", "no_sync": True, "module": True, "job_id": "bench-1"}, Path("/")
    )
    assert planning.coordinator_copy(bench) is None  # not a walk of "/"
