"""meshrun.core.memberlist: member-list deltas, their bounded history, and applying them (pure)."""

from __future__ import annotations

import random
from dataclasses import replace

from meshrun.core.memberlist import History, apply_delta, member_changes, signature
from meshrun.core.model import Member


def key(i: int) -> str:
    return f"{i:042d}A="  # 44 characters like a WireGuard key; never parsed here


def mem(i: int, endpoint: str | None = None, hs: int = 0) -> Member:
    return Member(f"n{i}", key(i), f"10.213.0.{i + 2}", endpoint, ("172.31.40.46:51820",), last_handshake=hs)


def sigs(members):
    return {m.public_key: signature(m) for m in members}


def test_member_changes_sees_joins_endpoints_and_removals_but_not_handshake_times():
    old = [mem(1), mem(2, "198.51.100.2:1"), mem(3)]
    new = [mem(1, hs=12345), mem(2, "198.51.100.2:2"), mem(4)]
    assert member_changes(sigs(old), sigs(new)) == ({key(2), key(4)}, {key(3)})
    assert member_changes(sigs(old), sigs(old)) == (frozenset(), frozenset())


def test_since_unions_what_changed_for_the_caller_and_its_own_pairs_only():
    h = History(10)
    h.record(11, members={key(5)})  # n5 joined
    h.record(12, paths={"n1": {key(2)}, "n2": {key(1)}})  # the n1-n2 pair changed path
    h.record(13, removed={key(3)})
    assert h.since(10, "n1") == ({key(5), key(2)}, {key(3)})
    assert h.since(10, "n7") == ({key(5)}, {key(3)})  # another pair's path: nothing for n7
    assert h.since(11, "n2") == ({key(1)}, {key(3)})
    assert h.since(13, "n1") == (set(), set())  # current
    # Older than the history, or newer than anything published (another coordinator): the full list.
    assert h.since(9, "n1") is None and h.since(14, "n1") is None


def test_a_version_between_two_published_ones_gets_the_whole_later_change():
    h = History(10)
    h.record(15, members={key(1)})  # the agent may hold 12 (its join answer was built mid-way)
    assert h.since(12, "n9") == ({key(1)}, set())


def test_a_member_changed_then_removed_is_only_removed():
    h = History(1)
    h.record(2, members={key(1)})
    h.record(3, removed={key(1)})
    assert h.since(1, "n9") == (set(), {key(1)})


def test_the_history_is_bounded_and_an_agent_behind_it_gets_none():
    h = History(0, size=3)
    for v in range(1, 6):
        h.record(v, members={key(v)})
    assert len(h.changes) == 3 and h.oldest == 2
    assert h.since(1, "n0") is None
    assert h.since(2, "n0") == ({key(3), key(4), key(5)}, set())


def test_a_record_without_a_newer_version_joins_the_latest_change_and_an_empty_one_is_dropped():
    h = History(4)
    h.record(4)  # nothing published, nothing changed
    assert not h.changes and h.latest == 4
    h.record(5, members={key(1)})
    h.record(5, paths={"n2": {key(3)}})  # same version: merged, not lost
    assert len(h.changes) == 1 and h.since(4, "n2") == ({key(1), key(3)}, set())


def test_apply_delta_replaces_in_place_appends_new_and_drops_removed():
    old = [mem(0), mem(1), mem(2)]
    got = apply_delta(old, [mem(1, "198.51.100.1:9"), mem(3)], {key(2)})
    assert got == [mem(0), mem(1, "198.51.100.1:9"), mem(3)]
    assert apply_delta(old, [], []) == old and apply_delta(old, [], []) is not old


def test_deltas_rebuild_every_list_the_coordinator_would_send_in_full():
    """Random joins, endpoint changes, path changes and removals: from every version an agent may
    hold, the delta applied to the list it holds is the full list of the latest version."""
    rng = random.Random(18)
    members = [mem(i) for i in range(4)]
    paths: dict[str, str] = {}  # n0's view: peer key -> path
    h = History(1, size=1000)
    lists = {1: members}
    version, next_id = 1, 4

    def view(ms):
        return [replace(m, path=paths.get(m.public_key, "")) for m in ms]

    views = {1: view(members)}
    for _ in range(200):
        before = {m.public_key: signature(m) for m in members}
        touched: dict[str, set[str]] = {}
        op = rng.random()
        if op < 0.3:
            members = members + [mem(next_id)]
            next_id += 1
        elif op < 0.55 and len(members) > 1:
            i = rng.randrange(1, len(members))
            members = (
                members[:i]
                + [replace(members[i], endpoint=f"198.51.100.9:{rng.randrange(1, 65535)}")]
                + members[i + 1 :]
            )
        elif op < 0.8 and len(members) > 1:
            peer = rng.choice(members[1:]).public_key
            paths[peer] = rng.choice(["public", "relayed", "private"])
            touched["n0"] = {peer}
        elif len(members) > 2:
            gone = rng.choice(members[1:])
            members = [m for m in members if m is not gone]
            paths.pop(gone.public_key, None)
        else:
            continue
        changed, removed = member_changes(before, {m.public_key: signature(m) for m in members})
        version += 1
        h.record(version, changed, removed, touched)
        lists[version], views[version] = members, view(members)
    current = {m.public_key: m for m in views[version]}
    for known, held in views.items():
        changed, removed = h.since(known, "n0")
        got = apply_delta(
            held, [current[k] for k in sorted(changed, key=lambda k: views[version].index(current[k]))], removed
        )
        assert got == views[version], known
