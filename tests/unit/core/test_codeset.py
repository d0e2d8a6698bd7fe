"""meshrun.core.codeset: the code a job ships as a manifest, and what the pre-flight says when copies differ."""

from __future__ import annotations

import pytest

from meshrun.core import codeset

H1, H2 = "11" * 32, "22" * 32


def test_the_digest_depends_on_names_and_contents_not_on_order():
    a = {"train.py": H1, "model.py": H2}
    assert codeset.digest(a) == codeset.digest(dict(reversed(list(a.items()))))
    assert codeset.digest(a) != codeset.digest({"train.py": H2, "model.py": H1})
    assert codeset.digest(a) != codeset.digest({"train.py": H1})
    # a name boundary cannot be moved between the name and the hash
    assert codeset.digest({"a": H1}) != codeset.digest({"a\0": H1})


def test_differences_name_each_file_and_how_it_differs():
    ref = {"train.py": H1, "model.py": H1, "gone.py": H1}
    other = {"train.py": H1, "model.py": H2, "new.py": H1}
    diffs = codeset.differences(ref, other)
    assert diffs == ["gone.py (missing)", "model.py", "new.py (extra)"]
    assert codeset.describe_differences(diffs) == "gone.py (missing), model.py, new.py (extra)"
    many = [f"f{i}.py" for i in range(8)]
    assert codeset.describe_differences(many, first=5).endswith("f4.py and 3 more")
    assert codeset.describe_differences([]) == "no file differs"


def test_the_largest_entries_group_directories():
    files = [("data/a.bin", 300), ("data/b.bin", 300), ("train.py", 500), ("ckpt/x.pt", 50)]
    top = codeset.largest(files, n=2)
    assert [(e.name, e.bytes, e.files, e.is_dir) for e in top] == [("data", 600, 2, True), ("train.py", 500, 1, False)]
    assert top[0].describe() == "data/ 600 B (2 files)"


@pytest.mark.parametrize(
    "n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (200 << 20, "200.0 MiB"), (5 << 40, "5120.0 GiB")]
)
def test_human_bytes(n, text):
    assert codeset.human_bytes(n) == text


@pytest.mark.parametrize(
    "directory, name",
    [("myproject", "myproject"), ("my project!", "my-project-"), (".hidden", "hidden"), ("...", "project")],
)
def test_a_project_name_from_any_directory_name_is_valid(directory, name):
    assert codeset.project_name(directory) == name
    assert codeset.PROJECT_RE.match(codeset.project_name(directory))
    assert codeset.PROJECT_RE.match(codeset.project_name("x" * 200))
