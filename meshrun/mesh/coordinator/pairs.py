"""The pair driver: every node pair's path (private, public, relayed), advanced from what nodes report.

Each agent reports, with its heartbeat, the latest handshake of each peer whose liveness the
coordinator does not know yet, and which of those are stale (`meshrun.core.peers.handshake_report`):
a tunnel that stays fresh is reported once, not at every 120 s rekey. A pair is fresh while a node
that last called it fresh is still heard from; both ends calling it stale (or one end going silent
after calling it fresh) make it stale. A pair's state (`meshrun.core.pairpaths`) changes only when its
inputs do or when time makes it: so the driver looks at a pair only when a node's report changed
it, when a node became judgeable (new member, first report since start, an endpoint and candidates
known), or when the pair's next due time (`pairpaths.next_due`: unproven paths, and relayed ones for
their next direct try) came, kept in a heap. A tick with nothing new steps no pair at all, and the work
grows with the change, not with the n(n-1)/2 pairs of the mesh.

States live in the coordinator's SQLite database, one row per pair, written when it changes (an old
pairpaths.json is imported once and removed). Reports are not persisted: after a coordinator restart a
pair is left as it was until both its nodes have reported again (each agent's first sync with a
restarted coordinator carries a full report), so a working pair is never judged stale for want of news.

A new path's attempt window opens once both ends have reported twice since it was chosen (`started`): an
agent applies the member list a sync returns before it sends the next, so its second report after the
change comes from a node that has the new path. Until then the pair waits for their reports, not a timer:
a node that is stopped, overloaded or offline fails no path. A relayed pair whose end's address changed
(it moved, or its NAT did) forgets its failed direct attempts, so it tries direct again soon
(`pairpaths.retry_delay`).

With several coordinators only the leading one drives the pairs (`update`); the others `follow` what it
wrote into the replicated store, and a coordinator that starts or stops leading starts over (`restart`).
"The coordinator" as a relay ("") is the first coordinator, as every member resolves it; a pair the leader
hands to "the coordinator" goes to the leader by name (`me`) when that is another one, and every
coordinator is a usable relay for every pair (each node has a tunnel with each) unless it failed the pair.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import sys
import threading
import time

from meshrun.core import pairpaths, relays
from meshrun.core.model import Member
from meshrun.errors import StateError
from meshrun.system.control.state import ControlState
from meshrun.system.files.statedir import StateDir

log = logging.getLogger("meshrun.mesh.coordinator.pairs")

Key = tuple[str, str]
# Pairs looked at per update, all kinds together. A mass start (1000 members judged at once after a
# coordinator restart: 499,500 pairs) or a storm of handshake changes would otherwise hold the loop
# for one ~10 s tick; in slices the loop ticks again at once (`behind`) and syncs are served between
# them. What does not fit is carried to the next update, oldest first.
STEP_BUDGET = 20_000
# While newly judged pairs wait, at most this share of the budget goes to urgent pairs (a changed
# handshake, a timer): a busy mesh cannot starve a joiner's first look, nor the reverse.
URGENT_SHARE = 0.75


def _judgeable(m: Member) -> bool:
    # Only once a node has an observed endpoint and has reported its candidates (first sync) can
    # "same site" be told apart from "elsewhere".
    return not m.is_coordinator and bool(m.endpoint) and bool(m.candidates)


UNKNOWN_SLACK = 64  # handshake reports about keys not (yet) members, kept per node at most
AVOID_S = 120.0  # a relay that failed a pair is not chosen for it again for this long
RTT_PER_NODE = 64  # round trips kept per reporting node at most (agents measure up to 16 relays)


class PairDriver:
    """Pair states, the handshake reports they are decided from, and when each pair is next due.

    Threads: `report` runs in the overlay API's threads, `update` in the coordinator's loop, and
    `mode` anywhere (a read of one dict entry).
    """

    def __init__(self, db: ControlState, state: StateDir | None = None, me: str | None = None) -> None:
        self.db = db
        self.me = me  # this coordinator's name when there are several (it relays what "the coordinator" would)
        self.lock = threading.Lock()  # reports, dirty and pending
        # node name -> {peer key: latest handshake as the node last called it fresh, or -(handshake + 1)
        # as it last called it stale} since start: one int each (a million at 1000 members).
        self.reports: dict[str, dict[str, int]] = {}
        self.heard: dict[str, float] = {}  # node name -> unix time of its last report
        self.heard_before: dict[str, float] = {}  # ... and of the one before it (see `_started`)
        self.started: dict[Key, tuple[float, float]] = {}  # unproven pair -> (its since, when its window opened)
        self.waiting: dict[str, set[Key]] = {}  # node -> unproven pairs whose window waits for its report
        self.timed: set[str] = set()  # nodes that do not say what is stale (older agents): judged by time
        self.pairs: dict[Key, pairpaths.PairState] = db.pairs()
        if state is not None:
            self._import_paths_json(state)
        self.members: dict[str, Member] = {}  # live members by name, as of the last update with members
        # public key -> name of the live members (from the start: a report may arrive before the first update)
        self.names: dict[str, str] = {m.public_key: m.name for m in db.members()}
        self.judged: set[str] = set()  # nodes whose pairs are advanced (see _judgeable, report)
        self.dirty: set[Key] = set()  # pairs whose handshake changed since the last update
        self.pending: set[str] = set()  # nodes whose judgeability may have changed
        self.heap: list[tuple[float, Key]] = []
        self.booked: dict[Key, float] = {}  # pair -> due time of its live heap entry (one per pair)
        self.changed: set[Key] = set()  # pairs whose mode changed, until take_changes()
        self.backlog: set[Key] = set()  # pairs of newly judged nodes not looked at yet (see STEP_BUDGET)
        self.carried: dict[Key, None] = {}  # urgent pairs over the last update's budget, oldest first
        self.budget = STEP_BUDGET
        self.steps = 0  # pairpaths.initial/step calls so far (the work; tests count it)
        # Relays (core/relays): which pairs each relay carries ("" = the coordinator), round trips the
        # agents measured {(reporting node, relay's name): ms}, keyed by who measured them (an end's own legs
        # are the only ones the relay choice reads), relays that failed a pair {pair: {relay: until}}, pairs to
        # route again (their relay failed or lost its tunnels), relays whose pairs changed (to be told).
        self.by_relay: dict[str, set[Key]] = {}
        for key, st in self.pairs.items():
            if st.mode == pairpaths.RELAYED:
                self.by_relay.setdefault(st.relay, set()).add(key)
        self.rtt: dict[Key, float] = {}
        self.rtt_count: dict[str, int] = {}
        self.avoid: dict[Key, dict[str, float]] = {}
        self.reroute: set[Key] = set()
        self.relays_changed: set[str] = set()
        self._relays_gone: set[str] = set()  # relays removed or opted out since the last update
        self.coordinator = next((m.name for m in db.members() if m.is_coordinator), "")
        self._pruned = False

    def restart(self, db: ControlState) -> None:
        """Start over from the stored pairs, knowing no report (leading starts, or stops)."""
        self.__init__(db, None, self.me)  # type: ignore[misc]

    def follow(self, members: list[Member] | None) -> None:
        """Not leading: take the pairs the leader wrote since the last call from the store (its mirror), noting
        which changed and which relays' sets changed, as `update` would for the next publish."""
        if members is not None:
            self.members = {m.name: m for m in members}
            self.names = {m.public_key: m.name for m in members}
        take = getattr(self.db, "take_pair_changes", None)
        if take is None:
            return
        for key, st in take().items():
            old = self.pairs.get(key)
            if st is None:
                self.pairs.pop(key, None)
            else:
                self.pairs[key] = st
            old_relay = old.relay if old is not None and old.mode == pairpaths.RELAYED else None
            new_relay = st.relay if st is not None and st.mode == pairpaths.RELAYED else None
            if old_relay != new_relay:
                if old_relay is not None:
                    self.by_relay.get(old_relay, set()).discard(key)
                    self.relays_changed.add(old_relay)
                if new_relay is not None:
                    self.by_relay.setdefault(new_relay, set()).add(key)
                    self.relays_changed.add(new_relay)
            if st is not None and (old is None or old.mode != st.mode or old_relay != new_relay):
                self.changed.add(key)

    def _import_paths_json(self, state: StateDir) -> None:
        """Pair states were kept in pairpaths.json before they moved into the database: import it once."""
        if not (state / "pairpaths.json").exists():
            return
        if not self.pairs:
            try:
                data = state.read_json("pairpaths.json")
                old = {
                    tuple(k.split("|", 1)): pairpaths.PairState(v["mode"], float(v["since"]), bool(v["verified"]))
                    for k, v in data.get("pairs", {}).items()
                }
                self.db.save_pairs(old)
                self.pairs = old
                log.info("imported %d pair paths from pairpaths.json into the database", len(old))
            except (StateError, KeyError, ValueError, TypeError, AttributeError) as exc:
                log.warning("ignoring unreadable pairpaths.json (%s); pairs are probed again", exc)
        state.remove("pairpaths.json")

    # inputs ----------------------------------------------------------------
    def report(
        self, node: str, delta: dict[str, int], full: bool, stale: set[str] | None = None, now: float | None = None
    ) -> bool:
        """Record `node`'s handshakes {peer key: unix s} and which of them it calls stale (None: a node
        that does not say; judged by time); True while a full report is still owed (the node's pairs
        are judged only once one arrived since this coordinator started). Each pair whose handshake
        or liveness changed is looked at in the next update, and each whose window waited for this node's
        report; no other is. `now`: the report's time (unix s; tests move it)."""
        names = self.names
        with self.lock:
            self.heard_before[node] = self.heard.get(node, 0.0)
            self.heard[node] = time.time() if now is None else now
            self.dirty.update(self.waiting.pop(node, ()))
        if stale is None:
            self.timed.add(node)
        else:
            self.timed.discard(node)
            delta = {k: (v if k not in stale else -v - 1) for k, v in delta.items()}
        # Keys of members this driver does not know yet are kept only up to UNKNOWN_SLACK per node (a
        # join the loop has not seen), so a member that reports invented keys cannot grow our memory.
        unknown = [k for k in delta if k not in names]
        if len(unknown) > UNKNOWN_SLACK:
            dropped = set(unknown[UNKNOWN_SLACK:])
            delta = {k: v for k, v in delta.items() if k not in dropped}
        with self.lock:
            old = self.reports.get(node)
            if old is not None and not full and len(old) + len(delta) > len(names) + UNKNOWN_SLACK:
                delta = {k: v for k, v in delta.items() if k in names or k in old}
            if full:
                new = {sys.intern(k): v for k, v in delta.items()}
                self.reports[node] = new
                if old is None:
                    self.pending.add(node)
                    touched = []  # all its pairs are looked at once it is judged
                else:
                    touched = [k for k in old.keys() | new.keys() if old.get(k) != new.get(k)]
            elif old is not None:
                touched = [k for k, v in delta.items() if old.get(k) != v]
                for k in touched:
                    old[sys.intern(k)] = delta[k]
            else:
                touched = []
            for k in touched:
                other = names.get(k)
                if other is not None and other != node:
                    self.dirty.add(pairpaths.pair_key(node, other))
            return node not in self.reports

    def report_rtt(self, node: str, rtt_ms: dict[str, float]) -> None:
        """Record round trips `node` measured {peer key: ms} (to the relays it could use, the coordinator
        included) as `node`'s own legs: a report never touches what another member measured, so a member that
        claims 0 ms to everyone changes only its own legs as an end. At most RTT_PER_NODE per node, keys of
        non-members ignored."""
        with self.lock:
            for key, ms in rtt_ms.items():
                other = self.names.get(key)
                if other is None or other == node:
                    continue
                pair = (node, self._relay_name(other))
                if pair not in self.rtt:
                    if self.rtt_count.get(node, 0) >= RTT_PER_NODE:
                        continue
                    self.rtt_count[node] = self.rtt_count.get(node, 0) + 1
                self.rtt[pair] = float(ms)

    def relay_failed(
        self, node: str, keys: list[str], now: float | None = None, via: dict[str, str] | None = None
    ) -> int:
        """`node` found these relayed peers unreachable through their relay (`via`: {peer key: the relay's
        key it tried, "" for the coordinator}): each pair gets another relay at the next update, and that
        relay is avoided for it for AVOID_S. A report about a relay the pair no longer has (the other end
        reported first) changes nothing. Returns the pairs rerouted."""
        now = time.time() if now is None else now
        count = 0
        with self.lock:
            for key in keys[:256]:
                other = self.names.get(key)
                pair = pairpaths.pair_key(node, other) if other else None
                st = self.pairs.get(pair) if pair else None
                if st is None or st.mode != pairpaths.RELAYED:
                    continue
                if via is not None and key in via:
                    tried = self.names.get(via[key], "") if via[key] else relays.COORDINATOR
                    if self._relay_name(tried) != st.relay:
                        continue
                log.info("relay %s failed %s <-> %s", st.relay or "(coordinator)", pair[0], pair[1])
                self.avoid.setdefault(pair, {})[st.relay] = now + AVOID_S
                self.reroute.add(pair)
                count += 1
        return count

    def relaying(self, relay: str) -> list[Key]:
        """The pairs `relay` ("" = the coordinator) carries, sorted."""
        return sorted(self.by_relay.get(relay, ()))

    def relay_list(self, names: list[str], ips: dict[str, str]) -> list[list]:
        """What the relays named (a member, "" for the coordinator) forward, as a relay is told it:
        [[overlay IP, overlay IP, port], ...] for the pairs with a port whose ends are in `ips` {name: IP}."""
        out = []
        for a, b in sorted({key for r in names for key in self.by_relay.get(r, ())}):
            st = self.pairs.get((a, b))
            if a in ips and b in ips and st is not None and st.port:
                out.append([ips[a], ips[b], st.port])
        return out

    def _relay_name(self, name: str) -> str:
        return relays.COORDINATOR if name == self.coordinator else name

    def _rtt(self, end: str, relay: str) -> float | None:
        """The round trip `end` reported to `relay` (None: it reported none)."""
        return self.rtt.get((end, relay))

    def _direct(self, x: str, y: str) -> bool:
        return pairpaths.direct(self.pairs.get(pairpaths.pair_key(x, y)))

    def _relay_usable(self, key: Key, relay: str, now: float) -> bool:
        if self.avoid.get(key, {}).get(relay, 0.0) > now:
            return False
        if self._is_coordinator(relay):
            return True  # every node keeps a tunnel with every coordinator
        m = self.members.get(relay)
        return m is not None and m.relay and self._direct(key[0], relay) and self._direct(relay, key[1])

    def _choose_relay(self, key: Key, now: float) -> str:
        avoid = self.avoid.get(key, {})
        for r in [r for r, until in avoid.items() if until <= now]:
            del avoid[r]
        if not avoid:
            self.avoid.pop(key, None)
        load = {r: len(ks) - (key in ks) for r, ks in self.by_relay.items()}
        candidates = [relays.Candidate(m.name, m.relay) for m in self.members.values() if m.name in self.judged]
        if self.me and self.me in avoid:  # the leader failed this pair as "the coordinator" it stands for
            avoid = {**avoid, relays.COORDINATOR: avoid[self.me]}
        relay = relays.choose(key[0], key[1], candidates, self._direct, self._rtt, load, avoid)
        if relay == relays.COORDINATOR and self.me and self.me != self.coordinator:
            # The first coordinator ("") may be the one that is gone: the leader relays, by name.
            return self.me
        return relay

    def _is_coordinator(self, relay: str) -> bool:
        """Whether relay name `relay` ("" = the first coordinator) is a coordinator's."""
        if relay in (relays.COORDINATOR, self.me):
            return True
        m = self.members.get(relay)
        return m is not None and m.is_coordinator

    def _book_return(self, key: Key, st: pairpaths.PairState) -> None:
        """A pair a coordinator relays because member relays failed it is looked at again when the first of
        them may relay it again (AVOID_S after it failed): `_set_relay` then moves it back to a member."""
        until = self.avoid.get(key)
        if st.mode == pairpaths.RELAYED and until and self._is_coordinator(st.relay):
            self._book(key, min(until.values()))

    def _set_relay(self, key: Key, st: pairpaths.PairState, now: float) -> pairpaths.PairState:
        """`st` with a usable relay and its port if it is relayed (the ones it had, if still usable), the index
        kept. A port is free on its relay: one port names one pair there (core/relays.RELAY_PORTS)."""
        old = self.pairs.get(key)
        old_relay = old.relay if old is not None and old.mode == pairpaths.RELAYED else None
        if st.mode != pairpaths.RELAYED:
            relay = None
        elif old_relay is not None and key not in self.reroute and self._relay_usable(key, old_relay, now):
            relay = old_relay
            if self._is_coordinator(old_relay):
                # Coordinators are the fallback: a pair handed to one (its member relays had just failed it, or
                # none qualified) goes back to a member as soon as one does (see `_book_return`).
                choice = self._choose_relay(key, now)
                if not self._is_coordinator(choice):
                    relay = choice
        else:
            relay = self._choose_relay(key, now)
        self.reroute.discard(key)
        if relay != old_relay:
            if old_relay is not None:
                self.by_relay.get(old_relay, set()).discard(key)
                self.relays_changed.add(old_relay)
            if relay is not None:
                self.by_relay.setdefault(relay, set()).add(key)
                self.relays_changed.add(relay)
                log.info("pair %s <-> %s relayed by %s", key[0], key[1], relay or "the coordinator")
            self.changed.add(key)  # both ends route through the new relay
        port = 0
        if relay is not None:
            port = old.port if relay == old_relay and old is not None and old.port else 0
            if not port:
                used = {self.pairs[k].port for k in self.by_relay.get(relay, ()) if k != key and k in self.pairs}
                port = relays.free_port(used)
                self.changed.add(key)  # the ends learn the port with the pair's entry
                self.relays_changed.add(relay)  # and the relay with its list
        if st.relay == (relay or "") and st.port == port:
            return st
        return dataclasses.replace(st, relay=relay or "", port=port)

    def take_relay_changes(self) -> set[str]:
        """The relays ("" = the coordinator) whose set of pairs changed since the last call."""
        out, self.relays_changed = self.relays_changed, set()
        return out

    def handshake(self, a: Member, b: Member, now: float) -> tuple[int, bool | None]:
        """(the newest handshake between a and b that either reported, whether the tunnel is fresh):
        fresh while one end that last called it fresh has been heard from within STALE_S; None when
        neither end says (older agents: pairpaths judges by the handshake's time, and keeps timers)."""
        newest, fresh, said = 0, False, False
        for x, y in ((a, b), (b, a)):
            v = self.reports.get(x.name, {}).get(y.public_key)
            if v is None:
                continue
            hs = v if v >= 0 else -v - 1
            newest = max(newest, hs)
            if x.name in self.timed:
                fresh = fresh or (bool(hs) and now - hs < pairpaths.STALE_S)
            else:
                said = True
                fresh = fresh or (v > 0 and now - self.heard.get(x.name, 0.0) < pairpaths.STALE_S)
        return newest, fresh if said else None

    # the loop ----------------------------------------------------------------
    def update(self, members: list[Member] | None, now: float) -> bool:
        """Advance the pairs whose inputs changed or whose time came; True if a mode changed or a pair
        was created (nodes must be told: see take_changes).

        `members` is the live member list when it may have changed since the last call (a new
        member-list version), else None: the driver keeps the last one.
        """
        drop: list[str] = []
        writes: dict[Key, pairpaths.PairState] = {}
        if members is not None:
            moved_addr = {
                m.name
                for m in members
                if (old := self.members.get(m.name)) is not None
                and old.public_key == m.public_key
                and (old.endpoint, old.candidates) != (m.endpoint, m.candidates)
            }
            drop = self._refresh(members)
            self._retry_soon(moved_addr, writes)
        with self.lock:
            pending, self.pending = self.pending, set()
            dirty, self.dirty = self.dirty, set()
        # Urgent, in order: carried from the last update, a handshake changed, a timer came.
        urgent = self.carried
        urgent.update(dict.fromkeys(sorted(dirty)))
        while self.heap and self.heap[0][0] <= now:
            due, key = heapq.heappop(self.heap)
            if self.booked.get(key) == due:  # else a stale entry: the pair was booked again
                del self.booked[key]
                urgent[key] = None
        # A newly judged node's pairs join the backlog.
        for name in pending:
            self._judge(name, self.backlog)
        # Relayed pairs whose relay failed them, or lost a tunnel to one of them (or left), go first.
        with self.lock:
            reroute = set(self.reroute)
        for relay in drop:
            reroute |= self.by_relay.get(relay, set())
        urgent = dict.fromkeys(sorted(reroute)) | urgent
        self.backlog.difference_update(urgent)
        work = self._take(urgent)
        moved: set[str] = set()  # nodes one of whose pairs changed state: the pairs they relay are checked
        created = changed = False
        for key in work:
            if key[0] not in self.judged or key[1] not in self.judged:
                continue  # kept as it is until both nodes are judged again
            a, b = self.members[key[0]], self.members[key[1]]
            hs, fresh = self.handshake(a, b, now)
            old = self.pairs.get(key)
            self.steps += 1
            if old is None:
                st = pairpaths.initial(a, b, hs, now, fresh)
                created = True
                self.changed.add(key)
            else:
                st = pairpaths.step(old, a, b, hs, now, fresh, self._started(key, old, now))
                if st.mode != old.mode:
                    log.info("path %s <-> %s: %s -> %s", a.name, b.name, old.mode, st.mode)
                    changed = True
                    self.changed.add(key)
            st = self._set_relay(key, st, now)
            if old is None or st.relay != old.relay:
                changed = True
            if pairpaths.direct(st) != pairpaths.direct(old):
                moved.update(key)
            if st != old:
                self.pairs[key] = st
                writes[key] = st
                # A new state may move on at the next step with the same inputs (a handshake in the
                # second a pair went public verifies it): look again next tick, as stepping every
                # pair every tick did. An unchanged state stays so until next_due or new inputs.
                self._book(key, now)
            else:
                self._book(key, pairpaths.next_due(st, hs, fresh, self._started(key, st, now)))
            if st.verified or st.mode == pairpaths.RELAYED:
                self.started.pop(key, None)
            self._book_return(key, st)
        # A relay whose tunnel with one end of a pair it carries stopped being direct (or that may no
        # longer relay) hands that pair to another at once.
        for relay in sorted(moved | self._relays_gone):
            for key in sorted(self.by_relay.get(relay, ())):
                st = self.pairs.get(key)
                if st is not None and not self._relay_usable(key, relay, now):
                    self.reroute.add(key)
                    new = self._set_relay(key, st, now)
                    if new != st:
                        self.pairs[key] = writes[key] = new
                        changed = True
                    self._book_return(key, new)
        self._relays_gone = set()
        if writes or drop:
            self.db.save_pairs(writes, drop)
        return created or changed

    def _started(self, key: Key, st: pairpaths.PairState, now: float) -> float | None:
        """When the attempt window of unproven pair `key` in state `st` opened: when both ends had reported twice
        since `st.since`, as first seen (None until then: the pair then waits for the missing reports)."""
        if st.verified or st.mode == pairpaths.RELAYED:
            return 0.0  # no window: whatever `step` is given
        seen = self.started.get(key)
        if seen is not None and seen[0] == st.since:
            return seen[1]
        with self.lock:
            late = [n for n in key if self.heard_before.get(n, 0.0) <= st.since]
            for n in late:
                self.waiting.setdefault(n, set()).add(key)
            opened = min(now, max(self.heard.get(n, 0.0) for n in key))  # the later second report
        if late:
            return None
        self.started[key] = (st.since, opened)
        return opened

    def _retry_soon(self, names: set[str], writes: dict[Key, pairpaths.PairState]) -> None:
        """The relayed pairs of these nodes (whose address changed) forget their failed direct attempts."""
        for name in sorted(names):
            for other in self.members:
                key = pairpaths.pair_key(name, other)
                st = self.pairs.get(key)
                if st is not None and st.mode == pairpaths.RELAYED and st.tries:
                    log.info("%s's address changed: %s <-> %s tries direct again", name, key[0], key[1])
                    self.pairs[key] = writes[key] = dataclasses.replace(st, tries=0)
                    self._book(key, pairpaths.next_due(writes[key], 0))

    def _refresh(self, members: list[Member]) -> list[str]:
        """Take a new member list: nodes that are new or changed are judged again, removed ones lose
        their pairs and reports. Returns the names whose stored pairs are to be deleted."""
        live = {m.name: m for m in members}
        drop = [n for n, m in self.members.items() if n not in live or live[n].public_key != m.public_key]
        if not self._pruned:
            # Once, at start: pairs stored for members removed while the coordinator was down.
            self._pruned = True
            stale = {n for key in self.pairs for n in key if n not in live}
            if stale:
                self.pairs = {k: st for k, st in self.pairs.items() if k[0] in live and k[1] in live}
                drop += sorted(stale)
        partners = set(self.members) | set(live)
        if drop and (self.backlog or self.carried):
            gone = set(drop)
            self.backlog = {k for k in self.backlog if k[0] not in gone and k[1] not in gone}
            self.carried = {k: None for k in self.carried if k[0] not in gone and k[1] not in gone}
        for name in drop:
            self.judged.discard(name)
            self.waiting.pop(name, None)
            if name in self.by_relay:
                self._relays_gone.add(name)
            for other in partners:
                key = pairpaths.pair_key(name, other)
                self.started.pop(key, None)
                if self.pairs.pop(key, None) is not None:
                    self.booked.pop(key, None)  # its heap entry is now stale
                    self.changed.discard(key)
        with self.lock:
            for name in drop:
                self.reports.pop(name, None)
                self.heard.pop(name, None)
                self.heard_before.pop(name, None)
                self.timed.discard(name)
                self.pending.discard(name)
            for name, m in live.items():
                old = self.members.get(name)
                if old is None or old.public_key != m.public_key or _judgeable(old) != _judgeable(m):
                    self.pending.add(name)
                if old is not None and old.relay and not m.relay and name in self.by_relay:
                    self._relays_gone.add(name)  # it opted out of relaying: its pairs move
        self.members = live
        self.names = {m.public_key: m.name for m in members}
        with self.lock:  # keys of members that are gone (or never were) leave the reports too
            for node, rep in self.reports.items():
                if len(rep) > len(self.names):
                    self.reports[node] = {k: v for k, v in rep.items() if k in self.names}
        return drop

    def _judge(self, name: str, work: set[Key]) -> None:
        """A node's judgeability may have changed: on becoming judged, all its pairs with judged nodes
        are looked at (created or stepped); on losing it, its pairs are kept as they are."""
        m = self.members.get(name)
        ok = m is not None and _judgeable(m) and name in self.reports
        if ok and name not in self.judged:
            self.judged.add(name)
            work.update(pairpaths.pair_key(name, other) for other in self.judged if other != name)
        elif not ok:
            self.judged.discard(name)

    def _book(self, key: Key, due: float | None) -> None:
        """Keep at most one live heap entry per pair, the earliest: a later due time is booked when the
        earlier entry comes up (the step then finds nothing to do and books the next one)."""
        if due is None:
            self.booked.pop(key, None)  # its heap entry, if any, is now stale
            return
        cur = self.booked.get(key)
        if cur is not None and cur <= due:
            return
        self.booked[key] = due
        heapq.heappush(self.heap, (due, key))

    def _take(self, urgent: dict[Key, None]) -> list[Key]:
        """This update's pairs, at most `budget`: urgent ones oldest first (up to URGENT_SHARE of the
        budget while the backlog waits), the backlog in the rest. The urgent ones left over are carried."""
        cap = self.budget
        if self.backlog and len(urgent) + len(self.backlog) > cap:
            cap = max(1, int(cap * URGENT_SHARE))
        it = iter(urgent)
        work = list(itertools.islice(it, cap))
        self.carried = dict.fromkeys(it)
        room = self.budget - len(work)
        if len(self.backlog) <= room:
            work += self.backlog
            self.backlog = set()
        else:
            work += [self.backlog.pop() for _ in range(room)]
        return work

    @property
    def behind(self) -> bool:
        """Pairs wait for a look that did not fit in the last update's budget: tick again soon."""
        return bool(self.backlog or self.carried)

    def take_changes(self) -> set[Key]:
        """The pairs whose mode changed (or that were created) since the last call."""
        out, self.changed = self.changed, set()
        return out

    def mode(self, a: str, b: str) -> pairpaths.PairState | None:
        return self.pairs.get(pairpaths.pair_key(a, b))
