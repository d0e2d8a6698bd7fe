"""meshrun.train.snapshots: the state digest, the majority check after a sync, which state a (re-)formed group
adopts, and snapshot files read back only for the model they were written for. Pure or on tmp files; the
collectives around them are tests/unit/train/test_diloco.py's."""

from __future__ import annotations

import math

import pytest
import torch

from meshrun.errors import StateError
from meshrun.train import snapshots
from meshrun.train.snapshots import FRESH, Resume, check_digests, plan_start, state_digest


def test_state_digest_is_bit_exact() -> None:
    a = [torch.tensor([1.0, 2.0]), torch.tensor([3.0], dtype=torch.bfloat16)]
    b = [t.clone() for t in a]
    assert state_digest(a) == state_digest(b)
    b[0][1] = torch.nextafter(b[0][1], torch.tensor(math.inf))
    assert state_digest(a) != state_digest(b)
    assert state_digest([torch.tensor([0.0])]) != state_digest([torch.tensor([-0.0])])  # raw bits, not values
    assert -(2**63) <= state_digest(a) < 2**63


def test_the_ranks_off_the_majority_are_named_and_a_tie_goes_to_the_lowest_ranks_digest():
    check_digests([7, 7, 7], sync=3)
    with pytest.raises(StateError, match=r"after sync 3: rank\(s\) \[1\] disagree with rank\(s\) \[0, 2\]"):
        check_digests([7, 8, 7], sync=3)
    with pytest.raises(StateError, match=r"rank\(s\) \[1\] disagree with rank\(s\) \[0\]"):
        check_digests([5, 6], sync=1)


@pytest.mark.parametrize(
    "table, plan",
    [
        ([[FRESH, 0, 1], [FRESH, 0, 1]], False),  # a fresh start, models alike: nothing sent
        ([[FRESH, 0, 1], [FRESH, 0, 2]], True),  # a fresh start, models differ: rank 0's is broadcast
        ([[4, 400, 9], [4, 400, 9], [FRESH, 0, 1]], Resume(4, 400, 0, [2])),  # a joiner gets the newest
        ([[3, 300, 8], [4, 400, 9], [4, 400, 9]], Resume(4, 400, 1, [0])),  # the lowest rank at the newest sends
        ([[4, 400, 9], [4, 400, 6]], Resume(4, 400, 0, [1])),  # same sync, another digest: replaced
    ],
)
def test_the_newest_snapshot_wins_and_everyone_else_receives_it(table, plan):
    assert plan_start(table) == plan


def test_a_snapshot_is_read_back_only_for_its_model(tmp_path):
    path = tmp_path / "snap.pt"
    shared = [torch.ones(3), torch.zeros(2, dtype=torch.int64)]
    assert snapshots.read_snapshot(path, ["w", "b"], shared, torch.device("cpu")) is None  # none yet
    snapshots.write_snapshot(path, ["w", "b"], 10, 2, 123, shared, {"state": {}, "param_groups": []}, None)
    snap = snapshots.read_snapshot(path, ["w", "b"], shared, torch.device("cpu"))
    assert (snap["step_count"], snap["sync_count"], snap["bytes_sent_total"]) == (10, 2, 123)
    assert all(torch.equal(a, b) for a, b in zip(snap["shared"], shared))
    for names, layout in ((["w", "c"], shared), (["w", "b"], [torch.ones(4), shared[1]])):
        with pytest.raises(StateError, match="is not for this model") as info:
            snapshots.read_snapshot(path, names, layout, torch.device("cpu"))
        assert str(path) in info.value.fix
    path.write_bytes(b"garbage")
    with pytest.raises(StateError, match="cannot read the DiLoCo snapshot") as info:
        snapshots.read_snapshot(path, ["w", "b"], shared, torch.device("cpu"))
    assert f"delete {path}" in info.value.fix
