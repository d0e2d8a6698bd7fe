"""Which member relays a pair that cannot connect directly.

Pure. A pair whose ends cannot reach each other (both behind symmetric NAT, a firewall that drops
inbound UDP) is relayed: each end keeps the other as its WireGuard peer (that peer's /32 only) with its
endpoint set to a UDP port the relay opened for that pair (RELAY_PORTS), and the relay forwards the
pair's WireGuard datagrams between the two ends as they are (meshrun.system.sockets.udprelay), as Tailscale's
peer relays and DERP do: it never holds a key for the pair, so it sees sizes and timing, never content,
and cannot send as either end. Any member may relay (Tailscale's peer relays,
Nebula's relays) unless it opted out (`meshrun join --no-relay`), and the coordinator is always one
candidate. A relay must have a working direct tunnel with both ends (no relay to a relay: a member
that only reaches one end through a relay, or whose NAT drops what it did not ask for, has no such
tunnel). Among the candidates the pair takes the one with the smallest measured round trip through
it (each end's round trip to the candidate, as that end measured and reported it: what a member says
about others' legs, its own included, is never used, so a liar can make itself look bad, never good),
plus a penalty per pair the
candidate already relays, so pairs spread over relays instead of piling onto the fastest, and a fixed
penalty for the coordinator, so members relay unless the coordinator is clearly closer.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from meshrun.core.model import Member

__all__ = [
    "COORDINATOR",
    "COORDINATOR_PENALTY_MS",
    "UNKNOWN_RTT_MS",
    "LOAD_PENALTY_MS",
    "PROBE_TARGETS",
    "RELAY_PORTS",
    "Candidate",
    "choose",
    "free_port",
    "probe_targets",
    "rtt_bucket",
]

COORDINATOR = ""  # the relay name that means the coordinator
UNKNOWN_RTT_MS = 250.0  # a leg nobody measured yet: worse than most measured legs, better than none
LOAD_PENALTY_MS = 5.0  # per pair a candidate already relays
# The coordinator is usually a small machine picked for its public address, not for bandwidth, and it
# carries the control plane: members are preferred unless it is clearly closer.
COORDINATOR_PENALTY_MS = 20.0
# UDP ports a relay forwards pairs' datagrams on, one per pair it relays: a port names the pair, since one end
# behind a NAT may reach the relay for two pairs from the same address. Next to WireGuard's 51820; open them
# inbound on members that may relay (docs: ports), or join those with --no-relay.
RELAY_PORTS = range(51821, 52333)


def free_port(used: Collection[int]) -> int:
    """The lowest relay port not in `used` (the ports a relay's other pairs have); 0 when all are taken."""
    return next((p for p in RELAY_PORTS if p not in used), 0)


@dataclass(frozen=True)
class Candidate:
    """A member that could relay: its name ("" for the coordinator) and whether it may."""

    name: str
    may_relay: bool = True


def choose(
    a: str,
    b: str,
    candidates: Collection[Candidate],
    direct: Callable[[str, str], bool],
    rtt_ms: Callable[[str, str], float | None],
    load: Mapping[str, int],
    avoid: Collection[str] = (),
) -> str:
    """The relay for pair (a, b): a candidate name, or COORDINATOR when no member qualifies.

    `direct(x, y)`: x and y have a working direct tunnel; `rtt_ms(end, relay)`: the round trip `end`
    itself measured to `relay` (None: unknown; the coordinator's name is ""); only an end's own reports
    are asked for, so a candidate's word about its legs counts for nothing. `load[name]`: pairs it
    relays now (this pair left out), `avoid`: relays that just failed this pair (the coordinator
    included, if it did). Deterministic: equal costs go to the name that sorts first, the coordinator last."""

    def cost(name: str) -> float:
        legs = (rtt_ms(a, name), rtt_ms(b, name))
        return sum(UNKNOWN_RTT_MS if x is None else x for x in legs) + LOAD_PENALTY_MS * load.get(name, 0)

    best: tuple[float, int, str] | None = None
    for c in candidates:
        if c.name in (a, b, COORDINATOR) or not c.may_relay or c.name in avoid:
            continue
        if not (direct(a, c.name) and direct(c.name, b)):
            continue
        key = (cost(c.name), 0, c.name)
        if best is None or key < best:
            best = key
    if COORDINATOR not in avoid or best is None:
        # The coordinator relays for everyone (every node has a tunnel with it); it loses a tie.
        key = (cost(COORDINATOR) + COORDINATOR_PENALTY_MS, 1, COORDINATOR)
        if best is None or key < best:
            best = key
    return best[2]


PROBE_TARGETS = 16  # relays an agent measures its round trip to (the coordinator included)


def probe_targets(my_key: str, members: Sequence[Member], k: int = PROBE_TARGETS) -> list[Member]:
    """The members whose round trip this node measures for the relay choice: the coordinator and up to
    k - 1 others that may relay and that it reaches directly, a stable choice per node (a hash of both
    keys orders them, so over the mesh every member is measured by some)."""
    others = [
        m
        for m in members
        if m.public_key != my_key and not m.is_coordinator and m.relay and m.path in ("private", "public")
    ]
    others.sort(key=lambda m: hashlib.sha256(f"{my_key}|{m.public_key}".encode()).digest())
    coordinator = [m for m in members if m.is_coordinator and m.public_key != my_key]
    return coordinator + others[: max(0, k - len(coordinator))]


def rtt_bucket(ms: float) -> float:
    """`ms` rounded to about 10 %: what an agent reports, so jitter does not become a report per sync."""
    if ms <= 1.0:
        return round(ms, 1)
    return round(1.1 ** round(math.log(ms, 1.1)), 1)
