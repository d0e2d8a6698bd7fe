"""What the operator does on the coordinator besides init: tokens, removing nodes, listing members.

Each function opens the coordinator's database for one short transaction; the daemon sees the
change on its next tick.
"""

from __future__ import annotations

import json
import time

from meshrun.core import lanpath, topology
from meshrun.core.model import SITE_RE, Member, Network
from meshrun.core.token import looks_like_token, new_token, parse_duration, parse_token
from meshrun.errors import StateError, UsageError
from meshrun.mesh.coordinator import ha
from meshrun.mesh.coordinator.setup import DEFAULT_TTL, check_token_uses
from meshrun.system.control.coordinatordb import CoordinatorDB
from meshrun.system.control.state import ControlState
from meshrun.system.files.statedir import StateDir


def open_db(state: StateDir, readonly: bool = False, follow: bool = False) -> tuple[ControlState, Network]:
    """The coordinator's state and network; StateError on a node's or a missing state directory.

    The state (a meshrun.system.control.state.ControlState) is the SQLite database of a lone coordinator, or,
    with several coordinators, the replicated state in etcd (meshrun.mesh.coordinator.ha); `follow` keeps it
    current with a watch (the daemon), else it is read as the command runs."""
    if not state.exists:
        raise StateError(f"no meshrun state in {state.path}", "run `meshrun init` first, or pass --state-dir")
    rec = state.read_json("member.json")
    if rec.get("role") != "coordinator":
        raise StateError(f"{state.path} belongs to a node, not the coordinator", "run this command on the coordinator")
    if ha.replicated(rec):
        db = ha.open_state(state, rec, follow=follow, readonly=readonly)
    else:
        db = CoordinatorDB(state / "coordinator.db", readonly=readonly)
    try:
        network = Network.from_dict(json.loads(db.meta("network") or "null"))
    except (ValueError, TypeError) as exc:
        raise StateError(
            f"{state / 'coordinator.db'} holds a corrupt network description ({exc})",
            "restore the state directory from a backup",
        ) from None
    return db, network


def create_token(state: StateDir, ttl: str = DEFAULT_TTL, uses: int | None = None) -> str:
    """Make a new join token and return its string (the only time the secret is shown)."""
    seconds = parse_duration(ttl)
    check_token_uses(uses)
    db, network = open_db(state)
    try:
        rec = state.read_json("member.json")
        coords = db.coordinators()
        # This coordinator first (the node tries them in order), then every other one: the token still works
        # when this one is gone.
        me = next((c for c in coords if c.name == rec.get("name")), coords[0])
        others = tuple((c.endpoint, c.fingerprint, c.public_key) for c in coords if c is not me)
        tok = new_token(network.name, (me.endpoint,), me.fingerprint, me.public_key, others)
        db.add_token(tok.token_id, tok.secret, seconds, uses)
        return tok.encode()
    finally:
        db.close()


def list_tokens(state: StateDir) -> list[dict]:
    db, _ = open_db(state, readonly=True)
    now = time.time()
    return [t.to_dict(now) for t in db.tokens()]


def revoke_token(state: StateDir, token_or_id: str) -> str:
    """Revoke by token string or id; returns the id. Joins already made stay members."""
    token_id = parse_token(token_or_id).token_id if looks_like_token(token_or_id) else token_or_id.strip()
    db, _ = open_db(state)
    if not db.revoke_token(token_id):
        raise UsageError(f"there is no token with id {token_id!r}", "see the ids with `meshrun token list`")
    return token_id


def remove_member(state: StateDir, name: str) -> Member:
    """Revoke a node: every peer drops its key on the next sync; its address returns to the pool only after
    the quarantine (meshrun.system.control.coordinatordb.ADDRESS_QUARANTINE_S, an hour)."""
    db, _ = open_db(state)
    m = db.remove_member(name)
    if m is None:
        names = ", ".join(x.name for x in db.members() if not x.is_coordinator) or "none"
        raise UsageError(f"there is no node named {name!r}", f"members are: {names}")
    return m


def sites(state: StateDir) -> dict[str, topology.Site]:
    """Every member's site (read-only): what it joined with, or what its private paths show."""
    db, _ = open_db(state, readonly=True)
    try:
        return topology.assign(db.members(), db.pairs())
    finally:
        db.close()


def members(state: StateDir) -> tuple[Network, list[Member]]:
    """The network and its active members (read-only)."""
    db, network = open_db(state, readonly=True)
    return network, db.members()


def site_table(state: StateDir) -> list[dict]:
    """Every site named with ``--site`` or trusted: its members (nodes), whether its network is trusted and with
    which encapsulation (None when it is not)."""
    db, _ = open_db(state, readonly=True)
    try:
        trusted = lanpath.trust_from_meta(db.meta)
        named: dict[str, list[str]] = {}
        for m in db.members():
            if m.site and not m.is_coordinator:
                named.setdefault(m.site, []).append(m.name)
    finally:
        db.close()
    return [
        {"site": s, "nodes": sorted(named.get(s, [])), "trusted": s in trusted, "encapsulation": trusted.get(s)}
        for s in sorted(set(named) | trusted.keys())
    ]


def trust_site(state: StateDir, name: str, trusted: bool = True, encapsulation: str = "vxlan") -> dict:
    """Mark site `name`'s network trusted (its nodes' pairs take the site LAN path, unencrypted, with
    `encapsulation`, core/lanpath) or not (back to WireGuard). Returns {"nodes": the site's nodes, "was": its
    encapsulation before (None: it was not trusted)}. The daemon tells the members on its next tick.
    UsageError for a name that is not a site name, an unknown encapsulation, or untrusting a site that is not
    trusted."""
    if not SITE_RE.match(name or ""):
        raise UsageError(
            f"site name {name!r} is not 1-32 characters of a-z 0-9 - (as `meshrun join --site` takes it)",
            "see the sites with `meshrun site list`",
        )
    if encapsulation not in lanpath.ENCAPSULATIONS:
        raise UsageError(
            f"encapsulation {encapsulation!r} is not one meshrun knows",
            f"use one of: {', '.join(lanpath.ENCAPSULATIONS)}",
        )
    db, _ = open_db(state)
    try:
        now = lanpath.trust_from_meta(db.meta)
        if not trusted and name not in now:
            shown = ", ".join(sorted(now)) or "none"
            raise UsageError(f"site {name!r} is not trusted", f"trusted sites: {shown}")
        was = now.get(name)
        after = {**now, name: encapsulation} if trusted else {s: e for s, e in now.items() if s != name}
        db.set_meta(**lanpath.trust_to_meta(after))
        nodes = sorted(m.name for m in db.members() if m.site == name and not m.is_coordinator)
        return {"nodes": nodes, "was": was}
    finally:
        db.close()
