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


def sited(m: Member, site: str) -> Member:
    return Member(m.name, m.public_key, m.overlay_ip, m.endpoint, m.candidates, site=site)


def test_a_declared_site_is_one_lan_even_when_each_end_has_its_own_public_ip():
    """The cloud's usual VPC: each node with its own elastic IP, both joined with --site fra. Without the site the
    pair went public (through the internet gateway and back); with it, private, dialled at the LAN address."""
    assert not pairpaths.same_site(A, B)  # the old rule's answer for this pair
    a, b = sited(A, "fra"), sited(B, "fra")
    assert pairpaths.shares_lan(a, b) and pairpaths.same_site(a, b)
    assert pairpaths.initial(a, b, 0, T0).mode == pairpaths.PRIVATE
    assert pairpaths.endpoint_for(pairpaths.PRIVATE, b) == "172.31.40.47:51820"
    # Declared sites only when both declared one: one end without a site is judged by the public IP alone.
    assert not pairpaths.same_site(a, B) and pairpaths.same_site(sited(A_LAN, "fra"), B_LAN)
    # A site's pairs that cannot reach each other on the LAN fall back to public after the attempt window.
    st = pairpaths.step(pairpaths.initial(a, b, 0, T0), a, b, 0, T0 + pairpaths.ATTEMPT_S)
    assert st == pairpaths.PairState(pairpaths.PUBLIC, T0 + pairpaths.ATTEMPT_S)


def test_two_declared_sites_never_dial_each_others_private_address():
    """Private ranges repeat across datacenters: fra's 172.31.40.46 and ber's are different machines. Even behind
    one public address (a CGNAT shared by two datacenters) two declared sites are not one LAN, and a relayed pair
    of them that tries direct again tries public."""
    a, b = sited(A, "fra"), sited(member("b", K_B, "198.51.100.3:40001", ["172.31.40.46:51820"]), "ber")
    assert not pairpaths.shares_lan(a, b) and not pairpaths.same_site(a, b)
    assert pairpaths.initial(a, b, 0, T0).mode == pairpaths.PUBLIC
    assert not pairpaths.same_site(sited(A_LAN, "fra"), sited(B_LAN, "ber"))  # one public IP, two sites
    relayed = pairpaths.PairState(pairpaths.RELAYED, T0, True, "r", 51821, tries=1)
    assert pairpaths.step(relayed, a, b, 0, T0 + pairpaths.RETRY_MIN_S).mode == pairpaths.PUBLIC


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
    assert pairpaths.step(pairpaths.PairState(pairpaths.PUBLIC, T0), A, B, 0, T0 + 10).tries == 1  # a failed try


def test_a_relayed_pairs_handshake_proves_the_relayed_path_not_a_direct_one():
    """Its handshakes cross the relay: one after the relay began verifies the relayed path, none moves it
    before its next direct try is due."""
    relayed = pairpaths.PairState(pairpaths.RELAYED, T0, relay="r", port=51821, tries=1)
    due = T0 + pairpaths.RETRY_MIN_S
    assert pairpaths.next_due(relayed, 0) == due
    assert pairpaths.step(relayed, A, B, int(T0) - 1, T0 + 50) == relayed  # nothing new
    proven = pairpaths.PairState(pairpaths.RELAYED, T0, True, "r", 51821, tries=1)
    assert pairpaths.step(relayed, A, B, int(T0) + 30, T0 + 50) == proven
    assert pairpaths.step(proven, A, B, int(T0) + 30, due - 1) == proven  # stale or not: the relay's probes say
    assert pairpaths.next_due(proven, int(T0) + 30) == due


def test_a_relayed_pair_tries_direct_again_later_each_time_it_fails():
    """The first failed attempt is tried again within a minute (a lost handshake, a slow end), the later ones after
    RETRY_S, then 2 x; after MAX_TRIES the pair stays relayed; a try that works forgets the failures; a same-site
    pair tries its private path first."""
    st = pairpaths.PairState(pairpaths.PUBLIC, T0)
    waits = []
    now = T0
    for _ in range(pairpaths.MAX_TRIES - 1):
        now = st.since + pairpaths.ATTEMPT_S
        st = pairpaths.step(st, A, B, 0, now)  # the window closed without a handshake
        assert st.mode == pairpaths.RELAYED
        due = pairpaths.next_due(st, 0)
        assert pairpaths.step(st, A, B, 0, due - 0.5) == st
        waits.append(due - st.since)
        now = due
        st = pairpaths.step(st, A, B, 0, now)
        assert st == pairpaths.PairState(pairpaths.PUBLIC, now, tries=len(waits))
    assert waits == [60.0, 900.0, 1800.0]
    last = pairpaths.step(st, A, B, 0, now + pairpaths.ATTEMPT_S)
    assert (last.mode, last.tries) == (pairpaths.RELAYED, pairpaths.MAX_TRIES)
    assert pairpaths.next_due(last, 0) is None and pairpaths.step(last, A, B, 0, now + 10**6) == last
    worked = pairpaths.step(st, A, B, int(now) + 1, now + 2)
    assert worked == pairpaths.PairState(pairpaths.PUBLIC, now, True)  # tries forgotten
    lan = pairpaths.PairState(pairpaths.RELAYED, T0, True, "r", 51821, tries=2)
    again = pairpaths.step(lan, A_LAN, B_LAN, 0, T0 + 2 * pairpaths.RETRY_S)
    assert again == pairpaths.PairState(pairpaths.PRIVATE, T0 + 2 * pairpaths.RETRY_S, tries=2)
    # private failed -> public (still the same attempt) -> relayed with one more failure
    st = pairpaths.step(again, A_LAN, B_LAN, 0, again.since + pairpaths.ATTEMPT_S)
    assert (st.mode, st.tries) == (pairpaths.PUBLIC, 2)
    st = pairpaths.step(st, A_LAN, B_LAN, 0, st.since + pairpaths.ATTEMPT_S)
    assert (st.mode, st.tries) == (pairpaths.RELAYED, 3)


