"""The member list agents long-poll: its version, the wait for a newer one, and its per-caller payload,
in full or as the delta since the version the caller holds (meshrun.core.memberlist)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from meshrun.core import lanpath, memberlist, pairpaths
from meshrun.core.model import Member, Network
from meshrun.mesh.coordinator.pairs import PairDriver
from meshrun.system.control.state import ControlState


class Roster:
    """Publishes member-list versions and answers `payload(caller)` (the full list with per-pair paths
    applied) or `delta(caller, known)` (only what changed for the caller since version `known`)."""

    def __init__(
        self, db: ControlState, network: Network, pairs: PairDriver, history: int = memberlist.HISTORY_SIZE
    ) -> None:
        self.db = db
        self.network = network
        self.pairs = pairs
        self.cond = threading.Condition()
        # (database version, [(member, its dict)], {public key: index}, {overlay IP: member})
        self._cache: tuple[int, list[tuple[Member, dict]], dict[str, int], dict[str, Member]] | None = None
        self._removals = 0  # db.removals when the cache was built
        self._by_name: dict[str, Member] = {}  # the cached list's members by name
        # {site whose network the operator trusts (`meshrun site trust`): its encapsulation}
        self.trusted: dict[str, str] = {}
        v, base, _, _ = self._base()
        self._published_trusted = self.trusted
        self._published_sites = {m.name: m.site for m, _ in base}  # each member's site as last published
        self.version = v
        self._published = {m.public_key: memberlist.signature(m) for m, _ in base}
        # In memory: after a restart, every agent behind the current version gets the full list once.
        self.history = memberlist.History(v, history)
        # Called (in the publishing thread) after each publish and wake_all: servers holding long-polls
        # poll them (meshrun.system.sockets.longpoll.LongPollServer.kick). Threads waiting in wait() are notified too.
        self.listeners: list[Callable[[], None]] = []

    def _base(self, fresh: bool = True) -> tuple[int, list[tuple[Member, dict]], dict[str, int], dict[str, Member]]:
        """(database version, [(member, its dict)], {public key: index}, {overlay IP: member}): built once
        per database version (with 1000 members, building it per request was most of the coordinator's
        CPU). `fresh=False`: the list as last built (by a publish, or an enrolment's fresh payload), without
        asking the database (the agents' hot path: a thousand long-polls contending for the database
        lock starved the loop)."""
        cache = self._cache
        if not fresh and cache is not None:
            return cache
        v, removals = self.db.version(), self.db.removals
        if cache is None or cache[0] != v:
            self._removals = removals
            self.trusted = lanpath.trust_from_meta(self.db.meta)
            # A member unchanged since the last build keeps its dict (a join changes one member of 1000;
            # the database hands back the same Member object for an unchanged row, so identity tells).
            known = {id(m): (m, d) for m, d in cache[1]} if cache is not None else {}
            base = []
            for m in self.db.members():
                old = known.get(id(m))
                d = old[1] if old is not None and old[0] is m else None
                if d is None:
                    d = m.to_dict()
                    if m.is_coordinator:  # a node dials it at its public endpoint (the first one's: the network's)
                        d["endpoint"] = m.endpoint or self.network.endpoints[0]
                base.append((m, d))
            cache = self._cache = (
                v,
                base,
                {m.public_key: i for i, (m, _) in enumerate(base)},
                {m.overlay_ip: m for m, _ in base},
            )
            self._by_name = {m.name: m for m, _ in base}
        return cache

    def member_by_ip(self, ip: str) -> Member | None:
        """The live member with overlay address `ip` in the last built list, else as the database has it now
        (a join the loop has not announced yet, or any removal since: a removed node is refused at once);
        None for no live member."""
        cache = self._cache
        m = cache[3].get(ip) if cache is not None and self._removals == self.db.removals else None
        return m if m is not None else self.db.member_by_ip(ip)

    def publish(self, version: int, pair_changes: Iterable[tuple[str, str]] = (), relays: Iterable[str] = ()) -> None:
        """Announce `version`: record what changed since the last one
        (members compared with what was published then; `pair_changes`: node pairs whose path
        changed; `relays`: members whose set of relayed pairs changed) and return every pending long-poll."""
        with self.cond:
            # Exactly `version`, the one the caller applied, never the database's: a join recorded after
            # the caller read its members is announced by the next publish, whose tick applies it too.
            # (Taking the newer one hid it from that tick: its peer was never added, seen in CI.)
            _, base, _, _ = self._base()
            now = {m.public_key: memberlist.signature(m) for m, _ in base}
            changed, removed = memberlist.member_changes(self._published, now)
            key_of = {m.name: m.public_key for m, _ in base}
            touched: dict[str, set[str]] = {}
            for a, b in pair_changes:
                if a in key_of and b in key_of:
                    touched.setdefault(a, set()).add(key_of[b])
                    touched.setdefault(b, set()).add(key_of[a])
            for r in relays:  # a relay hears of it through its own entry (and its answer's `relaying`)
                if r in key_of:
                    touched.setdefault(r, set()).add(key_of[r])
            # A site trusted or no longer, or its encapsulation changed: its members hear of each other again
            # (their entries' `lan` or `lan_routed` flips). So
            # do a member whose site changed (its first heartbeat reports it, after the list it got at its join)
            # and the members of its trusted sites, old and new.
            moved = {m.name: {m.site, self._published_sites.get(m.name, "")} for m, _ in base}
            moved = {n: sites for n, sites in moved.items() if len(sites) > 1}
            flipped = {
                s
                for s in self.trusted.keys() | self._published_trusted.keys()
                if self.trusted.get(s) != self._published_trusted.get(s)
            }
            for site in flipped | {s for v in moved.values() for s in v}:
                if site not in self.trusted.keys() | self._published_trusted.keys():
                    continue
                inside = [
                    m for m, _ in base if not m.is_coordinator and (m.site == site or site in moved.get(m.name, ()))
                ]
                for m in inside:
                    touched.setdefault(m.name, set()).update(o.public_key for o in inside if o is not m)
            self._published_sites = {m.name: m.site for m, _ in base}
            self._published_trusted = self.trusted
            self.history.record(version, changed, removed, touched)
            self._published = now
            self.version = max(self.version, version)
            self.cond.notify_all()
        for listener in self.listeners:
            listener()

    def trust_moved(self) -> bool:
        """Whether the trusted sites in the database differ from those last published (`meshrun site trust` ran
        in another process): the caller publishes a new version."""
        return lanpath.trust_from_meta(self.db.meta) != self._published_trusted

    def wake_all(self) -> None:
        with self.cond:
            self.cond.notify_all()
        for listener in self.listeners:
            listener()

    def wait(self, known: int, timeout: float, stop: threading.Event) -> int:
        """Wait up to `timeout` s for a version other than `known` (or `stop`); return the current one."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.version == known and not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return self.version

    def _entry(self, caller: Member | None, m: Member, d: dict) -> dict:
        st = None
        if caller is not None and not m.is_coordinator and m.name != caller.name and not caller.is_coordinator:
            st = self.pairs.mode(caller.name, m.name)
        if st is None:
            return d
        out = dict(d, path=st.mode, endpoint=pairpaths.endpoint_for(st.mode, m))
        if caller.site == m.site and m.site in self.trusted:
            # Both ends in one trusted site: the LAN path (core/lanpath), which each end proves by probing it,
            # whatever path their WireGuard pair takes (nodes with public addresses of their own are "public").
            out["lan"] = True
            if self.trusted[m.site] == "none":
                out["lan_routed"] = True
        if st.mode == pairpaths.RELAYED:
            if st.port:
                out["via_port"] = st.port
            relay = self._by_name.get(st.relay) if st.relay else None
            if relay is not None:  # else the first coordinator ("")
                out["via"] = relay.public_key
        return out

    def relaying(self, caller: Member) -> list[list]:
        """The pairs `caller` relays, as [[overlay IP, overlay IP, relay port], ...]: the ports it forwards the
        pairs' WireGuard datagrams on (meshrun.system.sockets.udprelay), and between whom."""
        name = "" if caller.is_coordinator else caller.name
        return self.pairs.relay_list([name], {m.name: m.overlay_ip for m, _ in self._base(fresh=False)[1]})

    def payload(self, caller: Member | None = None, fresh: bool = True) -> list[dict]:
        """The member list as `caller` should see it: per peer the endpoint to dial and the path.
        Per caller only the pair overrides are copied. `fresh=False`: the last built list (see _base)."""
        return [self._entry(caller, m, d) for m, d in self._base(fresh)[1]]

    def delta(self, caller: Member, known: int) -> dict | None:
        """{"since": known, "changed": [members], "removed": [keys]}: what changed for `caller` since it
        got version `known`, as `payload` would show it now; None when only the full list will do (the
        history does not reach back to `known`, or the change is as large as the list)."""
        with self.cond:
            keys = self.history.since(known, caller.name)
        if keys is None:
            return None
        changed, removed = keys
        _, base, index, _ = self._base(fresh=False)
        if len(changed) + len(removed) > max(len(base) // 2, 8):
            return None
        # A member changed since the last publish may be gone already: then it is removed.
        gone = removed | {k for k in changed if k not in index}
        at = sorted(index[k] for k in changed if k in index)  # the coordinator's order: new ones last
        return {"since": known, "changed": [self._entry(caller, *base[i]) for i in at], "removed": sorted(gone)}
