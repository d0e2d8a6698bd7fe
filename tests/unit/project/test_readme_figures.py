"""Every figure in README.md's Performance section (its headline rows and its plots, docs/figures/*.svg), in
benchmarks/README.md's full table and latest results, and in docs/diloco.md's DiLoCo tables comes from
benchmarks/results (benchmarks/readme_figures.py), and the Performance section stays short."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from support import REPO_ROOT

PERFORMANCE_MAX_LINES = 25
SVG = "{http://www.w3.org/2000/svg}"


def test_the_readmes_and_plots_are_what_the_results_say():
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


def _performance_section() -> list[str]:
    """README.md's lines from `## Performance` up to the next `## ` heading."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = lines.index("## Performance")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return lines[start:end]


def test_the_performance_section_is_short_and_points_at_the_rest():
    section = _performance_section()
    assert len(section) <= PERFORMANCE_MAX_LINES, f"{len(section)} lines"
    text = "\n".join(section)
    rf = _readme_figures()
    rows = [line for line in section if line.startswith("| ") and not line.startswith("| what ")]
    assert len(rows) == len(rf.HEADLINES)
    assert all(line.count(" | ") == 1 for line in rows), "two cells a row: what, result"
    assert all(f"](docs/figures/{name}.svg)" in text for name, _, _ in rf.FIGURES)
    assert "](benchmarks/README.md)" in text
    # the full table and the DiLoCo tables live elsewhere, not here
    assert rf.START not in text and rf.DILOCO_START not in (REPO_ROOT / "README.md").read_text()
    assert rf.START in (REPO_ROOT / "benchmarks" / "README.md").read_text()
    assert rf.DILOCO_START in (REPO_ROOT / "docs" / "diloco.md").read_text()


def test_every_row_of_the_full_table_is_in_benchmarks_readme():
    rf = _readme_figures()
    bench = (REPO_ROOT / "benchmarks" / "README.md").read_text()
    for name, row, script in rf.ROWS:
        d = rf._load(name)
        if d is not None:
            assert f"| {row(d)[0]} |" in bench and f"`.venv/bin/python {script}`" in bench, name


@pytest.mark.parametrize("name", [name for name, _, _ in _readme_figures().FIGURES])
def test_each_plot_is_svg_with_a_title_and_labels(name):
    root = ET.parse(REPO_ROOT / "docs" / "figures" / f"{name}.svg").getroot()
    assert root.tag == f"{SVG}svg"
    title = root.find(f"{SVG}title")
    assert title is not None and title.text and title.text.strip()
    texts = [t.text for t in root.iter(f"{SVG}text") if t.text and t.text.strip()]
    assert title.text in texts, "the title is drawn, not only named"
    assert len(texts) >= 5, "axis labels and tick labels"
    assert all(int(t.get("font-size")) >= 11 for t in root.iter(f"{SVG}text")), "readable text"


def test_the_plots_are_the_same_bytes_for_the_same_results():
    rf = _readme_figures()
    assert rf.figures() == rf.figures()


def test_the_check_fails_when_a_figure_is_edited_by_hand():
    readme_figures = _readme_figures()
    readme = (REPO_ROOT / "README.md").read_text()
    assert readme_figures.render(readme) == readme
    edited = readme.replace("of the link rate", "of the link rate (typed by hand: 0.99)", 1)
    assert edited != readme and readme_figures.render(edited) != edited
    bench = (REPO_ROOT / "benchmarks" / "README.md").read_text()
    assert readme_figures.render_bench(bench) == bench
    for typed in (("results/wan_efficiency.json", "results/wan_efficiency.json 0.99"), ("0.904 (", "0.99 (")):
        edited = bench.replace(*typed, 1)
        assert edited != bench and readme_figures.render_bench(edited) != edited
    docs = (REPO_ROOT / "docs" / "diloco.md").read_text()
    assert readme_figures.render_docs(docs) == docs


@pytest.fixture
def copied(tmp_path, monkeypatch):
    """readme_figures pointed at a copy of the repository's results, READMEs and plots under tmp_path (the
    real files are not touched)."""
    rf = _readme_figures()
    shutil.copytree(REPO_ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    shutil.copytree(REPO_ROOT / "docs" / "figures", tmp_path / "docs" / "figures")
    for rel in ("README.md", "benchmarks/README.md", "docs/diloco.md"):
        shutil.copy(REPO_ROOT / rel, tmp_path / rel)
    monkeypatch.setattr(rf, "ROOT", tmp_path)
    monkeypatch.setattr(rf, "RESULTS", tmp_path / "benchmarks" / "results")
    monkeypatch.setattr(rf, "ARCHIVE", tmp_path / "benchmarks" / "results" / "archive")
    monkeypatch.setattr(rf, "README", tmp_path / "README.md")
    monkeypatch.setattr(rf, "BENCH_README", tmp_path / "benchmarks" / "README.md")
    monkeypatch.setattr(rf, "DOCS_DILOCO", tmp_path / "docs" / "diloco.md")
    monkeypatch.setattr(rf, "FIGURES_DIR", tmp_path / "docs" / "figures")
    assert rf.main(["--check"]) == 0
    return rf, tmp_path


def test_a_changed_results_file_fails_the_check(copied, capsys):
    rf, root = copied
    path = root / "benchmarks" / "results" / "time_to_mesh.json"
    d = json.loads(path.read_text())
    d["rows"][-1]["seconds"]["median"] += 1.0  # 16 nodes a second slower
    path.write_text(json.dumps(d))
    assert rf.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "README.md" in err and "docs/figures/time_to_mesh.svg" in err
    assert {p.name for p in rf.stale()} >= {"README.md", "time_to_mesh.svg"}
    # writing brings every file back in line, and the plot then shows the new figure
    assert rf.main([]) == 0 and rf.main(["--check"]) == 0
    shown = (root / "docs" / "figures" / "time_to_mesh.svg").read_text()
    assert f">{d['rows'][-1]['seconds']['median']:.1f} s<" in shown


def test_a_plot_edited_or_missing_fails_the_check(copied):
    rf, root = copied
    svg = root / "docs" / "figures" / "coordinator_load.svg"
    svg.write_text(svg.read_text().replace("2.4%", "1.2%"))
    assert rf.main(["--check"]) == 1 and [p.name for p in rf.stale()] == ["coordinator_load.svg"]
    svg.unlink()
    assert rf.main(["--check"]) == 1 and [p.name for p in rf.stale()] == ["coordinator_load.svg"]


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
