"""A survivor's rendezvous acts on the supervisor's regroup, on torch's own state holder: a node called lost
leaves at once, so the finished round starts again when the survivors leave it, without waiting 15 s for
the lost node's heartbeats to expire (a node back at that address, a new torchrun with newer heartbeats, is
kept); and the re-formed round completes as soon as every node of the re-formed group joined, not after its
last call."""

from __future__ import annotations

import socket
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

dr = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")

from support import rendezvous_together  # noqa: E402

from meshrun.jobs import rdzv_backend, share  # noqa: E402
from meshrun.jobs.rdzv_backend import follow_regroups  # noqa: E402
from meshrun.jobs.share import REGROUP_ROUND_S, Regroup  # noqa: E402
from meshrun.system.files.statedir import StateDir  # noqa: E402


def lost(addrs: dict[str, float]):
    return lambda: Regroup(lost=addrs)


def holder_with_round(beats: dict[str, float], complete: bool = True, min_nodes: int = 1) -> SimpleNamespace:
    """torch's real state holder over a round of one participant per address in `beats` (each with its last
    heartbeat that many seconds ago), as a handler whose state holder it is. An unfinished round has the
    last-call deadline torch sets once MIN joined (30 s from now)."""
    settings = dr.RendezvousSettings(
        "job", min_nodes, 3, dr.RendezvousTimeout(), keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3
    )
    holder = dr._BackendRendezvousStateHolder(backend=None, settings=settings)
    now = datetime.now(timezone.utc)
    state = holder._state
    for i, (addr, ago) in enumerate(beats.items()):
        node = dr._NodeDesc(addr, 1000 + i, 0)
        state.participants[node] = i
        state.last_heartbeats[node] = now - timedelta(seconds=ago)
    state.complete = complete
    if not complete:
        state.deadline = now + timedelta(seconds=30)
    return SimpleNamespace(_state_holder=holder)


def addrs(holder) -> list[str]:
    return sorted(n.addr for n in holder._state.participants)


def test_a_lost_node_leaves_at_the_next_sanitize_and_the_round_starts_again_when_the_survivors_left():
    handler = holder_with_round({"10.77.0.2": 1, "10.77.0.3": 1, "10.77.0.4": 2})
    assert follow_regroups(handler, lost({"10.77.0.4": time.time()}))
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
    follow_regroups(handler, Regroup)
    handler._state_holder._sanitize()
    assert addrs(handler._state_holder) == ["10.77.0.2", "10.77.0.4"]


def test_a_node_back_at_a_lost_address_with_newer_heartbeats_is_kept():
    handler = holder_with_round({"10.77.0.2": 1, "10.77.0.4": 1})
    follow_regroups(handler, lost({"10.77.0.4": time.time() - 30}))  # called lost 30 s ago, back since
    handler._state_holder._sanitize()
    assert addrs(handler._state_holder) == ["10.77.0.2", "10.77.0.4"]


def test_a_handler_without_torchs_state_holder_is_left_as_it_is():
    assert not follow_regroups(SimpleNamespace(), Regroup)


def join_action(handler, addr: str):
    """What torch's own join step decides next for the participant at `addr`."""
    holder = handler._state_holder
    node = next(n for n in holder._state.participants if n.addr == addr)
    ctx = dr._RendezvousContext(node, holder._state, holder._settings)
    return dr._RendezvousJoinOp()(ctx, time.monotonic() + 60)


def test_the_reformed_round_completes_once_every_member_joined():
    handler = holder_with_round({"10.77.0.2": 0, "10.77.0.3": 0}, complete=False)
    follow_regroups(handler, lambda: Regroup(members=frozenset({"10.77.0.2", "10.77.0.3"}), at=time.time()))
    assert join_action(handler, "10.77.0.2") in (dr._Action.KEEP_ALIVE, dr._Action.SYNC)  # torch alone: waits
    handler._state_holder._sanitize()
    assert handler._state_holder._state.deadline <= datetime.now(timezone.utc)
    assert join_action(handler, "10.77.0.2") is dr._Action.MARK_RENDEZVOUS_COMPLETE


