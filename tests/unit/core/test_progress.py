"""meshrun.core.progress and meshrun.train.report: how far a job is, from rank 0's lines (pure)."""

from __future__ import annotations

import json

import pytest

from meshrun.core import progress
from meshrun.train import report


def test_a_report_line_gives_the_step_the_total_and_the_numbers():
    text = progress.line(120, 1000, loss=2.5, lr=0.001)
    assert progress.parse(text) == {"step": 120, "total": 1000, "numbers": {"loss": 2.5, "lr": 0.001}}
    assert progress.parse(progress.line(7)) == {"step": 7, "total": None, "numbers": {}}


@pytest.mark.parametrize(
    "body",
    ['{"step": -1}', '{"step": 1.5}', '{"step": true}', '{"total": 3}', "[1]", "not json", '{"step": "12"}'],
)
def test_what_is_not_a_whole_step_is_no_report(body):
    assert progress.parse(progress.MARK + body) is None


def test_a_report_keeps_only_a_few_finite_well_named_numbers():
    """A line is the job's own output: what reaches the record is bounded."""
    numbers = {f"n{i}": i for i in range(20)} | {"bad name": 1, "x" * 40: 1, "nan": float("nan"), "s": "text"}
    got = progress.parse(progress.MARK + json.dumps({"step": 1, **numbers}))
    assert len(got["numbers"]) == progress.MAX_NUMBERS and all(k.startswith("n") for k in got["numbers"])


def test_a_tqdm_bar_gives_its_last_state():
    bar = " 40%|####      | 40/100 [00:10<00:15,  3.90it/s]\r 45%|####5     | 45/100 [00:11<00:14,  4.50it/s]"
    assert progress.parse_tqdm(bar) == {"step": 45, "total": 100, "rate": 4.5}
    assert progress.parse_tqdm("  2%|2    | 2/100 [00:10<08:10,  5.00s/it]")["rate"] == pytest.approx(0.2)
    assert progress.parse_tqdm("epoch 3 loss 0.25") is None


def test_progress_follows_reports_and_bars_with_a_rate_that_restarts_after_a_resume():
    p = progress.Progress()
    assert p.record() == {}
    assert p.see(progress.line(10, 100, loss=3.0), at=1000.0) is True  # a report line: kept out of the logs
    assert p.see(progress.line(30, 100, loss=2.0), at=1010.0) is True
    assert (p.step, p.total, p.numbers, p.rate) == (30, 100, {"loss": 2.0}, 2.0)
    assert p.see("epoch 3 loss 2.0", at=1011.0) is False and p.step == 30  # an ordinary line changes nothing
    assert p.see(progress.line(20, 100), at=1020.0) and p.rate is None  # resumed from earlier: no rate yet
    assert p.see(progress.line(25, 100), at=1030.0) and p.rate == 0.5
    assert p.see(" 5/9 [00:01<00:01,  8.00it/s]", at=1031.0) is False and (p.step, p.rate) == (5, 8.0)
    assert p.record() == {"step": 5, "total": 9, "rate": 8.0, "at": 1031.0, "numbers": {}}


def test_the_rate_is_over_about_the_last_minute():
    p = progress.Progress()
    for i in range(200):  # 1 step a second, then 10 a second from t=100
        p.see(progress.line(i if i < 100 else 100 + (i - 100) * 10), at=float(i))
    assert p.rate == pytest.approx(10.0)


def test_jobs_cells():
    rec = {"step": 1200, "total": 10000, "rate": 4.54, "at": 0.0, "numbers": {}}
    assert progress.cells(rec, 990.0, now=1000.0) == ("1200/10000", "4.54/s", "10s ago")
    assert progress.cells({"step": 3, "total": None, "rate": 0.05}, 1000.0 - 7200, 1000.0) == ("3", "3/min", "2h ago")
    assert progress.cells({}, None, 1000.0) == ("-", "-", "-")


def test_report_prints_on_rank_0_under_meshrun_only(monkeypatch, capsys):
    monkeypatch.delenv("MESHRUN_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "0")
    report(5, 10, loss=1.0)  # plain torchrun or python: nothing
    monkeypatch.setenv("MESHRUN_RUN_ID", "job-1")
    monkeypatch.setenv("RANK", "1")
    report(5, 10, loss=1.0)  # another rank: nothing
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    report(5, 10, loss=1.0)
    assert progress.parse(capsys.readouterr().out.rstrip("\n")) == {"step": 5, "total": 10, "numbers": {"loss": 1.0}}
