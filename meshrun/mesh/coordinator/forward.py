"""Where agents' reports go when several coordinators answer them: to the leader's pair driver.

An agent syncs with whichever coordinator answers it (meshrun.mesh.node.daemon), and with it reports its
peers' handshakes, the round trips it measured and relays it found down. Only the leading coordinator
decides paths (meshrun.mesh.coordinator.leader), so `Reports` hands a report to this coordinator's
PairDriver while it leads, and otherwise queues it for the leader: a thread sends the queue to the
leader's overlay API (POST /v1/forward, accepted from coordinators only) at most every FORWARD_GAP_S,
and what the leader answers (which nodes it still needs a full report from) decides what the next sync
answer asks of those agents. A batch the leader did not take (it is gone, a new one is being chosen) is
dropped, and every agent is asked for a full report again: the next leader starts knowing nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from meshrun.errors import MeshrunError
from meshrun.mesh.coordinator.pairs import PairDriver

log = logging.getLogger("meshrun.mesh.coordinator.forward")

FORWARD_GAP_S = 0.2
MAX_QUEUE = 100_000  # reports waiting for the leader at most (a thousand agents' full reports fit)

# (leader's overlay IP, batch) -> the leader's answer
Send = Callable[[str, dict], dict]


class Reports:
    """The pair driver's inputs as the overlay API sees them: `report`, `report_rtt`, `relay_failed`.

    `leading()` says whether this coordinator leads now, `leader_ip()` the leader's overlay address (None
    while unknown), `send` posts a batch to it (tests pass the leader's handler)."""

    def __init__(
        self,
        pairs: PairDriver,
        leading: Callable[[], bool] = lambda: True,
        leader_ip: Callable[[], str | None] = lambda: None,
        send: Send | None = None,
    ) -> None:
        self.pairs = pairs
        self.leading = leading
        self.leader_ip = leader_ip
        self.send = send
        self.lock = threading.Lock()
        self.queue: list[dict] = []
        self.full_ok: set[str] = set()  # nodes whose full report the current leader took
        self.leader_seen: str | None = None
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> Reports:
        if self.send is not None and self.thread is None:
            self.thread = threading.Thread(target=self._run, name="forward", daemon=True)
            self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.wake.set()

    # what the overlay API calls ------------------------------------------------
    def report(self, node: str, delta: dict[str, int], full: bool, stale: set[str] | None = None) -> bool:
        """PairDriver.report here or at the leader; True while a full report is still owed."""
        if self.leading():
            return self.pairs.report(node, delta, full, stale)
        self._queue({"kind": "report", "node": node, "peers": delta, "full": full, "stale": sorted(stale or ())})
        with self.lock:
            return node not in self.full_ok  # asked again until the leader took one

    def report_rtt(self, node: str, rtt_ms: dict[str, float]) -> None:
        if self.leading():
            self.pairs.report_rtt(node, rtt_ms)
        else:
            self._queue({"kind": "rtt", "node": node, "rtt": rtt_ms})

    def relay_failed(self, node: str, keys: list[str], via: dict[str, str] | None = None) -> int:
        """Relays found down: rerouted here, or at the leader (then counted as asked for)."""
        if self.leading():
            return self.pairs.relay_failed(node, keys, via=via)
        self._queue({"kind": "relay-down", "node": node, "peers": keys, "via": via or {}}, urgent=True)
        return len(keys)

    # the leader's side ---------------------------------------------------------
    def take(self, batch: dict) -> dict:
        """Apply a follower's batch (POST /v1/forward) to this leader's pair driver; {"owed": [nodes that
        still owe a full report], "rerouted": n}. ValueError for a malformed batch."""
        items = batch.get("items")
        if not isinstance(items, list) or len(items) > MAX_QUEUE:
            raise ValueError("items must be a list")
        owed: set[str] = set()
        rerouted = 0
        for it in items:
            if not isinstance(it, dict) or not isinstance(it.get("node"), str):
                raise ValueError("an item must name its node")
            node = it["node"]
            kind = it.get("kind")
            if kind == "report":
                peers = {str(k): int(v) for k, v in dict(it.get("peers") or {}).items()}
                stale = {str(k) for k in it.get("stale") or []} & peers.keys()
                if self.pairs.report(node, peers, bool(it.get("full")), stale):
                    owed.add(node)
                else:
                    owed.discard(node)
            elif kind == "rtt":
                self.pairs.report_rtt(node, {str(k): float(v) for k, v in dict(it.get("rtt") or {}).items()})
            elif kind == "relay-down":
                via = {str(k): str(v) for k, v in dict(it.get("via") or {}).items()}
                rerouted += self.pairs.relay_failed(node, [str(k) for k in it.get("peers") or []], via=via)
            else:
                raise ValueError(f"unknown item kind {kind!r}")
        return {"owed": sorted(owed), "rerouted": rerouted}

    # the follower's side -------------------------------------------------------
    def _queue(self, item: dict, urgent: bool = False) -> None:
        with self.lock:
            if len(self.queue) < MAX_QUEUE:
                self.queue.append(item)
            else:  # the leader is away for long: ask everyone for a full report once it is back
                self.full_ok.clear()
        if urgent:
            self.wake.set()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.wake.wait(FORWARD_GAP_S)
            self.wake.clear()
            self.flush()

    def flush(self) -> None:
        """Send what waits to the leader (one batch); on failure drop it and ask for full reports again."""
        with self.lock:
            batch, self.queue = self.queue, []
        if not batch or self.leading():
            return
        leader = self.leader_ip()
        if leader != self.leader_seen:
            with self.lock:
                self.full_ok.clear()  # a new leader knows nothing of what the old one was told
            self.leader_seen = leader
        if leader is None or self.send is None:
            with self.lock:
                self.full_ok.clear()
            return
        try:
            answer = self.send(leader, {"items": batch})
        except MeshrunError as exc:
            log.warning("could not forward %d report(s) to the leader at %s: %s", len(batch), leader, exc.message)
            with self.lock:
                self.full_ok.clear()
            return
        owed = set(answer.get("owed") or ())
        with self.lock:
            for it in batch:
                if it["kind"] == "report" and it.get("full"):
                    if it["node"] in owed:
                        self.full_ok.discard(it["node"])
                    else:
                        self.full_ok.add(it["node"])
