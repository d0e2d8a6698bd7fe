"""The pair driver: every node pair's path (private, public, relayed), advanced from what nodes report.

Each agent reports, with its heartbeat, the latest handshake it has with each peer; once a
second the coordinator advances every pair's state with `meshrun.core.paths.step` and persists
the result (paths.json). Reports are not persisted: after a coordinator restart a pair is left as
it was until both its nodes have reported again (each agent's first sync with a restarted
coordinator carries a full report), so a working pair is never judged stale for want of news.
"""

from __future__ import annotations

import logging

from meshrun.core import paths
from meshrun.core.model import Member
from meshrun.errors import StateError
from meshrun.system.store import StateDir

log = logging.getLogger("meshrun.mesh.coordinator.pairs")


class PairDriver:
    """Pair states and the handshake reports they are decided from."""

    def __init__(self, state: StateDir) -> None:
        self.state = state
        self.reports: dict[str, dict[str, int]] = {}   # node name -> {peer key: latest handshake}, since start
        self.pairs: dict[tuple[str, str], paths.PairState] = self._load()

    def _load(self) -> dict[tuple[str, str], paths.PairState]:
        """Pair states survive a coordinator restart (paths.json), so working pairs are not re-probed."""
        if not (self.state / "paths.json").exists():
            return {}
        try:
            data = self.state.read_json("paths.json")
            return {tuple(k.split("|", 1)): paths.PairState(v["mode"], float(v["since"]), bool(v["verified"]))
                    for k, v in data.get("pairs", {}).items()}
        except (StateError, KeyError, ValueError, TypeError) as exc:
            log.warning("ignoring unreadable paths.json (%s); pairs are probed again", exc)
            return {}

    def report(self, node: str, delta: dict[str, int], full: bool) -> bool:
        """Record `node`'s handshakes {peer key: unix s}; True while a full report is still owed
        (the node's pairs are judged only once one arrived since this coordinator started)."""
        if full:
            self.reports[node] = dict(delta)
        elif node in self.reports:
            self.reports[node].update(delta)
        return node not in self.reports

    def handshake(self, a: Member, b: Member) -> int:
        """The newest handshake between a and b that either of them reported."""
        return max(self.reports.get(a.name, {}).get(b.public_key, 0),
                   self.reports.get(b.name, {}).get(a.public_key, 0))

    def update(self, members: list[Member], now: float) -> bool:
        """Advance every pair's path state; True if any mode changed (nodes must be told)."""
        # A pair is judged once both nodes have an observed endpoint and have reported their
        # candidates (first sync): only then can "same site" be told apart from "elsewhere".
        nodes = [m for m in members if not m.is_coordinator and m.endpoint and m.candidates and m.name in self.reports]
        changed = False
        # Pairs of nodes that have not reported since this coordinator started are kept as they were.
        live = {m.name for m in members}
        new: dict[tuple[str, str], paths.PairState] = {k: st for k, st in self.pairs.items()
                                                      if k[0] in live and k[1] in live}
        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                key = paths.pair_key(a.name, b.name)
                old = self.pairs.get(key)
                hs = self.handshake(a, b)
                if old is None:
                    st = paths.initial(a, b, hs, now)
                    changed = True
                else:
                    st = paths.step(old, a, b, hs, now)
                    if st.mode != old.mode:
                        log.info("path %s <-> %s: %s -> %s", a.name, b.name, old.mode, st.mode)
                        changed = True
                new[key] = st
        if new != self.pairs:
            self.pairs = new
            self.state.write_json("paths.json", {"pairs": {
                f"{a}|{b}": {"mode": st.mode, "since": st.since, "verified": st.verified}
                for (a, b), st in sorted(new.items())}})
        return changed

    def mode(self, a: str, b: str) -> paths.PairState | None:
        return self.pairs.get(paths.pair_key(a, b))
