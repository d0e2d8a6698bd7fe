"""The member list agents long-poll: its version, the wait for a newer one, and its per-caller payload."""

from __future__ import annotations

import threading
import time

from meshrun.core import paths
from meshrun.core.model import Member, Network
from meshrun.mesh.coordinator.pairs import PairDriver
from meshrun.system.store import CoordinatorDB


class Roster:
    """Publishes member-list versions and answers `payload(caller)` with per-pair paths applied."""

    def __init__(self, db: CoordinatorDB, network: Network, pairs: PairDriver) -> None:
        self.db = db
        self.network = network
        self.pairs = pairs
        self.version = db.version()
        self.cond = threading.Condition()
        self._cache: tuple[int, list[tuple[Member, dict]]] | None = None

    def publish(self, version: int) -> None:
        """Announce `version`: every pending long-poll returns."""
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def wake_all(self) -> None:
        with self.cond:
            self.cond.notify_all()

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

    def payload(self, caller: Member | None = None) -> list[dict]:
        """The member list as `caller` should see it: per peer the endpoint to dial and the path.

        The base list is built once per database version (with 1000 members, building it per
        request was most of the coordinator's CPU); per caller only pair overrides are copied.
        """
        v = self.db.version()
        if self._cache is None or self._cache[0] != v:
            base = []
            for m in self.db.members():
                d = m.to_dict()
                if m.is_coordinator:
                    d["endpoint"] = self.network.endpoints[0]
                base.append((m, d))
            self._cache = (v, base)
        out = []
        for m, d in self._cache[1]:
            st = None
            if caller is not None and not m.is_coordinator and m.name != caller.name and not caller.is_coordinator:
                st = self.pairs.mode(caller.name, m.name)
            out.append(dict(d, path=st.mode, endpoint=paths.endpoint_for(st.mode, m)) if st is not None else d)
        return out
