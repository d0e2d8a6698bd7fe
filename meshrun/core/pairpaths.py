"""Per-pair path selection: private (same site), public (direct), or relayed via the coordinator.

Pure; the coordinator runs `step` for a pair of nodes when what both nodes report about each other
(their latest WireGuard handshake) changed, or when `next_due` says time alone may change it, and
tells both sides the result, so the two ends of a pair always agree (a pair relayed on one side
only would drop packets: WireGuard filters inbound packets by the sending peer's allowed IPs).

A pair starts `private` when both nodes share a LAN (joined with one `--site`, or behind one public IP) and
report private candidates (same VPC/LAN: no hairpin through the gateway, no internet gateway's egress between
elastic IPs), else `public`. Each side re-creates
its peer entry on a mode change, so a handshake newer than the change proves the new path.
Without one within ATTEMPT_S, the pair falls back: private -> public -> relayed. The window runs from
when both ends have applied the change (`started`, which the driver knows from their reports), not from
the choice: an end that is slow, stopped or offline is no evidence against a path it never tried.

A relayed pair's WireGuard peers point at its relay's port for the pair (core/relays), so their handshakes
prove the relayed path, not a direct one. It tries direct again after `retry_delay(tries)`: a handshake lost
twice on a lossy link, an end slow to report it, or a NAT that changed, should not leave a pair on a relay for
good. The first retry comes after RETRY_MIN_S, since a single miss is as likely bad luck as a NAT that cannot
be punched (a VM scenario's 1:1-NAT pair, 4% loss per handshake and agents under TCG, missed its first window
and would have stayed relayed 15 min). Each try that fails costs the pair up to ATTEMPT_S without a path (an
end has one endpoint per peer), so the later waits grow (RETRY_S, then 2 x) and after MAX_TRIES failed
attempts the pair stays relayed: two symmetric NATs cost three short gaps in the first hour, then none. A pair
whose direct tunnel had worked and went stale also tries after RETRY_MIN_S. The driver forgets the failures
(tries = 0) when an end's address changes: what stopped the direct path may be gone.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass

from meshrun.core.model import Member, split_endpoint

ATTEMPT_S = 10.0  # how long a new path gets to produce a handshake
STALE_S = 180.0  # WireGuard rekeys every 120 s while a tunnel is used; older = broken
RETRY_MIN_S = 60.0  # a relayed pair's first try of direct comes this long after it was relayed
# Tests only: a shorter RETRY_MIN_S for the processes of one e2e world (its coordinator and the `status` that
# reports the next try), so that a test of the retry does not wait a real minute. The VM scenario keeps 60 s.
RETRY_MIN_ENV = "MESHRUN_TEST_RETRY_MIN_S"
RETRY_S = 900.0  # ... after two failed attempts; doubling with each one after them
MAX_TRIES = 4  # failed direct attempts after which a pair stays relayed (until an end's address changes)
PRIVATE, PUBLIC, RELAYED = "private", "public", "relayed"
LABELS = {PRIVATE: "direct (private)", PUBLIC: "direct (public)", RELAYED: "relayed"}


@dataclass(frozen=True)
class PairState:
    mode: str
    since: float  # when this mode was chosen
    verified: bool = False  # a handshake newer than `since` was seen
    relay: str = ""  # a relayed pair's relay: a member's name ("" = the coordinator); see core/relays
    port: int = 0  # a relayed pair's UDP port on its relay (core/relays.RELAY_PORTS; 0: not relayed)
    tries: int = 0  # direct attempts that failed since the pair's last working direct tunnel

    def record(self) -> dict:
        """The state as the stores keep it (JSON): the port and tries only when there are some."""
        out = {"mode": self.mode, "since": self.since, "verified": self.verified, "relay": self.relay}
        return out | ({"port": self.port} if self.port else {}) | ({"tries": self.tries} if self.tries else {})

    @classmethod
    def from_record(cls, d: dict) -> PairState:
        """`record`'s inverse; records written before relays, ports or retries have none."""
        return cls(
            str(d["mode"]),
            float(d["since"]),
            bool(d["verified"]),
            str(d.get("relay", "")),
            int(d.get("port", 0)),
            int(d.get("tries", 0)),
        )


def direct(state: PairState | None) -> bool:
    """A pair whose own tunnel works (private or public, proven by a handshake): one end can relay for
    the other (a relayed pair never relays: no relay to a relay)."""
    return state is not None and state.mode != RELAYED and state.verified


def host_of(endpoint: str | None) -> str | None:
    return split_endpoint(endpoint)[0] if endpoint else None


def private_candidate(m: Member) -> str | None:
    """The member's first self-reported candidate on a private address (its LAN endpoint)."""
    for c in m.candidates:
        try:
            if ipaddress.ip_address(host_of(c) or "").is_private:
                return c
        except ValueError:
            continue
    return None


def shares_lan(a: Member, b: Member) -> bool:
    """Whether a and b sit on one private network: both joined with one site (`meshrun join --site`: the cloud's
    usual VPC, where each node has its own public IP), or both behind one public IP (as the coordinator observed
    them) and not joined with two different sites.

    Two declared sites never share a LAN, whatever their addresses: private ranges repeat across datacenters, so
    a 172.31.x.x in another site is someone else's machine."""
    if a.site and b.site:
        return a.site == b.site
    ha, hb = host_of(a.endpoint), host_of(b.endpoint)
    return bool(ha and ha == hb)


