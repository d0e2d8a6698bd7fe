"""A supervisor following a share's output: the owner calls a share lost after LOST_AFTER_S without an answer
(an elastic job re-forms without it); a standby, whose copy is only a copy, keeps trying until it answers.
Its watch calls a share whose machine answers no handshake lost sooner, unless every machine went silent."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from meshrun.core import liveness, progress
from meshrun.core.jobspec import JobRecord
from meshrun.core.outcome import Outcome
from meshrun.errors import NetworkError
from meshrun.jobs import supervisor
from meshrun.jobs.handles import LocalShare
from meshrun.system.files.statedir import StateDir


class FlakyShare:
    """A share whose agent does not answer `silent` calls, then prints two lines and ends."""

    name = "dc2-a"

    def __init__(self, silent: int) -> None:
        self.silent = silent

    def output(self, job_id: str, offset: int) -> dict:
        if self.silent:
            self.silent -= 1
            raise NetworkError("no answer from 10.77.0.2:51821", "check its agent")
        return {"lines": ["[dc2-a r0] step 1", "[dc2-a r0] step 2"], "offset": 40, "done": True, "status": {}}


class Replica:
    owning = False  # another coordinator owns the job


def follower(
    tmp_path: Path, owning: bool, shares: tuple[str, ...] = ("dc2-a",)
) -> tuple[supervisor.Supervisor, list[str]]:
    """A Supervisor with just what `_follow` and `_watch` use (its constructor reads a coordinator's state)."""
    sup = supervisor.Supervisor.__new__(supervisor.Supervisor)
    sup.job_id, sup.lock = "j1", threading.Lock()
    sup.dir = StateDir(tmp_path)
    sup.logs = StateDir(tmp_path / "logs")
    sup.logs.create()
    sup.record, sup.progress, sup.progress_saved = JobRecord("j1"), progress.Progress(), 0.0
    sup.outcome = Outcome(elastic=True, min_nodes=1, shares=dict.fromkeys(shares))
    sup.replica = None if owning else Replica()
    said: list[str] = []
    sup.say = said.append
    sup._regroup = lambda lost, heard: said.append(f"regroup without {lost}")
    return sup, said


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(supervisor, "LOST_AFTER_S", 1.5)
    monkeypatch.setattr(liveness, "PROBE_EVERY_S", 0.02)
    monkeypatch.setattr(liveness, "GONE_AFTER_S", 0.2)


def test_the_owner_calls_a_silent_share_lost_and_regroups(tmp_path):
    sup, said = follower(tmp_path, owning=True)
    sup._follow(FlakyShare(silent=5))
    assert "dc2-a" in sup.outcome.lost and sup.outcome.running() == []
    assert said[0].startswith("lost dc2-a: no answer from its agent") and said[1] == "regroup without dc2-a"


def test_a_standby_keeps_following_a_share_it_could_not_reach_for_longer(tmp_path):
    sup, said = follower(tmp_path, owning=False)
    sup._follow(FlakyShare(silent=3))  # about 3 s of silence, twice LOST_AFTER_S
    assert sup.outcome.lost == {} and said == []
    lines = (tmp_path / "logs" / "dc2-a.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == ["[dc2-a r0] step 1", "[dc2-a r0] step 2"]
    assert sup.outcome.shares["dc2-a"] is not None  # its end was recorded


class Machine:
    """A share seen only by the watch: its machine answers a handshake after `silent_after` probes no more
    (None: always), or answers again after `back_after` more."""

    def __init__(self, name: str, silent_after: int | None = None, back_after: int | None = None) -> None:
        self.name, self.silent_after, self.back_after, self.probes = name, silent_after, back_after, 0

    def reachable(self) -> bool:
        self.probes += 1
        if self.silent_after is None or self.probes <= self.silent_after:
            return True
        return self.back_after is not None and self.probes > self.silent_after + self.back_after


def watched(sup: supervisor.Supervisor, machines: list[Machine], seconds: float) -> None:
    """Run the supervisor's watch over `machines` for `seconds`."""
    sup.shares = {m.name: m for m in machines}
    stop = threading.Event()
    t = threading.Thread(target=sup._watch, args=(stop,))
    t.start()
    stop.wait(seconds)
    stop.set()
    t.join(5)
    assert not t.is_alive()


def test_the_watch_calls_a_silent_machine_lost_and_regroups_without_waiting_for_its_output(tmp_path):
    sup, said = follower(tmp_path, owning=True, shares=("dc2-a", "dc3-a"))
    watched(sup, [Machine("dc2-a"), Machine("dc3-a", silent_after=3)], 1.0)
    assert list(sup.outcome.lost) == ["dc3-a"] and sup.outcome.running() == ["dc2-a"]
    assert said[0].startswith("lost dc3-a: its machine answered nothing for ") and said[1] == "regroup without dc3-a"
    assert len(said) == 2  # called once


def test_the_watch_leaves_a_machine_that_answers_again_in_time(tmp_path):
    sup, said = follower(tmp_path, owning=True, shares=("dc2-a", "dc3-a"))
    watched(sup, [Machine("dc2-a"), Machine("dc3-a", silent_after=3, back_after=2)], 1.0)
    assert sup.outcome.lost == {} and said == []


def test_every_machine_silent_at_once_is_left_to_the_slower_rule(tmp_path):
    sup, said = follower(tmp_path, owning=True, shares=("dc2-a", "dc3-a"))
    watched(sup, [Machine("dc2-a", silent_after=2), Machine("dc3-a", silent_after=2)], 1.0)
    assert sup.outcome.lost == {} and said == []


def test_a_standby_watch_calls_nothing_lost(tmp_path):
    sup, said = follower(tmp_path, owning=False, shares=("dc2-a", "dc3-a"))
    watched(sup, [Machine("dc2-a"), Machine("dc3-a", silent_after=0)], 1.0)
    assert sup.outcome.lost == {} and said == []


def test_the_coordinators_own_share_does_not_hide_that_its_link_is_cut(tmp_path):
    sup, said = follower(tmp_path, owning=True, shares=("dc1-a", "dc2-a", "dc3-a"))
    local = LocalShare.__new__(LocalShare)
    local.name = "dc1-a"  # the coordinator trains too: always "reachable" from itself
    watched(sup, [local, Machine("dc2-a", silent_after=2), Machine("dc3-a", silent_after=2)], 1.0)
    assert sup.outcome.lost == {} and said == []


class ReportingShare:
    """A share that printed a report and a tqdm bar as rank 0, an ordinary line, and lines that only look like
    rank 0's: a report from rank 1, and one from another node's prefix."""

    name = "dc2-a"

    def output(self, job_id: str, offset: int) -> dict:
        lines = [
            "[dc2-a r0] " + progress.line(40, 100, loss=1.5),
            "[dc2-a r0] epoch 1 loss 1.5",
            "[dc2-a r1] " + progress.line(99, 100),
            "[dc2-a r0] [dc3-a r0] " + progress.line(98, 100),
        ]
        return {"lines": lines, "offset": 40, "done": True, "status": {}}


def test_rank_0s_reports_go_to_the_record_not_to_the_logs(tmp_path):
    sup, _ = follower(tmp_path, owning=True)
    sup._follow(ReportingShare())
    rec = JobRecord.from_dict(sup.dir.read_json("job.json"))  # saved while following
    assert rec.progress["step"] == 40 and rec.progress["total"] == 100 and rec.progress["numbers"] == {"loss": 1.5}
    assert rec.rank0 == "dc2-a" and rec.last_output is not None
    mirrored = (sup.logs / "dc2-a.log").read_text()
    assert "epoch 1 loss 1.5" in mirrored and mirrored.count(progress.MARK) == 2  # rank 1's and the forged one
    assert "[dc2-a r0] " + progress.MARK not in mirrored
