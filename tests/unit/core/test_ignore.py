"""meshrun.core.ignore: gitignore patterns, checked against git itself on the same trees and patterns."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrun.core import ignore
from meshrun.system.files import archive

FILES = [
    "a.py",
    "b.log",
    "data/x.bin",
    "data/sub/y.bin",
    "src/a.py",
    "src/deep/a.py",
    "src/deep/c.txt",
    "logs/run1/events",
    "build/out.o",
    "docs/#note.md",
    "docs/!bang.md",
    "doc s/sp ace.txt",
    "x/a/b/c.py",
    "foo",
    "foo.bar/baz",
    "[x].txt",
    "tmp/keep.me",
    "tmp/other",
]
PATTERNS = [
    "*.log",
    "data/",
    "/a.py",
    "src/**/a.py",
    "**/deep",
    "deep/",
    "logs/**",
    "!logs/run1/events",
    "*.o",
    "\\#note.md",
    "\\!bang.md",
    "doc s/",
    "x/**/c.py",
    "foo",
    "foo/",
    "*.bar/",
    "[x].txt",
    "[!a]*.py",
    "tmp/*",
    "!tmp/keep.me",
    "a?py",
    "**/c.txt",
    "src/",
    "!src/deep/",
    "b.log ",
    "/doc*",
    "*",
]


def test_the_basic_rules():
    m = ignore.Matcher()
    m.add(ignore.parse("# comment\n\n*.log\n!keep.log\nbuild/\n/top.py\ndocs/**/draft.md\n"))
    assert m.ignored("x.log") and m.ignored("a/b/x.log") and not m.ignored("keep.log")
    assert m.ignored("build", is_dir=True) and not m.ignored("build")  # build/ matches directories only
    assert m.ignored("top.py") and not m.ignored("sub/top.py")  # a slash anchors
    assert m.ignored("docs/draft.md") and m.ignored("docs/a/b/draft.md")
    assert not m.ignored("train.py")


def test_a_deeper_file_wins_and_applies_below_its_own_directory_only():
    m = ignore.Matcher()
    m.add(ignore.parse("*.py\n"))
    m.add(ignore.parse("!keep.py\n", base="src"))
    assert m.ignored("keep.py") and not m.ignored("src/keep.py") and m.ignored("src/other.py")


def test_blank_comment_and_escaped_lines():
    assert ignore.compile_pattern("   ") is None and ignore.compile_pattern("# x") is None
    assert ignore.compile_pattern("\\#x").regex.match("#x")
    assert ignore.compile_pattern("a\\ ").regex.match("a ")  # an escaped trailing space stays


def _tree(root: Path) -> None:
    for rel in FILES:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(top=st.lists(st.sampled_from(PATTERNS), max_size=5), nested=st.lists(st.sampled_from(PATTERNS), max_size=3))
def test_meshrun_ships_what_git_would_track(tmp_path_factory, top, nested):
    """The same tree and ignore files: meshrun's own reading of them (no git) ships exactly what
    `git ls-files --others --exclude-standard` lists."""
    root = tmp_path_factory.mktemp("proj")
    _tree(root)
    (root / ".gitignore").write_text("\n".join(top) + "\n")
    (root / "src" / ".gitignore").write_text("\n".join(nested) + "\n")
    subprocess.run(["git", "-C", str(root), "init", "-q"], check=True)
    with_git = archive.select_files(root).names
    without = archive.select_files(root, use_git=False).names
    assert without == with_git, (top, nested)
