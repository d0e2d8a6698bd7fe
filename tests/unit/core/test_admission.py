"""meshrun.core.admission: who may enrol, as one pure decision (each rule, and which one wins)."""

from __future__ import annotations

import pytest

from meshrun.core.admission import (
    PENDING_GRACE_S,
    PENDING_PER_TOKEN,
    Admission,
    MemberFacts,
    TokenFacts,
    admit,
)
from meshrun.errors import StateError, TokenError

NOW = 1_000_000.0
KEY, OTHER = "k" * 43 + "=", "o" * 43 + "="


def token(**kw) -> TokenFacts:
    base = dict(secret_ok=True, created_at=NOW - 3600, expires_at=NOW + 3600, max_uses=None, uses=0, revoked=False)
    return TokenFacts(**{**base, **kw})


def decide(tok=None, name="node1", key=KEY, related=(), removed_at=None, pending=0, held=0, size=1000):
    return admit(NOW, token() if tok is None else tok, name, key, related, removed_at, pending, held, size)


def test_a_good_token_admits_a_new_node():
    assert decide() == Admission()


@pytest.mark.parametrize(
    "tok, words",
    [
        (None, "does not know this join token"),
        (token(secret_ok=False), "does not know this join token"),  # same answer: no oracle for ids
        (token(revoked=True), "revoked"),
        (token(expires_at=NOW), "expired"),
        (token(max_uses=1, uses=1), "used up (1 of 1 uses)"),
    ],
)
def test_a_bad_token_is_refused_with_the_fix(tok, words):
    with pytest.raises(TokenError) as exc:
        admit(NOW, tok, "node1", KEY, (), None, 0, 0, 1000)
    assert words in exc.value.message and "meshrun token create" in exc.value.fix


def test_a_used_up_token_is_refused_even_for_the_member_it_enrolled():
    """The finding of the security review: a used-up token and a member's public key returned that member."""
    me = MemberFacts("node1", KEY, joined_at=NOW - 60, synced=True)
    assert decide(related=[me]) == Admission(existing=KEY)  # a retry with a live token: the same member
    with pytest.raises(TokenError, match="used up"):
        decide(tok=token(max_uses=1, uses=1), related=[me])
    with pytest.raises(TokenError, match="revoked"):
        decide(tok=token(revoked=True), related=[me])


def test_a_key_is_one_member_and_a_removed_key_never_comes_back():
    with pytest.raises(StateError, match="already enrolled as member 'other'"):
        decide(related=[MemberFacts("other", KEY, joined_at=NOW - 60, synced=True)])
    with pytest.raises(StateError, match="removed member") as exc:
        decide(related=[MemberFacts("node1", KEY, joined_at=NOW - 60, removed_at=NOW - 10)])
    assert "leave --purge" in exc.value.fix


def test_a_name_is_not_taken_from_a_live_member_or_from_a_node_that_is_joining():
    with pytest.raises(StateError, match="already taken"):
        decide(related=[MemberFacts("node1", OTHER, joined_at=NOW - 9999, synced=True)])
    with pytest.raises(StateError, match="already taken"):
        decide(name="hq", related=[MemberFacts("hq", OTHER, joined_at=0, is_coordinator=True)])
    with pytest.raises(StateError, match="joining right now") as exc:
        decide(related=[MemberFacts("node1", OTHER, joined_at=NOW - 10)])
    assert "wait 110 s" in exc.value.fix


def test_a_join_that_never_completed_gives_its_name_up_after_the_grace():
    stale = MemberFacts("node1", OTHER, joined_at=NOW - PENDING_GRACE_S - 1)
    assert decide(related=[stale]) == Admission(release=(OTHER,))


def test_removal_is_final_for_tokens_made_before_it_and_not_for_later_ones():
    with pytest.raises(TokenError, match="removed from the network after this token was made"):
        decide(removed_at=NOW - 60)  # the token was made an hour ago
    assert decide(tok=token(created_at=NOW - 30), removed_at=NOW - 60) == Admission()


def test_one_token_cannot_pile_up_pending_enrolments_or_hold_more_than_half_the_range():
    with pytest.raises(TokenError, match="never completed"):
        decide(pending=PENDING_PER_TOKEN)
    stale = MemberFacts("node1", OTHER, joined_at=NOW - PENDING_GRACE_S - 1)
    assert decide(pending=PENDING_PER_TOKEN, related=[stale]).release == (OTHER,)  # the released one counts
    assert decide(held=499, size=1000) == Admission()
    with pytest.raises(TokenError, match="500 of the overlay's 1000 addresses"):
        decide(held=500, size=1000)


def test_the_token_is_judged_before_anything_about_names_and_keys():
    """A used-up token learns nothing: not whether the name is taken, not whether the key is known."""
    related = [MemberFacts("node1", OTHER, joined_at=NOW - 60, synced=True), MemberFacts("x", KEY, joined_at=0)]
    with pytest.raises(TokenError, match="used up"):
        decide(tok=token(max_uses=3, uses=3), related=related)
