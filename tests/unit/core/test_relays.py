"""meshrun.core.relays: which member relays a pair, what an agent measures, how it reports it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshrun.core import relays
from meshrun.core.model import Member
from meshrun.core.relays import COORDINATOR, LOAD_PENALTY_MS, Candidate, choose


def mesh(direct_pairs: set[frozenset[str]], rtt: dict[frozenset[str], float] | None = None):
    rtt = rtt or {}

    def is_direct(x: str, y: str) -> bool:
        return frozenset((x, y)) in direct_pairs

    def rtt_ms(x: str, y: str) -> float | None:
        return rtt.get(frozenset((x, y)))

    return is_direct, rtt_ms


ALL = {frozenset(p) for p in [("a", "r1"), ("b", "r1"), ("a", "r2"), ("b", "r2"), ("a", "r3")]}
CANDIDATES = [Candidate("a"), Candidate("b"), Candidate("r1"), Candidate("r2"), Candidate("r3")]


def test_the_relay_with_the_shortest_measured_path_is_chosen():
    direct, rtt = mesh(
        ALL,
        {
            frozenset(("a", "r1")): 40,
            frozenset(("r1", "b")): 40,
            frozenset(("a", "r2")): 10,
            frozenset(("r2", "b")): 20,
            frozenset(("a", "")): 5,
            frozenset(("", "b")): 100,
        },
    )
    assert choose("a", "b", CANDIDATES, direct, rtt, {}) == "r2"  # 30 ms, before r1 (80) and the coordinator (105)


def test_a_relay_needs_a_direct_tunnel_with_both_ends_and_may_opt_out():
    direct, rtt = mesh(ALL)
    # r3 reaches only a; r1 opted out (join --no-relay): r2 it is.
    cands = [Candidate("r1", may_relay=False), Candidate("r2"), Candidate("r3")]
    assert choose("a", "b", cands, direct, rtt, {}) == "r2"
    # Nobody qualifies: the coordinator relays.
    assert choose("a", "b", [Candidate("r3")], direct, rtt, {}) == COORDINATOR


def test_pairs_spread_over_relays_and_a_failed_relay_is_avoided():
    direct, rtt = mesh(ALL)
    assert choose("a", "b", CANDIDATES, direct, rtt, {}) == "r1"  # unmeasured ties: the first name
    assert choose("a", "b", CANDIDATES, direct, rtt, {"r1": 1}) == "r2"  # r1 already carries a pair
    assert choose("a", "b", CANDIDATES, direct, rtt, {}, avoid={"r1"}) == "r2"
    assert choose("a", "b", CANDIDATES, direct, rtt, {}, avoid={"r1", "r2"}) == COORDINATOR
    # Even the coordinator failed: it is still the last resort.
    assert choose("a", "b", CANDIDATES, direct, rtt, {}, avoid={"r1", "r2", COORDINATOR}) == COORDINATOR


def test_a_peer_wins_a_tie_with_the_coordinator_until_its_load_outweighs_the_coordinators_penalty():
    direct, rtt = mesh(ALL)
    # Everything unmeasured: r1 costs 500 ms plus its load, the coordinator 500 plus its fixed penalty.
    assert 3 * LOAD_PENALTY_MS < relays.COORDINATOR_PENALTY_MS < 5 * LOAD_PENALTY_MS
    assert choose("a", "b", [Candidate("r1")], direct, rtt, {"r1": 3}) == "r1"
    assert choose("a", "b", [Candidate("r1")], direct, rtt, {"r1": 5}) == COORDINATOR
    # A clearly closer coordinator wins.
    near = {frozenset(("a", "")): 5.0, frozenset(("", "b")): 5.0}
    assert choose("a", "b", [Candidate("r1")], direct, lambda x, y: near.get(frozenset((x, y))), {}) == COORDINATOR


@given(st.floats(min_value=0.05, max_value=59_000))
def test_rtt_buckets_are_within_ten_percent(ms):
    b = relays.rtt_bucket(ms)
    assert abs(b - ms) <= max(0.1, 0.06 * ms)


def _member(i: int, **kw) -> Member:
    key = f"{i:042d}A="
    return Member(f"n{i}", key, f"10.213.0.{i + 2}", f"198.51.100.{i}:51820", (), **kw)


def test_probe_targets_are_the_coordinator_and_direct_relays_a_stable_choice():
    coord = _member(0, is_coordinator=True)
    others = [_member(i, path="public") for i in range(1, 40)]
    relayed = _member(40, path="relayed")
    opted_out = _member(41, path="public", relay=False)
    members = [coord, *others, relayed, opted_out]
    me = others[0].public_key
    first = relays.probe_targets(me, members)
    assert first[0] == coord and len(first) == relays.PROBE_TARGETS
    assert all(m.path == "public" and m.relay and m.public_key != me for m in first[1:])
    assert relays.probe_targets(me, list(reversed(members))) == first  # the order of the list does not matter
    assert relays.probe_targets(others[1].public_key, members) != first  # another node measures others
