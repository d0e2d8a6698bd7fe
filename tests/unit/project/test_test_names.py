"""Every test module has a name of its own: pytest imports them by basename (no packages under tests/),
and two files with one name stop the whole run at collection."""

from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]


def test_no_two_test_modules_share_a_name():
    names = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        names[path.name].append(str(path.relative_to(TESTS)))
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}
