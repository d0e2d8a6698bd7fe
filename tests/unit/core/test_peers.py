"""meshrun.core.peers: desired peer sets and the minimal diff (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrun.core.model import Member
from meshrun.core.peers import (
    HANDSHAKE_FRESH_S,
    HOLD_S,
    KEEPALIVE,
    PeerDiff,
    PeerSpec,
    PeerState,
    desired_for_coordinator,
    desired_for_node,
    diff,
    handshake_holds,
    to_recreate,
    wg_set_args,
)

K_COORD = "j0DFrbaPJWJK5bIU6nZ6bslNgp09e14a0bpvPiE4KF8="
K_A = "omjXDyOxNCkYbimc/y3YipnkEnnasAyCC8uW60+7wVU="
K_B = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg="
K_C = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE="
NOW = 1_700_000_000.0

MEMBERS = [
    Member("coord", K_COORD, "10.213.0.1", "203.0.113.1:51820", (), True, 0),
    Member("gpu-a", K_A, "10.213.0.2", "198.51.100.2:40000", ("172.31.40.46:51820",), False, 1),
    Member("gpu-b", K_B, "10.213.0.3", None, ("172.31.40.47:51820",), False, 0),
]


def state(key, endpoint="198.51.100.2:40000", ips=("10.213.0.2/32",), hs=0, ka=KEEPALIVE) -> PeerState:
    return PeerState(key, endpoint, tuple(ips), int(hs), 10, 20, ka)


class TestDesired:
    def test_for_node_excludes_self_and_sets_endpoints(self):
        assert desired_for_node(K_A, MEMBERS) == [
            PeerSpec(K_COORD, ("10.213.0.1/32",), "203.0.113.1:51820", 25, "coord"),
            PeerSpec(K_B, ("10.213.0.3/32",), None, 0, "gpu-b"),  # no keepalive before an endpoint
        ]

    def test_for_node_unknown_self_gets_everyone(self):
        assert [p.name for p in desired_for_node(K_C, MEMBERS)] == ["coord", "gpu-a", "gpu-b"]

    def test_for_coordinator_has_no_endpoints_and_no_self(self):
        assert desired_for_coordinator(MEMBERS) == [
            PeerSpec(K_A, ("10.213.0.2/32",), None, 0, "gpu-a"),
            PeerSpec(K_B, ("10.213.0.3/32",), None, 0, "gpu-b"),
        ]

    def test_empty(self):
        assert desired_for_node(K_A, []) == [] and desired_for_coordinator([]) == []

    def test_a_coordinator_dials_the_other_coordinators_at_their_endpoints_and_leaves_itself_out(self):
        other = Member("coord-b", K_C, "10.213.0.9", "198.51.100.7:51820", (), True, 0)
        founding = Member("coord", K_COORD, "10.213.0.1", None, (), True, 0)  # its row has no endpoint
        members = [founding, MEMBERS[1], other]
        assert desired_for_coordinator(members, K_COORD) == [
            PeerSpec(K_A, ("10.213.0.2/32",), None, 0, "gpu-a"),
            PeerSpec(K_C, ("10.213.0.9/32",), "198.51.100.7:51820", KEEPALIVE, "coord-b"),
        ]
        # on coord-b: the first coordinator once its row carries its endpoint (after `coordinator add`)
        founding = Member("coord", K_COORD, "10.213.0.1", "203.0.113.1:51820", (), True, 0)
        assert [(p.name, p.endpoint) for p in desired_for_coordinator([founding, MEMBERS[1], other], K_C)] == [
            ("coord", "203.0.113.1:51820"),
            ("gpu-a", None),
        ]

    def test_held_peer_gets_its_endpoint_but_no_keepalive(self):
        spec = desired_for_node(K_B, MEMBERS, hold={K_A})[1]
        assert (spec.public_key, spec.endpoint, spec.keepalive) == (K_A, "198.51.100.2:40000", 0)


class TestHandshakeHolds:
    """Only the end with the greater key of a pair without a handshake waits, for HOLD_S."""

    # K_B > K_A > K_C (base64 text order, which both ends compute the same way)
    B_SEES_A = [
        Member("coord", K_COORD, "10.213.0.1", "203.0.113.1:51820", (), True, 0),
        Member("gpu-a", K_A, "10.213.0.2", "198.51.100.2:40000", (), False, 0, "public"),
    ]

    def test_greater_key_waits_then_goes(self):
        held, windows = handshake_holds(K_B, self.B_SEES_A, {}, {}, 100.0)
        assert held == {K_A}
        assert windows == {(K_A, "198.51.100.2:40000", "public"): 100.0 + HOLD_S}
        assert handshake_holds(K_B, self.B_SEES_A, {}, windows, 100.0 + HOLD_S - 0.01)[0] == {K_A}
        assert handshake_holds(K_B, self.B_SEES_A, {}, windows, 100.0 + HOLD_S)[0] == frozenset()

    def test_smaller_key_never_waits_and_coordinator_is_never_held(self):
        a_sees_b = [
            Member("coord", K_COORD, "10.213.0.1", "203.0.113.1:51820", (), True, 0),
            Member("gpu-b", K_B, "10.213.0.3", "198.51.100.3:40000", (), False, 0, "public"),
        ]
        assert handshake_holds(K_A, a_sees_b, {}, {}, 100.0) == (frozenset(), {})
        # A key greater than everyone's holds the node, never the coordinator (which has no endpoint
        # for nodes and never initiates to them).
        assert handshake_holds("z" * 43 + "=", self.B_SEES_A, {}, {}, 100.0)[0] == {K_A}

    def test_no_hold_with_a_handshake_or_without_an_endpoint(self):
        assert handshake_holds(K_B, self.B_SEES_A, {K_A: 1234}, {}, 100.0) == (frozenset(), {})
        no_endpoint = [Member("gpu-a", K_A, "10.213.0.2", None, (), False, 0)]
        assert handshake_holds(K_B, no_endpoint, {}, {}, 100.0) == (frozenset(), {})

    def test_new_path_or_recreate_opens_a_new_window(self):
        _, windows = handshake_holds(K_B, self.B_SEES_A, {}, {}, 100.0)
        held, windows = handshake_holds(K_B, self.B_SEES_A, {}, windows, 102.0)
        assert held == frozenset()
        moved = [self.B_SEES_A[0], Member("gpu-a", K_A, "10.213.0.2", "172.31.40.46:51820", (), False, 0, "private")]
        before = dict(windows)
        held, windows = handshake_holds(K_B, moved, {K_A: 99}, windows, 103.0, recreate={K_A})
        assert held == {K_A}
        assert list(windows) == [(K_A, "172.31.40.46:51820", "private")]  # the old window is dropped
        assert list(before) == [(K_A, "198.51.100.2:40000", "public")]  # the input is left as it was


class TestDiff:
    def test_no_op_is_falsy(self):
        want = [PeerSpec(K_A, ("10.213.0.2/32",), "198.51.100.2:40000")]
        d = diff([state(K_A, hs=NOW - 5)], want, NOW)
        assert d == PeerDiff()
        assert not d
        assert wg_set_args(d) == []

    def test_empty_diff_is_falsy_and_non_empty_truthy(self):
        assert not PeerDiff()
        assert PeerDiff(remove=(K_A,))
        assert PeerDiff(add=(PeerSpec(K_A, ()),))
        assert PeerDiff(update=(PeerSpec(K_A, ()),))

    def test_add_and_remove(self):
        want = [
            PeerSpec(K_B, ("10.213.0.3/32",), None, 25, "gpu-b"),
            PeerSpec(K_A, ("10.213.0.2/32",), "198.51.100.2:40000", 25, "gpu-a"),
        ]
        d = diff([state(K_C, ips=("10.213.0.9/32",))], want, NOW)
        assert d.add == (want[1], want[0])  # sorted by key: "omj..." < "xTI..."
        assert d.update == ()
        assert d.remove == (K_C,)
        assert d

    def test_remove_sorted(self):
        d = diff([state(K_B), state(K_A), state(K_C)], [], NOW)
        assert d.remove == (K_C, K_A, K_B)

    def test_endpoint_kept_while_handshake_fresh(self):
        cur = [state(K_A, endpoint="198.51.100.9:5555", hs=NOW - (HANDSHAKE_FRESH_S - 1))]
        want = [PeerSpec(K_A, ("10.213.0.2/32",), "198.51.100.2:40000")]
        assert not diff(cur, want, NOW)

    def test_endpoint_replaced_when_stale(self):
        cur = [state(K_A, endpoint="198.51.100.9:5555", hs=NOW - HANDSHAKE_FRESH_S)]
        want = [PeerSpec(K_A, ("10.213.0.2/32",), "198.51.100.2:40000", 25, "gpu-a")]
        assert diff(cur, want, NOW) == PeerDiff(update=(want[0],))

    def test_endpoint_replaced_when_never_handshaken(self):
        cur = [state(K_A, endpoint="198.51.100.9:5555", hs=0)]
        want = [PeerSpec(K_A, ("10.213.0.2/32",), "198.51.100.2:40000")]
        assert diff(cur, want, NOW).update[0].endpoint == "198.51.100.2:40000"

    def test_endpoint_set_when_unknown_even_if_fresh(self):
        cur = [state(K_A, endpoint=None, hs=NOW - 1)]
        want = [PeerSpec(K_A, ("10.213.0.2/32",), "198.51.100.2:40000")]
        assert diff(cur, want, NOW).update == (want[0],)

    def test_desired_without_endpoint_keeps_roamed_one(self):
        cur = [state(K_A, endpoint="198.51.100.9:5555", hs=0)]
        assert not diff(cur, [PeerSpec(K_A, ("10.213.0.2/32",), None)], NOW)

    def test_allowed_ips_change_keeps_fresh_endpoint(self):
        cur = [state(K_A, endpoint="198.51.100.9:5555", hs=NOW - 1)]
        want = [PeerSpec(K_A, ("10.213.0.2/32", "10.213.5.0/24"), "198.51.100.2:40000", 25, "gpu-a")]
        d = diff(cur, want, NOW)
        # The update carries no endpoint, so `wg set` leaves the live one alone.
        assert d == PeerDiff(update=(PeerSpec(K_A, ("10.213.0.2/32", "10.213.5.0/24"), None, 25, "gpu-a"),))

    def test_allowed_ips_order_does_not_matter(self):
        cur = [state(K_A, ips=("10.213.0.2/32", "10.213.5.0/24"))]
        want = [PeerSpec(K_A, ("10.213.5.0/24", "10.213.0.2/32"), "198.51.100.2:40000")]
        assert not diff(cur, want, NOW)

    def test_keepalive_change(self):
        cur = [state(K_A, ka=0)]
        want = [PeerSpec(K_A, ("10.213.0.2/32",), "198.51.100.2:40000", 25)]
        assert diff(cur, want, NOW) == PeerDiff(update=(PeerSpec(K_A, ("10.213.0.2/32",), None, 25),))


class TestWgSetArgs:
    def test_exact_list(self):
        d = PeerDiff(
            add=(PeerSpec(K_A, ("10.213.0.2/32",), "198.51.100.2:40000", 25, "gpu-a"),),
            update=(PeerSpec(K_B, ("10.213.0.3/32", "10.213.7.0/24"), None, 0, "gpu-b"),),
            remove=(K_C,),
        )
        assert wg_set_args(d) == [
            "peer",
            K_C,
            "remove",
            "peer",
            K_A,
            "endpoint",
            "198.51.100.2:40000",
            "persistent-keepalive",
            "25",
            "allowed-ips",
            "10.213.0.2/32",
            "peer",
            K_B,
            "persistent-keepalive",
            "off",
            "allowed-ips",
            "10.213.0.3/32,10.213.7.0/24",
        ]

    def test_from_diff_end_to_end(self):
        cur = [state(K_A, endpoint=None), state(K_C)]
        d = diff(cur, desired_for_node(K_COORD, MEMBERS), NOW)
        assert wg_set_args(d) == [
            "peer",
            K_C,
            "remove",
            "peer",
            K_B,
            "persistent-keepalive",
            "off",
            "allowed-ips",
            "10.213.0.3/32",
            "peer",
            K_A,
            "endpoint",
            "198.51.100.2:40000",
            "persistent-keepalive",
            "25",
            "allowed-ips",
            "10.213.0.2/32",
        ]


def test_route_mtus_fit_the_smaller_peers_with_wireguard_padding():
    from meshrun.core.peers import route_mtus

    me = Member("big", "K" * 43 + "=", "10.213.0.3", mtu=1420)
    small = Member("small", "S" * 43 + "=", "10.213.0.2", mtu=1220)
    same = Member("same", "T" * 43 + "=", "10.213.0.4", mtu=1420)
    old = Member("old", "U" * 43 + "=", "10.213.0.5")  # an agent that reports no MTU
    # 1220 rounds down to 1216: a 1217..1220-byte packet would be padded to 1232 with our MTU of 1420.
    assert route_mtus(me.public_key, 1420, [me, small, same, old]) == {"10.213.0.2": 1216}
    assert route_mtus(small.public_key, 1220, [me, small, same, old]) == {}  # larger peers: no route


def test_pair_mtus_raise_the_interface_for_jumbo_pairs_and_keep_every_other_peer_at_its_own():
    from meshrun.core.peers import jumbo_candidates, pair_mtus

    me = Member("me", "K" * 43 + "=", "10.213.0.3", mtu=1420)
    lan = Member("lan", "L" * 43 + "=", "10.213.0.2", mtu=1420, path="private")
    lan2 = Member("lan2", "M" * 43 + "=", "10.213.0.6", mtu=1420, path="private")
    wan = Member("wan", "W" * 43 + "=", "10.213.0.4", mtu=1420, path="public")
    small = Member("small", "S" * 43 + "=", "10.213.0.5", mtu=1220, path="public")
    everyone = [me, lan, lan2, wan, small]
    assert jumbo_candidates(me.public_key, everyone, 8940, 1420) == {"10.213.0.2", "10.213.0.6"}
    assert jumbo_candidates(me.public_key, everyone, 1440, 1440) == frozenset()  # the LAN carries no more
    # Nothing jumbo: as before (the interface at our MTU, routes for smaller peers only).
    assert pair_mtus(me.public_key, 1420, everyone, {}) == (1420, {"10.213.0.5": 1216})
    # Raised while pairs are probed: every peer keeps its own size (padding-rounded) as a /32 route.
    probing = {"10.213.0.2": 1408, "10.213.0.6": 1408, "10.213.0.4": 1408, "10.213.0.5": 1216}
    assert pair_mtus(me.public_key, 1420, everyone, {}, 8940) == (8940, probing)
    # One proven: its route goes (it uses the interface's MTU); the one still probed keeps its route.
    proven = {k: v for k, v in probing.items() if k != "10.213.0.2"}
    assert pair_mtus(me.public_key, 1420, everyone, {"10.213.0.2": 8940}, 8940) == (8940, proven)


def test_a_handshake_report_holds_news_of_liveness_only():
    from meshrun.core.peers import HANDSHAKE_FRESH_S, handshake_report

    now = 1_700_000_000.0
    told: dict[str, bool] = {}
    first = handshake_report({"a": int(now) - 5, "b": 0}, told, False, now)
    assert first.peers == {"a": int(now) - 5, "b": 0} and first.stale == ("b",)  # never told: both
    told.update(a=True, b=False)
    # WireGuard rekeyed "a" (a newer handshake, still fresh): nothing to tell.
    assert handshake_report({"a": int(now) + 115, "b": 0}, told, False, now + 120).peers == {}
    # "b" came up, "a" went stale (its last handshake aged past the limit): both reported, "a" as stale.
    later = now + 120 + HANDSHAKE_FRESH_S
    r = handshake_report({"a": int(now) + 115, "b": int(later) - 1}, told, False, later)
    assert r.peers == {"a": int(now) + 115, "b": int(later) - 1} and r.stale == ("a",)
    # A full report holds every peer; a peer dropped from `told` (re-created for a new path) is told again.
    assert handshake_report({"a": 1, "b": 2}, {"a": False, "b": False}, True, later).peers == {"a": 1, "b": 2}
    assert handshake_report({"a": int(later)}, {}, False, later).peers == {"a": int(later)}


def test_a_relayed_peer_stays_a_peer_of_its_own_at_its_relays_port_and_its_mtu_fits_both_hops():
    """End to end through a relay: the relayed peer's entry admits its own address only, at the relay's host
    (as this node reaches the relay) and the pair's port; the relay's entry admits the relay alone."""
    from meshrun.core.peers import desired_for_node, route_mtus

    def m(i, **kw):
        return Member(f"n{i}", f"{i:042d}A=", f"10.213.0.{i + 1}", f"198.51.100.{i}:51820", (), **kw)

    coord = m(0, is_coordinator=True)
    me, relay = m(1), m(2, path="public", mtu=1380)
    far = m(3, path="relayed", mtu=1420, via=f"{2:042d}A=", via_port=51822)
    other = m(4, path="relayed", via_port=51821)  # no relay named: the coordinator
    specs = {s.name: s for s in desired_for_node(me.public_key, [coord, me, relay, far, other])}
    assert specs["n2"].allowed_ips == ("10.213.0.3/32",) and specs["n2"].endpoint == "198.51.100.2:51820"
    assert specs["n3"].allowed_ips == ("10.213.0.4/32",)
    assert specs["n3"].endpoint == "198.51.100.2:51822" and specs["n3"].pinned and specs["n3"].keepalive
    assert specs["n4"].endpoint == "198.51.100.0:51821" and specs["n0"].allowed_ips == ("10.213.0.1/32",)
    assert not specs["n2"].pinned
    # n3's datagrams cross the relay's 1380-byte path too.
    assert route_mtus(me.public_key, 1420, [coord, me, relay, far, other]) == {"10.213.0.3": 1376, "10.213.0.4": 1376}
    # A relay this node itself reaches only through a relay is not used: the coordinator carries n3.
    indirect = Member(**{**relay.__dict__, "path": "relayed"})
    specs = {s.name: s for s in desired_for_node(me.public_key, [coord, me, indirect, far])}
    assert specs["n3"].endpoint == "198.51.100.0:51822"
    # No port yet (an older coordinator, or none free): no endpoint, no keepalive, still only its own address.
    portless = Member(**{**far.__dict__, "via_port": 0})
    spec = {s.name: s for s in desired_for_node(me.public_key, [coord, me, relay, portless])}["n3"]
    assert spec.endpoint is None and spec.keepalive == 0 and spec.allowed_ips == ("10.213.0.4/32",)


def test_a_relay_endpoint_replaces_a_live_tunnels_endpoint_and_a_roamed_one():
    """A pinned endpoint (a relay's port) is set over a fresh handshake: the session goes on through the new
    relay at once; an unpinned one is left to the live tunnel."""
    from meshrun.core.peers import PeerSpec, PeerState, diff

    now = 1_000_000.0
    have = [PeerState("K", "203.0.113.9:40000", ("10.213.0.4/32",), int(now) - 5, 0, 0, 25)]
    pinned = PeerSpec("K", ("10.213.0.4/32",), "198.51.100.2:51822", 25, "n3", pinned=True)
    assert [u.endpoint for u in diff(have, [pinned], now).update] == ["198.51.100.2:51822"]
    loose = PeerSpec("K", ("10.213.0.4/32",), "198.51.100.3:51820", 25, "n3")
    assert not diff(have, [loose], now)


MEMBER = st.builds(
    lambda i, coord, path, via, port, endpoint, relay: (i, coord, path, via, port, endpoint, relay),
    st.integers(0, 7),
    st.booleans(),
    st.sampled_from(["", "private", "public", "relayed"]),
    st.integers(-1, 7),
    st.sampled_from([0, 51821, 51822]),
    st.booleans(),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(MEMBER, min_size=2, max_size=8, unique_by=lambda t: t[0]))
def test_every_peer_set_admits_each_peer_s_own_address_only(rows):
    """The overlay's invariant, over any member list the coordinator can hand out (paths, relays named or not,
    relays that are themselves relayed, ports or none, coordinators or none): on every member, node or
    coordinator, each WireGuard peer admits exactly its own /32, so no tunnel, a relay's included, ever
    carries another member's address."""
    from meshrun.core.peers import check_own_addresses, desired_for_coordinator, desired_for_node

    keys = {i: f"{i:042d}A=" for i, *_ in rows}
    members = [
        Member(
            f"n{i}",
            keys[i],
            f"10.213.0.{i + 1}",
            f"198.51.100.{i}:51820" if endpoint else None,
            (),
            is_coordinator=coord,
            path=path,
            via=keys.get(via, ""),
            via_port=port,
            relay=relay,
        )
        for i, coord, path, via, port, endpoint, relay in rows
    ]
    for me in members:
        specs = desired_for_node(me.public_key, members)
        check_own_addresses(specs, members)
        assert {s.public_key for s in specs} == {m.public_key for m in members} - {me.public_key}
        check_own_addresses(desired_for_coordinator(members, me.public_key), members)


