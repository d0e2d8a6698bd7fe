"""Who may enrol: the coordinator's admission rules as one pure decision.

The coordinator's database gathers the facts (the token's row, the members and removals that share
the name or the key, how many of the token's enrolments are still pending) in one transaction and
asks `admit`; it then only carries the decision out. The node has already proved, before this, that
it holds the private key of the public key it presents (meshrun.core.auth.enrol_proof), so a key
is never enrolled, or an enrolment returned, to anyone else.

Rules, in order (the first that applies decides):
1. an unknown token, or a wrong secret: refused, with the same answer (no oracle for valid ids);
2. a revoked, expired or used-up token: refused, whatever else is presented (a node that is already a
   member resumes from its own state and never needs its token again);
3. the key is an active member's: that member again under the same name (a retry after a lost
   answer), refused under another name;
4. the key belonged to a removed member: refused for ever;
5. the name is an active member's: refused, unless that enrolment never completed (its node never
   synced over the overlay) and is older than PENDING_GRACE_S, when it is released; a younger
   pending one is refused too, so a token holder cannot take the name of a node that is joining;
6. the name was removed after the token was created: refused (removal is final for every token
   issued before it; the operator issues a new one);
7. the token has PENDING_PER_TOKEN enrolments that have not completed yet, or already holds its
   share of the overlay range (TOKEN_SHARE_OF_RANGE): refused, so one token cannot exhaust the
   addresses (the database also expires enrolments still pending after PENDING_GRACE_S).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshrun.errors import StateError, TokenError

__all__ = [
    "TokenFacts",
    "MemberFacts",
    "Admission",
    "admit",
    "PENDING_GRACE_S",
    "PENDING_PER_TOKEN",
    "TOKEN_SHARE_OF_RANGE",
    "FIX_NEW_TOKEN",
]

PENDING_GRACE_S = 120.0  # a join's own bring-up takes at most ~60 s (its daemon must be ready in 45 s)
PENDING_PER_TOKEN = 256  # a mass start joins hundreds at once; each completes within seconds
TOKEN_SHARE_OF_RANGE = 0.5
FIX_NEW_TOKEN = "ask the coordinator's operator for a new token (`meshrun token create`)"


@dataclass(frozen=True)
class TokenFacts:
    """A token's row (None of these is the secret)."""

    secret_ok: bool
    created_at: float
    expires_at: float
    max_uses: int | None
    uses: int
    revoked: bool


@dataclass(frozen=True)
class MemberFacts:
    """A member (active or removed) that shares the name or the key of the enrolment."""

    name: str
    public_key: str
    joined_at: float
    removed_at: float | None = None
    synced: bool = False  # its node has synced over the overlay at least once
    is_coordinator: bool = False


@dataclass(frozen=True)
class Admission:
    """What to do: return `existing` (a retry), or create the member after releasing `release` (keys
    of pending enrolments whose name is taken over)."""

    existing: str | None = None  # the public key of the member to return as is
    release: tuple[str, ...] = field(default_factory=tuple)


def admit(
    now: float,
    token: TokenFacts | None,
    name: str,
    public_key: str,
    related: Sequence[MemberFacts],
    name_removed_at: float | None,
    pending_of_token: int,
    held_by_token: int,
    range_size: int,
) -> Admission:
    """Decide an enrolment (see the module docstring); TokenError or StateError with the reason and fix.

    `related`: active and removed members with this name or this key; `name_removed_at`: when a
    member of this name was last removed (None: never); `pending_of_token` / `held_by_token`: the
    token's enrolments that never completed / that are active; `range_size`: usable overlay addresses.
    """
    if token is None or not token.secret_ok:
        raise TokenError("the coordinator does not know this join token (wrong network, or deleted)", FIX_NEW_TOKEN)
    if token.revoked:
        raise TokenError("this join token has been revoked", FIX_NEW_TOKEN)
    if now >= token.expires_at:
        raise TokenError("this join token has expired", FIX_NEW_TOKEN)
    if token.max_uses is not None and token.uses >= token.max_uses:
        raise TokenError(f"this join token is used up ({token.max_uses} of {token.max_uses} uses)", FIX_NEW_TOKEN)
    release: list[str] = []
    for m in related:
        if m.public_key == public_key:
            if m.removed_at is not None:
                raise StateError(
                    "this node's key belonged to a removed member and cannot join again",
                    "run `meshrun leave --purge` on the node to make a new identity, then join",
                )
            if m.name == name:
                return Admission(existing=public_key)
            raise StateError(
                f"this node's key is already enrolled as member {m.name!r}",
                f"join again with --name {m.name}, or `meshrun leave --purge` for a new identity",
            )
    for m in related:
        if m.public_key == public_key or m.removed_at is not None or m.name != name:
            continue
        if m.is_coordinator or m.synced:
            raise StateError(
                f"the name {name!r} is already taken by another member",
                "pick another --name, or `meshrun remove` the old member first",
            )
        age = now - m.joined_at
        if age < PENDING_GRACE_S:
            raise StateError(
                f"the name {name!r} is being taken by a node that is joining right now",
                f"pick another --name, or wait {PENDING_GRACE_S - age:.0f} s if that join was yours and it failed",
            )
        release.append(m.public_key)
    if name_removed_at is not None and name_removed_at >= token.created_at:
        raise TokenError(
            f"the node {name!r} was removed from the network after this token was made",
            "the operator decides whether it may come back: ask for a new token",
        )
    if pending_of_token - len(release) >= PENDING_PER_TOKEN:
        raise TokenError(
            f"this join token has {pending_of_token} enrolments that never completed",
            f"wait {PENDING_GRACE_S:.0f} s for them to be released, or ask for a new token",
        )
    if held_by_token >= max(1, int(range_size * TOKEN_SHARE_OF_RANGE)):
        raise TokenError(
            f"this join token already holds {held_by_token} of the overlay's {range_size} addresses",
            "ask the operator for another token (one token may take at most half the range)",
        )
    return Admission(release=tuple(release))