def test_a_direct_tunnel_gone_stale_is_relayed_then_tried_again_within_a_minute():
    verified = pairpaths.PairState(pairpaths.PUBLIC, T0, True)
    later = T0 + pairpaths.STALE_S + 1
    relayed = pairpaths.step(verified, A, B, int(T0), later)
    assert relayed == pairpaths.PairState(pairpaths.RELAYED, later, tries=0)
    assert pairpaths.next_due(relayed, int(T0)) == later + pairpaths.RETRY_MIN_S


def test_the_attempt_window_opens_when_both_ends_have_applied_the_path():
    """`started` None (an end has not applied the new path: stopped, overloaded, offline) keeps an unproven
    path, however long; once given, the window runs ATTEMPT_S from it."""
    st = pairpaths.PairState(pairpaths.PUBLIC, T0)
    assert pairpaths.step(st, A, B, 0, T0 + 3600, started=None) == st
    assert pairpaths.next_due(st, 0, started=None) is None
    opened = T0 + 40
    assert pairpaths.next_due(st, 0, started=opened) == opened + pairpaths.ATTEMPT_S
    assert pairpaths.step(st, A, B, 0, opened + pairpaths.ATTEMPT_S - 0.1, started=opened) == st
    assert pairpaths.step(st, A, B, 0, opened + pairpaths.ATTEMPT_S, started=opened).mode == pairpaths.RELAYED
    # A handshake verifies it whether or not the window opened.
    assert pairpaths.step(st, A, B, int(T0) + 5, T0 + 6, started=None).verified


def test_state_records_round_trip_and_old_records_have_no_tries():
    st = pairpaths.PairState(pairpaths.RELAYED, T0, True, "r", 51821, tries=3)
    assert st.record()["tries"] == 3 and pairpaths.PairState.from_record(st.record()) == st
    assert "tries" not in pairpaths.PairState(pairpaths.PUBLIC, T0).record()
    old = {"mode": "relayed", "since": T0, "verified": True, "relay": "r", "port": 51821}
    assert pairpaths.PairState.from_record(old).tries == 0


def test_endpoint_for_each_mode_and_pair_key_order():
    assert pairpaths.endpoint_for(pairpaths.PRIVATE, B_LAN) == "172.31.40.47:51820"
    assert pairpaths.endpoint_for(pairpaths.PUBLIC, B_LAN) == "198.51.100.9:40002"
    assert pairpaths.endpoint_for(pairpaths.RELAYED, B) == "198.51.100.3:40001"
    assert pairpaths.pair_key("b", "a") == pairpaths.pair_key("a", "b") == ("a", "b")
    assert pairpaths.host_of("[2001:db8::1]:51820") == "2001:db8::1" and pairpaths.host_of(None) is None


def test_a_test_may_shorten_the_first_retry_only_and_never_lengthen_it(monkeypatch):
    """RETRY_MIN_ENV (an e2e world's processes) shortens the first retry; later ones, and a bad or longer value,
    keep the real timers."""
    relayed = pairpaths.PairState(pairpaths.RELAYED, T0, relay="r", port=51821, tries=1)
    monkeypatch.setenv(pairpaths.RETRY_MIN_ENV, "15")
    assert pairpaths.retry_delay(1) == 15 and pairpaths.next_due(relayed, 0) == T0 + 15
    assert pairpaths.step(relayed, A, B, 0, T0 + 15).mode == pairpaths.PUBLIC  # tried again at 15 s
    assert pairpaths.retry_delay(2) == pairpaths.RETRY_S
    for bad in ("600", "soon", ""):
        monkeypatch.setenv(pairpaths.RETRY_MIN_ENV, bad)
        assert pairpaths.retry_delay(1) == pairpaths.RETRY_MIN_S == 60, bad
