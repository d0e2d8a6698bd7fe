"""The test suite's cost per file, from a pytest junit file: ``python tools/suite_durations.py JUNIT.xml [--top N]``.

Prints one row per test file (tests, failures and errors, seconds summed over its tests' setup, call and
teardown, the slowest test), slowest first, then the totals. With two junit files (``--before OLD.xml``) each
row also shows the old seconds and the change, to judge a change to the suite against an earlier run.
Under pytest-xdist the seconds are each test's own, summed: two workers run two files at once, so the sum is
about twice the wall time.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def per_file(path: str) -> dict[str, dict]:
    """{test file: {"tests", "failed", "seconds", "slowest": (seconds, name)}} of a junit file."""
    files: dict[str, dict] = defaultdict(lambda: {"tests": 0, "failed": 0, "seconds": 0.0, "slowest": (0.0, "")})
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "")
        parts = cls.split(".")
        # classname is "tests.e2e.test_x" or "tests.e2e.test_x.TestClass": the file is the test_* part.
        idx = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        name = "/".join(parts[: idx + 1]) + ".py"
        row = files[name]
        secs = float(case.get("time") or 0)
        row["tests"] += 1
        row["seconds"] += secs
        if case.find("failure") is not None or case.find("error") is not None:
            row["failed"] += 1
        if secs > row["slowest"][0]:
            row["slowest"] = (secs, case.get("name", ""))
    return dict(files)


def table(now: dict[str, dict], before: dict[str, dict] | None = None, top: int | None = None) -> list[str]:
    rows = sorted(now.items(), key=lambda kv: -kv[1]["seconds"])
    head = f"{'file':<52} {'tests':>5} {'fail':>4} {'s':>8}"
    if before is not None:
        head += f" {'before':>8} {'change':>8}"
    lines = [head + "  slowest test"]
    for name, r in rows[:top] if top else rows:
        line = f"{name:<52} {r['tests']:>5} {r['failed']:>4} {r['seconds']:>8.1f}"
        if before is not None:
            old = before.get(name, {}).get("seconds")
            line += f" {old:>8.1f} {r['seconds'] - old:>+8.1f}" if old is not None else f" {'-':>8} {'new':>8}"
        lines.append(line + f"  {r['slowest'][0]:.0f}s {r['slowest'][1][:60]}")
    total = sum(r["seconds"] for r in now.values())
    tests = sum(r["tests"] for r in now.values())
    tail = f"{'total':<52} {tests:>5} {sum(r['failed'] for r in now.values()):>4} {total:>8.1f}"
    if before is not None:
        old_total = sum(r["seconds"] for r in before.values())
        tail += f" {old_total:>8.1f} {total - old_total:>+8.1f}"
        tail += f"   tests before: {sum(r['tests'] for r in before.values())}"
    lines.append(tail)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit")
    ap.add_argument("--before", help="an earlier run's junit file, to compare with")
    ap.add_argument("--top", type=int, help="only the N slowest files")
    args = ap.parse_args(argv)
    before = per_file(args.before) if args.before else None
    print("\n".join(table(per_file(args.junit), before, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