def test_the_invariant_check_names_a_peer_that_would_carry_another_members_address():
    from meshrun.core.peers import PeerSpec, check_own_addresses

    members = [Member("a", f"{1:042d}A=", "10.213.0.2"), Member("b", f"{2:042d}A=", "10.213.0.3")]
    check_own_addresses([PeerSpec(f"{1:042d}A=", ("10.213.0.2/32",), name="a")], members)
    with pytest.raises(ValueError, match=r"peer a would admit 10\.213\.0\.2/32, 10\.213\.0\.3/32"):
        check_own_addresses([PeerSpec(f"{1:042d}A=", ("10.213.0.2/32", "10.213.0.3/32"), name="a")], members)


def test_a_peer_is_re_created_when_its_path_changes_and_kept_otherwise():
    """A new path needs a fresh handshake to prove it; a first assignment keeps a working tunnel, but for the
    private path; a relayed pair moving to another relay keeps its session (its datagrams latch it there)."""
    from dataclasses import replace

    a = MEMBERS[1]
    relayed = replace(a, path="relayed", via=K_C, via_port=51821)
    assert to_recreate([replace(a, path="public")], [relayed]) == {K_A}  # public -> relayed
    assert to_recreate([relayed], [replace(relayed, path="public")]) == {K_A}  # relayed -> direct again
    assert to_recreate([relayed], [replace(relayed, via=K_B, via_port=51822)]) == frozenset()  # another relay
    assert to_recreate([replace(a, path="")], [replace(a, path="public")]) == frozenset()  # first: kept
    assert to_recreate([replace(a, path="")], [replace(a, path="private")]) == {K_A}
    assert to_recreate([], [relayed]) == frozenset()  # a new member: made, not re-created
