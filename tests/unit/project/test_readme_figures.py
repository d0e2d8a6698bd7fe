"""Every figure in the README's Performance table and in benchmarks/README.md's latest results comes from
benchmarks/results (benchmarks/readme_figures.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import REPO_ROOT


def test_the_readme_table_is_what_the_results_say():
    res = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "readme_figures.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


def _readme_figures():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import readme_figures
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    return readme_figures


def test_the_check_fails_when_a_figure_is_edited_by_hand():
    readme_figures = _readme_figures()
    readme = (REPO_ROOT / "README.md").read_text()
    assert readme_figures.render(readme) == readme
    edited = readme.replace("of the link rate", "of the link rate (typed by hand: 0.99)", 1)
    assert edited != readme and readme_figures.render(edited) != edited
    bench = (REPO_ROOT / "benchmarks" / "README.md").read_text()
    assert readme_figures.render_bench(bench) == bench
    edited = bench.replace("results/wan_efficiency.json", "results/wan_efficiency.json 0.99", 1)
    assert edited != bench and readme_figures.render_bench(edited) != edited


WG = {"backend": "wireguard-go", "package": "0.0.20231211-1~bpo12+1", "sha256": "ab" * 32}


@pytest.fixture
def results(tmp_path, monkeypatch):
    """readme_figures pointed at an empty results directory (and its archive) under tmp_path."""
    rf = _readme_figures()
    monkeypatch.setattr(rf, "ROOT", tmp_path)
    monkeypatch.setattr(rf, "RESULTS", tmp_path / "benchmarks" / "results")
    monkeypatch.setattr(rf, "ARCHIVE", tmp_path / "benchmarks" / "results" / "archive")
    rf.ARCHIVE.mkdir(parents=True)

    def write(name: str, environment: dict, rounds: int | None = 3, archived: bool = False) -> None:
        d = {"summary": f"{name} summary", "environment": environment}
        if rounds is not None:
            d["rounds"] = rounds
        ((rf.ARCHIVE if archived else rf.RESULTS) / name).write_text(json.dumps(d))

    return rf, write


@pytest.mark.parametrize(
    "environment, rounds, field",
    [
        ({"wireguard": {**WG, "package": None}}, 3, "environment.wireguard.package"),
        ({"wireguard": {k: v for k, v in WG.items() if k != "sha256"}}, 3, "environment.wireguard.sha256"),
        ({"wireguard_go": "wireguard-go v0.0.20230223"}, 3, "environment.wireguard.package"),
        ({"wireguard": WG}, 2, "rounds is 2, fewer than 3"),
        ({"wireguard": WG}, None, "rounds is missing"),
    ],
)
def test_a_current_file_without_its_binary_or_rounds_is_refused(results, environment, rounds, field):
    rf, write = results
    write("new_bench.json", environment, rounds)
    with pytest.raises(rf.ResultsError) as exc:
        rf.results_list()
    assert str(exc.value).startswith("benchmarks/results/" + "new_bench.json: ") and field in str(exc.value)


def test_archived_and_smoke_files_are_not_refused(results):
    rf, write = results
    old = {"wireguard_go": "wireguard-go v0.0.20220316"}
    write("good.json", {"wireguard": WG})
    write("wan_tuning.json", old, archived=True)
    write("smoke_time_to_mesh.json", old, rounds=1)
    listed = rf.results_list()
    current, archived = listed.split("### Archived", 1)
    assert "`results/good.json`" in current
    assert "smoke_" not in listed
    assert "`results/archive/wan_tuning.json` (wireguard-go v0.0.20220316" in archived
    assert "historical, not current figures" in archived


def test_rounds_are_read_where_each_benchmark_keeps_them():
    rf = _readme_figures()
    assert rf._rounds({"rounds": 5}) == 5
    assert rf._rounds({"config": {"rounds": 2}}) == 2  # diloco_wan
    assert rf._rounds({"sizes": [{"rounds": 3}, {"rounds": 4}]}) == 3  # coordinator_load, per size
    assert rf._rounds({"sizes": [{"rounds": 3}, {}]}) is None