def same_site(a: Member, b: Member) -> bool:
    """The pair starts on its private path: it shares a LAN (`shares_lan`) and both ends reported a LAN candidate.
    Declared same-site ends with their own public IPs are dialled at their LAN addresses too; a LAN that does not
    carry their WireGuard (another datacenter under the same site name, a security group) fails the attempt
    window and the pair falls back to public."""
    return shares_lan(a, b) and bool(private_candidate(a) and private_candidate(b))


def _fresh(handshake: int, now: float, fresh: bool | None) -> bool:
    # `fresh` given: the nodes' own word (each reports when its tunnel goes stale or comes back, so
    # an old handshake time may still be a live tunnel); else judged from the time alone.
    return (bool(handshake) and now - handshake < STALE_S) if fresh is None else fresh


def initial(a: Member, b: Member, handshake: int, now: float, fresh: bool | None = None) -> PairState:
    """First state of a pair. A pair that already has a fresh handshake (e.g. after a coordinator
    restart without saved pair state) keeps its working tunnel instead of being probed again."""
    if same_site(a, b):
        return PairState(PRIVATE, now)
    return PairState(PUBLIC, now, verified=_fresh(handshake, now, fresh))


def _since(handshake: int, since: float) -> bool:
    # WireGuard reports handshakes in whole seconds: one in the same second as `since` counts.
    return handshake >= int(since)


def retry_delay(tries: int) -> float | None:
    """How long a relayed pair waits before it tries direct again, after `tries` failed attempts (None: it
    does not, MAX_TRIES failed)."""
    if tries >= MAX_TRIES:
        return None
    return retry_min_s() if tries <= 1 else RETRY_S * 2 ** (tries - 2)


def retry_min_s() -> float:
    """RETRY_MIN_S, or a test's shorter one (RETRY_MIN_ENV, never longer)."""
    try:
        return min(RETRY_MIN_S, float(os.environ.get(RETRY_MIN_ENV) or RETRY_MIN_S))
    except ValueError:
        return RETRY_MIN_S


def step(
    state: PairState,
    a: Member,
    b: Member,
    handshake: int,
    now: float,
    fresh: bool | None = None,
    started: float | None = 0.0,
) -> PairState:
    """Next state of pair (a, b) given the newest handshake either side reports (unix s, 0 = none) and,
    where the nodes say so, whether the tunnel is fresh (None: a handshake in the last STALE_S).

    `started`: when both ends had applied the state's mode (the attempt window runs from the later of it
    and `state.since`); None while one of them has not, so an unproven path is kept, not failed."""
    fresh = _fresh(handshake, now, fresh)
    if state.mode == RELAYED:
        # The ends' handshakes now cross the relay (each end's WireGuard has one endpoint per peer: the relay's
        # port), so they prove the relayed path, not a direct one. The relay's health is the ends' probes'
        # business (relay-down reports), not the handshake's. Direct is tried again when its time comes.
        wait = retry_delay(state.tries)
        if wait is not None and now >= state.since + wait:
            return PairState(PRIVATE if same_site(a, b) else PUBLIC, now, tries=state.tries)
        if fresh and not state.verified and _since(handshake, state.since):
            return dataclasses.replace(state, verified=True)
        return state
    if fresh and (state.verified or _since(handshake, state.since)):
        return state if state.verified else PairState(state.mode, state.since, True)
    if not state.verified and (started is None or now - max(state.since, started) < ATTEMPT_S):
        return state
    # Unproven after the attempt window, or a verified tunnel gone stale: fall back one step.
    if state.mode == PRIVATE:
        return PairState(PUBLIC, now, tries=state.tries)
    return PairState(RELAYED, now, tries=0 if state.verified else state.tries + 1)


def next_due(state: PairState, handshake: int, fresh: bool | None = None, started: float | None = 0.0) -> float | None:
    """When `step` may next change `state` by time alone, with `handshake` as the newest one reported
    and `started` as for `step` (None: only a new report can change it). Before this time, `step` with the
    same inputs returns `state` unchanged, so a driver need not look at the pair until then or until a
    report changes.

    With `fresh` given (the nodes report their tunnels going stale), a verified fresh pair has no
    timer at all: a mesh of n nodes keeps no n(n-1)/2 timers running.
    """
    if state.mode == RELAYED:
        wait = retry_delay(state.tries)
        return None if wait is None else state.since + wait  # the next direct attempt
    if state.verified:
        if fresh is not None:
            return None if fresh else state.since
        # Stale at handshake + STALE_S; a verified pair without any handshake falls back at once.
        return float(handshake) + STALE_S if handshake else state.since
    if started is None:
        return None  # the window opens when both ends have applied the mode (a report)
    return max(state.since, started) + ATTEMPT_S  # the attempt window closes


def endpoint_for(mode: str, peer: Member) -> str | None:
    """The endpoint a node should dial for `peer` in `mode`."""
    if mode == PRIVATE:
        return private_candidate(peer) or peer.endpoint
    return peer.endpoint


def pair_key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)
