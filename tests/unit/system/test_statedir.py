"""meshrun.system.files.statedir: state directory files (atomic, private) and the coordinator's SQLite DB."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from meshrun.errors import StateError
from meshrun.system.files.statedir import StateDir, default_state_dir

CIDR = "10.213.0.0/16"
SECRET = b"s" * 32
NOW = 1_700_000_000.0
FIX_NEW = "ask the coordinator's operator for a new token (`meshrun token create`)"
UNKNOWN = "the coordinator does not know this join token (wrong network, or deleted); " + FIX_NEW


def key(i: int) -> str:
    """A distinct, well-formed public key per i (these tests never need the private half)."""
    import base64

    return base64.b64encode(i.to_bytes(4, "big") * 8).decode()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# --------------------------------------------------------------------------- StateDir


class TestStateDir:
    def test_create_is_0700_and_reports_creation(self, tmp_path):
        old = os.umask(0o022)
        try:
            sd = StateDir(tmp_path / "a" / "state")
            assert sd.create() is True
            assert mode(sd.path) == 0o700
            os.chmod(sd.path, 0o755)
            assert sd.create() is False
            assert mode(sd.path) == 0o700
        finally:
            os.umask(old)

    def test_create_failure_names_the_path(self, tmp_path):
        (tmp_path / "file").write_text("x")
        sd = StateDir(tmp_path / "file" / "state")
        with pytest.raises(StateError) as info:
            sd.create()
        assert str(info.value) == (
            f"cannot create state directory {tmp_path}/file/state: Not a directory; "
            "pick a writable place with --state-dir or MESHRUN_STATE_DIR"
        )

    def test_path_is_absolute(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        assert StateDir("rel").path == tmp_path / "rel"
        assert StateDir("rel") / "member.json" == tmp_path / "rel" / "member.json"

    def test_exists_means_member_json(self, tmp_path):
        sd = StateDir(tmp_path)
        assert not sd.exists
        sd.write_json("member.json", {"role": "node"})
        assert sd.exists

    def test_file_modes(self, tmp_path):
        old = os.umask(0o077)
        try:
            sd = StateDir(tmp_path)
            assert mode(sd.write("private.key", "k\n", secret=True)) == 0o600
            assert mode(sd.write("member.json", b"{}")) == 0o644
            # Replacing a public file with a secret one must tighten it, and the reverse.
            assert mode(sd.write("member.json", "{}", secret=True)) == 0o600
        finally:
            os.umask(old)

    def test_write_and_read(self, tmp_path):
        sd = StateDir(tmp_path)
        sd.write_json("x.json", {"b": 1, "a": [1, 2]})
        assert (tmp_path / "x.json").read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
        assert sd.read_json("x.json") == {"a": [1, 2], "b": 1}
        assert sd.read("x.json").startswith(b"{")

    def test_failed_write_keeps_old_content_and_leaves_no_temp(self, tmp_path, monkeypatch):
        sd = StateDir(tmp_path)
        sd.write("private.key", "old\n", secret=True)

        def full_disk(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", full_disk)
        with pytest.raises(StateError) as info:
            sd.write("private.key", "new\n", secret=True)
        assert str(info.value) == (
            f"cannot write {tmp_path}/private.key: No space left on device; the previous "
            "version is unchanged; free disk space or fix permissions, then run the "
            "command again"
        )
        assert (tmp_path / "private.key").read_text() == "old\n"
        assert sorted(os.listdir(tmp_path)) == ["private.key"]

    def test_failed_rename_leaves_no_temp(self, tmp_path, monkeypatch):
        sd = StateDir(tmp_path)
        sd.write("a.json", "{}")

        def deny(src, dst):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        monkeypatch.setattr(os, "replace", deny)
        with pytest.raises(StateError, match=r"cannot write .*/a\.json: Permission denied"):
            sd.write("a.json", '{"x": 1}')
        assert (tmp_path / "a.json").read_text() == "{}"
        assert os.listdir(tmp_path) == ["a.json"]

    def test_read_missing(self, tmp_path):
        with pytest.raises(StateError) as info:
            StateDir(tmp_path).read("member.json")
        assert str(info.value) == (
            f"{tmp_path}/member.json is missing; run `meshrun init` or `meshrun join` "
            "first, or point --state-dir at the right place"
        )

    @pytest.mark.parametrize("content", [b'{"role": "no', b"", b"\xff\xfe", b"[1, 2]", b"null", b"{}garbage"])
    def test_read_json_corrupt(self, tmp_path, content):
        (tmp_path / "member.json").write_bytes(content)
        with pytest.raises(StateError) as info:
            StateDir(tmp_path).read_json("member.json")
        msg = str(info.value)
        assert msg.startswith(f"{tmp_path}/member.json is corrupt (")
        assert msg.endswith("); restore it from a backup, or remove the state directory and join again")
        assert "\n" not in msg
        assert (tmp_path / "member.json").read_bytes() == content  # never reset

    def test_read_json_not_object_message(self, tmp_path):
        (tmp_path / "peers.json").write_text("[]")
        with pytest.raises(StateError, match=r"peers\.json is corrupt \(not an object\)"):
            StateDir(tmp_path).read_json("peers.json")

    def test_remove_ignores_missing(self, tmp_path):
        sd = StateDir(tmp_path)
        sd.write("a", "1")
        sd.remove("a", "b")
        assert os.listdir(tmp_path) == []

    def test_default_state_dir(self, monkeypatch, tmp_path):
        monkeypatch.setenv("MESHRUN_STATE_DIR", str(tmp_path / "s"))
        assert default_state_dir() == tmp_path / "s"
        monkeypatch.delenv("MESHRUN_STATE_DIR")
        monkeypatch.setattr(os, "geteuid", lambda: 0)
        assert str(default_state_dir()) == "/var/lib/meshrun"
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
        assert default_state_dir() == tmp_path / "xdg" / "meshrun"


def test_disk_use_counts_regular_files_only_and_stops_at_its_bound(tmp_path):
    from meshrun.system.files.statedir import disk_use

    assert disk_use(tmp_path / "missing") == (0, 0)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "a.pt").write_bytes(b"x" * 1000)
    (tmp_path / "log").write_bytes(b"y" * 24)
    (tmp_path / "link").symlink_to("/etc/passwd")  # a link is not followed, nor counted
    assert disk_use(tmp_path) == (1024, 2)
    for i in range(50):
        (tmp_path / "ckpt" / f"{i}.pt").write_bytes(b"z")
    used, files = disk_use(tmp_path, max_entries=10)
    assert files <= 10  # cut short: a dataset with millions of files is not walked to the end