@pytest.mark.parametrize(
    "why,beats,members,age",
    [
        ("a member has not joined yet", {"10.77.0.2": 0, "10.77.0.3": 0}, {"10.77.0.2", "10.77.0.3", "10.77.0.5"}, 0),
        ("the regroup is from long ago", {"10.77.0.2": 0, "10.77.0.3": 0}, {"10.77.0.2", "10.77.0.3"}, 1),
        ("fewer than MIN joined", {"10.77.0.2": 0}, {"10.77.0.2"}, 0),
        ("no regroup was said", {"10.77.0.2": 0, "10.77.0.3": 0}, set(), 0),
    ],
)
def test_the_round_waits_out_its_last_call_when(why, beats, members, age):
    handler = holder_with_round(beats, complete=False, min_nodes=2)
    at = time.time() - age * (REGROUP_ROUND_S + 1)
    follow_regroups(handler, lambda: Regroup(members=frozenset(members), at=at))
    handler._state_holder._sanitize()
    assert handler._state_holder._state.deadline > datetime.now(timezone.utc) + timedelta(seconds=20), why
    assert join_action(handler, "10.77.0.2") is not dr._Action.MARK_RENDEZVOUS_COMPLETE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torch_handlers_skip_a_30_s_last_call_after_a_regroup(tmp_path, monkeypatch):
    """torch's whole dynamic rendezvous (meshrun's handler, as torchrun's agent builds it, over a real TCPStore)
    with MIN 2 of MAX 3 and a 30 s last call: told the re-formed group is these two, they finish at once."""
    from torch.distributed import TCPStore

    job = StateDir(tmp_path / "job")
    job.create()
    members = ["127.0.0.2", "127.0.0.3"]
    assert share.restart_workers(job, time.time(), ["127.0.0.4"], members) == 0  # no share runs: noted only
    monkeypatch.setenv("MESHRUN_JOB_DIR", str(job.path))
    monkeypatch.delenv("MESHRUN_INTERFACE", raising=False)
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    handlers = [
        rdzv_backend.create_handler(
            dr.RendezvousParameters(
                "meshrun",
                f"127.0.0.1:{port}",
                "J",
                2,
                3,
                local_addr=addr,
                is_host="0",
                join_timeout="60",
                last_call_timeout="30",
            )
        )
        for addr in members
    ]
    t0 = time.monotonic()
    infos, errors = rendezvous_together(handlers, 45)
    took = time.monotonic() - t0
    try:
        assert errors == [] and sorted(info.rank for info in infos.values()) == [0, 1]
        assert took < 20, f"the round waited {took:.1f} s: the 30 s last call was not cut"
    finally:
        for h in handlers:
            h.shutdown()
        del server


def test_restart_notes_the_lost_nodes_for_the_handler_even_with_no_share_running(tmp_path):
    job = StateDir(tmp_path / "job")
    job.create()
    before = time.time()
    assert share.restart_workers(job, time.time(), ["10.77.0.4"], ["10.77.0.2", "10.77.0.3", "10.77.0.5"]) == 0
    assert share.restart_workers(job, time.time(), ["10.77.0.5"], ["10.77.0.3", "10.77.0.2"]) == 0
    noted = share.read_regroup(job.path)
    assert set(noted.lost) == {"10.77.0.4", "10.77.0.5"} and all(
        before <= t <= time.time() for t in noted.lost.values()
    )
    assert noted.members == {"10.77.0.2", "10.77.0.3"} and before <= noted.at <= time.time()
    assert noted.expected(time.time()) == noted.members
    assert noted.expected(time.time() + REGROUP_ROUND_S) == frozenset()
    assert share.read_regroup(tmp_path / "nothing") == Regroup()
    job.write("regroup.json", "[1, 2")
    assert share.read_regroup(job.path) == Regroup()
