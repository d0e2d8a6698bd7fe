"""Every figure in the README's Performance table and in benchmarks/README.md's latest results comes from
benchmarks/results (benchmarks/readme_figures.py)."""

from __future__ import annotations

import subprocess
import sys

from support import REPO_ROOT


def test_the_readme_table_is_what_the_results_say():
    res = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "readme_figures.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


def test_the_check_fails_when_a_figure_is_edited_by_hand(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import readme_figures
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    readme = (REPO_ROOT / "README.md").read_text()
    assert readme_figures.render(readme) == readme
    edited = readme.replace("of the link rate", "of the link rate (typed by hand: 0.99)", 1)
    assert edited != readme and readme_figures.render(edited) != edited
    bench = (REPO_ROOT / "benchmarks" / "README.md").read_text()
    assert readme_figures.render_bench(bench) == bench
    edited = bench.replace("results/wan_efficiency.json", "results/wan_efficiency.json 0.99", 1)
    assert edited != bench and readme_figures.render_bench(edited) != edited
