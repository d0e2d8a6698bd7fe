"""meshrun.core.pairpaths: the per-pair path state machine (pure)."""

from __future__ import annotations

from meshrun.core import pairpaths
from meshrun.core.model import Member

K_A = "omjXDyOxNCkYbimc/y3YipnkEnnasAyCC8uW60+7wVU="
K_B = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg="
T0 = 1_700_000_000.0


def member(name, key, endpoint, candidates=()):
    return Member(name, key, "10.213.0.2" if name == "a" else "10.213.0.3", endpoint, tuple(candidates))


A = member("a", K_A, "198.51.100.2:40000", ["172.31.40.46:51820"])
B = member("b", K_B, "198.51.100.3:40001", ["172.31.40.47:51820"])
# Behind one public address, both with a LAN candidate: one VPC.
A_LAN = member("a", K_A, "198.51.100.9:40000", ["172.31.40.46:51820"])
B_LAN = member("b", K_B, "198.51.100.9:40002", ["172.31.40.47:51820"])


def test_same_site_needs_one_public_ip_and_both_lan_candidates():
    assert pairpaths.same_site(A_LAN, B_LAN)
    assert not pairpaths.same_site(A, B)
    assert not pairpaths.same_site(A_LAN, member("b", K_B, "198.51.100.9:40002"))  # no LAN candidate
    assert not pairpaths.same_site(A_LAN, member("b", K_B, None, ["172.31.40.47:51820"]))  # not observed yet


def test_initial_mode_private_for_one_site_else_public_and_a_fresh_handshake_is_proof():
    assert pairpaths.initial(A_LAN, B_LAN, 0, T0) == pairpaths.PairState(pairpaths.PRIVATE, T0)
    assert pairpaths.initial(A, B, 0, T0) == pairpaths.PairState(pairpaths.PUBLIC, T0)
    # After a coordinator restart without saved state a working tunnel is kept, not probed again.
    assert pairpaths.initial(A, B, int(T0) - 30, T0) == pairpaths.PairState(pairpaths.PUBLIC, T0, verified=True)
    assert pairpaths.initial(A, B, int(T0) - pairpaths.STALE_S - 1, T0).verified is False


def test_attempt_window_then_fall_back_one_step_at_a_time():
    st = pairpaths.initial(A_LAN, B_LAN, 0, T0)
    assert pairpaths.step(st, A_LAN, B_LAN, 0, T0 + pairpaths.ATTEMPT_S - 0.1) == st  # still trying
    st = pairpaths.step(st, A_LAN, B_LAN, 0, T0 + pairpaths.ATTEMPT_S)
    assert st == pairpaths.PairState(pairpaths.PUBLIC, T0 + pairpaths.ATTEMPT_S)
    st = pairpaths.step(st, A_LAN, B_LAN, 0, T0 + 2 * pairpaths.ATTEMPT_S)
    assert st.mode == pairpaths.RELAYED


def test_a_handshake_after_the_mode_change_verifies_it_and_an_older_one_does_not():
    st = pairpaths.PairState(pairpaths.PUBLIC, T0)
    assert pairpaths.step(st, A, B, int(T0) - 5, T0 + 1) == st  # from before the change
    assert pairpaths.step(st, A, B, int(T0), T0 + 1) == pairpaths.PairState(
        pairpaths.PUBLIC, T0, True
    )  # same second counts
    verified = pairpaths.PairState(pairpaths.PUBLIC, T0, True)
    assert pairpaths.step(verified, A, B, int(T0) + 100, T0 + 100 + pairpaths.ATTEMPT_S * 5) == verified


def test_a_verified_pair_whose_tunnel_goes_stale_falls_back():
    verified = pairpaths.PairState(pairpaths.PUBLIC, T0, True)
    later = T0 + pairpaths.STALE_S + 1
    assert pairpaths.step(verified, A, B, int(T0), later) == pairpaths.PairState(pairpaths.RELAYED, later)


def test_a_relayed_pairs_handshake_proves_the_relayed_path_and_it_stays_relayed():
    """Its handshakes cross the relay: one after the relay began verifies the relayed path, none moves it."""
    relayed = pairpaths.PairState(pairpaths.RELAYED, T0, relay="r", port=51821)
    assert pairpaths.step(relayed, A, B, int(T0) - 1, T0 + 50) == relayed  # nothing new
    proven = pairpaths.PairState(pairpaths.RELAYED, T0, True, "r", 51821)
    assert pairpaths.step(relayed, A, B, int(T0) + 30, T0 + 50) == proven
    assert pairpaths.step(proven, A, B, int(T0) + 30, T0 + 5000) == proven  # stale or not: the relay's probes say
    assert pairpaths.next_due(proven, int(T0) + 30) is None


def test_endpoint_for_each_mode_and_pair_key_order():
    assert pairpaths.endpoint_for(pairpaths.PRIVATE, B_LAN) == "172.31.40.47:51820"
    assert pairpaths.endpoint_for(pairpaths.PUBLIC, B_LAN) == "198.51.100.9:40002"
    assert pairpaths.endpoint_for(pairpaths.RELAYED, B) == "198.51.100.3:40001"
    assert pairpaths.pair_key("b", "a") == pairpaths.pair_key("a", "b") == ("a", "b")
    assert pairpaths.host_of("[2001:db8::1]:51820") == "2001:db8::1" and pairpaths.host_of(None) is None
