"""A survivor's rendezvous drops a node the supervisor called lost at once, on torch's own state holder:
the finished round starts again when the survivors leave it, without waiting 15 s for the lost node's
heartbeats to expire. A node back at that address (a new torchrun, newer heartbeats) is kept."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

dr = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")

from meshrun.jobs import share  # noqa: E402
from meshrun.jobs.rdzv_backend import forget_lost_nodes  # noqa: E402
from meshrun.system.statedir import StateDir  # noqa: E402


def holder_with_round(beats: dict[str, float]) -> SimpleNamespace:
    """torch's real state holder over a finished round of one participant per address in `beats` (each with
    its last heartbeat that many seconds ago), as a handler whose state holder it is."""
    settings = dr.RendezvousSettings(
        "job", 1, 3, dr.RendezvousTimeout(), keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3
    )
    holder = dr._BackendRendezvousStateHolder(backend=None, settings=settings)
    now = datetime.now(timezone.utc)
    state = holder._state
    for i, (addr, ago) in enumerate(beats.items()):
        node = dr._NodeDesc(addr, 1000 + i, 0)
        state.participants[node] = i
        state.last_heartbeats[node] = now - timedelta(seconds=ago)
    state.complete = True
    return SimpleNamespace(_state_holder=holder)


def addrs(holder) -> list[str]:
    return sorted(n.addr for n in holder._state.participants)


def test_a_lost_node_leaves_at_the_next_sanitize_and_the_round_starts_again_when_the_survivors_left():
    handler = holder_with_round({"10.77.0.2": 1, "10.77.0.3": 1, "10.77.0.4": 2})
    assert forget_lost_nodes(handler, lambda: {"10.77.0.4": time.time()})
    holder = handler._state_holder
    holder._sanitize()
    assert addrs(holder) == ["10.77.0.2", "10.77.0.3"] and holder._state.complete and holder._state.round == 0
    for node in list(holder._state.participants):  # the survivors leave the finished round (their restart)
        del holder._state.participants[node]
        del holder._state.last_heartbeats[node]
    dr._remove_participant_epilogue(holder._state, holder._settings)
    assert not holder._state.complete and holder._state.round == 1


def test_without_the_note_torch_keeps_the_silent_node_until_its_heartbeats_expire():
    handler = holder_with_round({"10.77.0.2": 1, "10.77.0.4": 2})
    forget_lost_nodes(handler, dict)
    handler._state_holder._sanitize()
    assert addrs(handler._state_holder) == ["10.77.0.2", "10.77.0.4"]


def test_a_node_back_at_a_lost_address_with_newer_heartbeats_is_kept():
    handler = holder_with_round({"10.77.0.2": 1, "10.77.0.4": 1})
    forget_lost_nodes(handler, lambda: {"10.77.0.4": time.time() - 30})  # called lost 30 s ago, back since
    handler._state_holder._sanitize()
    assert addrs(handler._state_holder) == ["10.77.0.2", "10.77.0.4"]


def test_a_handler_without_torchs_state_holder_is_left_as_it_is():
    assert not forget_lost_nodes(SimpleNamespace(), dict)


def test_restart_notes_the_lost_nodes_for_the_handler_even_with_no_share_running(tmp_path):
    job = StateDir(tmp_path / "job")
    job.create()
    before = time.time()
    assert share.restart_workers(job, time.time(), ["10.77.0.4"]) == 0
    assert share.restart_workers(job, time.time(), ["10.77.0.5"]) == 0
    noted = share.lost_nodes(job.path)
    assert set(noted) == {"10.77.0.4", "10.77.0.5"} and all(before <= t <= time.time() for t in noted.values())
    assert share.lost_nodes(tmp_path / "nothing") == {}
