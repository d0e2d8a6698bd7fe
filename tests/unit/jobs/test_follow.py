"""A supervisor following a share's output: the owner calls a share lost after LOST_AFTER_S without an answer
(an elastic job re-forms without it); a standby, whose copy is only a copy, keeps trying until it answers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from meshrun.core.outcome import Outcome
from meshrun.errors import NetworkError
from meshrun.jobs import supervisor
from meshrun.system.statedir import StateDir


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


def follower(tmp_path: Path, owning: bool) -> tuple[supervisor.Supervisor, list[str]]:
    """A Supervisor with just what `_follow` uses (its constructor reads a coordinator's state)."""
    sup = supervisor.Supervisor.__new__(supervisor.Supervisor)
    sup.job_id, sup.lock = "j1", threading.Lock()
    sup.logs = StateDir(tmp_path / "logs")
    sup.logs.create()
    sup.outcome = Outcome(elastic=True, min_nodes=1, shares={"dc2-a": None})
    sup.replica = None if owning else Replica()
    said: list[str] = []
    sup.say = said.append
    sup._regroup = lambda lost, heard: said.append(f"regroup without {lost}")
    return sup, said


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(supervisor, "LOST_AFTER_S", 1.5)


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
