"""meshrun.core.jobspec: when a job stops, how it ended, which lines belong to whom (pure)."""

from __future__ import annotations

import pytest

from meshrun.core.jobspec import JobRecord, JobSpec, ShareEnd
from meshrun.core.outcome import Outcome
from meshrun.core.termtext import is_noise, line_matches
from meshrun.errors import UsageError

OK = ShareEnd(code=0)


def rank_exit(rank, node, code, t, sig=None):
    return {"rank": rank, "node": node, "exit_code": code, "signal": sig, "time": t}


def fixed(**shares) -> Outcome:
    return Outcome(elastic=False, min_nodes=len(shares), shares=dict(shares))


def test_everything_ok_is_success():
    o = fixed(a=OK, b=OK)
    assert o.stop_reason() == ""
    assert o.verdict("j") == ("succeeded", 0, "job j finished on 2 node(s)")


def test_the_first_failing_rank_by_time_sets_the_code_and_is_named():
    o = fixed(
        a=ShareEnd(1, failures=[rank_exit(0, "a", 1, 20.0)]), b=ShareEnd(1, failures=[rank_exit(1, "b", 3, 10.0)])
    )
    assert o.stop_reason() == "the share on a failed"
    assert o.verdict("j") == ("failed", 3, "job j failed: rank 1 on b exited with code 3 (first failure)")


def test_a_rank_killed_by_a_signal_is_said_so():
    o = fixed(a=ShareEnd(1, failures=[rank_exit(2, "a", 137, 5.0, "SIGKILL")]), b=OK)
    assert o.verdict("j") == ("failed", 137, "job j failed: rank 2 on a was killed by SIGKILL (first failure)")


def test_a_torchrun_failure_without_a_rank_failure_names_its_error_line():
    o = fixed(a=ShareEnd(1, error="RendezvousConnectionError: the store is gone"), b=OK)
    assert o.verdict("j") == (
        "failed",
        1,
        "job j failed: torchrun on a exited with code 1: RendezvousConnectionError: the store is gone",
    )
    o = fixed(a=ShareEnd(None, signal="SIGTERM"), b=OK)
    assert o.verdict("j") == ("failed", 143, "job j failed: torchrun on a was killed by SIGTERM")


def test_a_lost_node_comes_before_the_failures_it_caused():
    o = fixed(a=ShareEnd(1, failures=[rank_exit(0, "a", 1, 1.0)]), b=None)
    o.lost["b"] = 2.0
    assert o.stop_reason() == "lost b"
    assert o.verdict("j") == ("failed", 255, "job j failed: lost node b (its agent stopped answering)")


def test_elastic_goes_on_above_min_and_stops_below_it_saying_how_many_are_left():
    o = Outcome(elastic=True, min_nodes=2, shares={"a": None, "b": None, "c": None})
    o.lost["c"] = 1.0
    assert o.stop_reason() == ""  # 2 of 2 still run
    o.lost["b"] = 2.0
    assert o.stop_reason() == "1 of 2 nodes left"
    o.shares["a"] = ShareEnd(None, signal="SIGTERM", cancelled=True)
    assert o.verdict("j") == (
        "failed",
        1,
        "job j stopped: 1 of 2 nodes left (lost nodes b, c (their agents stopped answering))",
    )


def test_an_elastic_job_that_finished_on_min_nodes_succeeded_with_notes():
    o = Outcome(elastic=True, min_nodes=2, shares={"a": OK, "b": OK, "c": None})
    o.lost["c"] = 1.0
    o.shares["a"] = ShareEnd(0, failures=[rank_exit(0, "a", 1, 1.0)])
    assert o.verdict("j") == (
        "succeeded",
        0,
        "job j finished on 2 node(s) (lost c mid-job; torch elastic "
        "continued without it; 1 worker exit(s) recovered by restarts)",
    )


def test_cancelled_wins():
    o = fixed(a=ShareEnd(None, signal="SIGTERM", cancelled=True), b=OK)
    o.cancelled = True
    assert o.stop_reason() == "cancelled"
    assert o.verdict("j") == ("cancelled", 130, "job j cancelled")


def test_line_matches_node_and_rank():
    assert line_matches("[gpu-a r3] epoch 1", "gpu-a", 3) and line_matches("[gpu-a r3] x", None, 3)
    assert not line_matches("[gpu-a r3] x", "gpu-b", None) and not line_matches("[gpu-a r3] x", None, 4)
    assert line_matches("[gpu-a] torchrun says", "gpu-a", None) and not line_matches("[gpu-a] t", "gpu-a", 0)
    assert line_matches("anything", None, None) and not line_matches("no prefix", "gpu-a", None)


def test_only_the_exact_reverse_dns_warning_is_noise():
    w = "[W1122 23:00:53.052383232 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
    assert is_noise(w) and is_noise("[dc2-a r1] " + w) and is_noise("[dc2-a] " + w)
    assert not is_noise(w + " and more") and not is_noise(
        "[c10d] The hostname of the client socket cannot be retrieved. err=-3"
    )
    assert not is_noise("[W1122 23:00:53.1 socket.cpp:207] [c10d] Some other warning")


def test_job_spec_and_record_round_trip_and_validation():
    spec = JobSpec("exp7", "train.py", ["--epochs", "3"], nnodes="2:3", env={"A": "1"})
    assert JobSpec.from_dict(spec.to_dict()) == spec and spec.elastic and spec.bounds(5) == (2, 3)
    assert JobSpec("x", "t.py").bounds(4) == (4, 4) and not JobSpec("x", "t.py").elastic
    for bad in ({"job_id": "..", "script": "t.py"}, {"job_id": "ok", "script": ""}, "nope"):
        with pytest.raises((ValueError, UsageError)):
            JobSpec.from_dict(bad)
    rec = JobRecord("exp7", started=100.0)
    assert JobRecord.from_dict(rec.to_dict()) == rec and not rec.final and rec.duration(130.0) == 30.0
