"""Telling a machine that is gone from one that is slow, from probes of its agent's port (pure).

The supervisor sends a TCP handshake to every node of a job each PROBE_EVERY_S. The node's kernel
answers it (with SYN-ACK, or RST where the agent is down), however busy the agent or its training
processes are, so only a machine that is gone, or cut off the overlay, stays silent. A node is called
gone once it has been silent for GONE_AFTER_S across at least MIN_MISSES probes in a row: one lost
datagram, or a second of a starved WireGuard, is not enough. An agent that answers the handshake but
not its API is left to the slower rule (the supervisor's LOST_AFTER_S).

Probes overlap (`Probes`): one is sent every period whether or not the last has been answered, since a
silent machine's probe waits PROBE_TIMEOUT_S, longer than the period. Sent one after the other, a gone
machine's misses came a timeout apart, and MIN_MISSES of them took 4.5 s whatever GONE_AFTER_S said
(benchmarks/results/loss_detection.json, 2026-11-27: 4.6 and 5.3 s medians with GONE_AFTER_S 4 and 3, period
1 s). Overlapping, with 1 s / 1.5 s / 3 s: 4.0 s (3.7-4.5); the values below are what that left to cut.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field

PROBE_EVERY_S = 0.5
PROBE_TIMEOUT_S = 1.0  # one SYN, no retransmission (Linux resends a SYN after 1 s, then 3 s)
# Under load (busy loops on every core, an iperf3 flood through meshrun0) 0 of 179 probes was missed and the
# slowest answer took 0.23 s (benchmarks/results/loss_detection.json, 2026-11-27, with 1 s / 1.5 s / 3 s), so
# three 1 s timeouts in a row over 2 s of silence say the machine is gone, with a 4x margin on the slowest
# answer; each second here is a second of every survivor's standstill (issue 39: progress again < 15 s).
GONE_AFTER_S = 2.0
MIN_MISSES = 3
MAX_IN_FLIGHT = 2  # probes of one node awaiting their answer: PROBE_TIMEOUT_S spans two periods
TICK_S = 0.1  # how often a prober sends what is due and settles what was answered


@dataclass
class Liveness:
    """One node's probes, in the order they were sent: `answered()`, or `missed(sent, now)` with the monotonic
    times the probe was sent and given up on. `missed` returns True once the node counts as gone. The
    thresholds default to the module's values as they are when it is made (a test may shorten them)."""

    gone_after_s: float = field(default_factory=lambda: GONE_AFTER_S)
    min_misses: int = field(default_factory=lambda: MIN_MISSES)
    silent_since: float | None = None  # when the first unanswered probe of the current run was sent
    misses: int = 0

    def answered(self) -> None:
        self.silent_since, self.misses = None, 0

    def missed(self, sent: float, now: float) -> bool:
        if self.silent_since is None:
            self.silent_since = sent
        self.misses += 1
        return self.gone(now)

    def gone(self, now: float) -> bool:
        """Silent for long enough, over enough probes."""
        return (
            self.silent_since is not None
            and self.misses >= self.min_misses
            and now - self.silent_since >= self.gone_after_s
        )


@dataclass
class Probes:
    """Overlapping probes of several nodes, each node's settled in the order they were sent.

    The caller sends them (on threads) and keeps a handle for each: `due(names, now)` says which nodes to
    probe now (every PROBE_EVERY_S, at most MAX_IN_FLIGHT awaiting an answer each), `sent(name, at, handle)`
    records one, `settle(result)` takes each node's finished probes in order (`result(handle)` is
    (answered, monotonic time it was settled), or None while the probe still waits), and `gone(names, now)`
    lists (name, seconds silent, misses) for each node the rule calls gone, none when all of several are
    silent at once (that points at the prober's own link, not at every machine gone together). Nodes not
    named in `due` any more are forgotten.
    """

    period_s: float = field(default_factory=lambda: PROBE_EVERY_S)
    next_at: float = 0.0
    in_flight: dict[str, deque[tuple[float, Hashable]]] = field(default_factory=dict)
    seen: dict[str, Liveness] = field(default_factory=dict)

    def due(self, names: Collection[str], now: float) -> list[str]:
        for gone in set(self.in_flight) - set(names):
            del self.in_flight[gone]
            self.seen.pop(gone, None)
        if now < self.next_at:
            return []
        self.next_at = now + self.period_s
        return [n for n in names if len(self.in_flight.get(n, ())) < MAX_IN_FLIGHT]

    def sent(self, name: str, at: float, handle: Hashable) -> None:
        self.in_flight.setdefault(name, deque()).append((at, handle))

    def settle(self, result: Callable[[Hashable], tuple[bool, float] | None]) -> None:
        for name, queue in self.in_flight.items():
            state = self.seen.setdefault(name, Liveness())
            while queue:
                done = result(queue[0][1])
                if done is None:
                    break
                sent, _ = queue.popleft()
                answered, at = done
                if answered:
                    state.answered()
                else:
                    state.missed(sent, at)

    def gone(self, names: Collection[str], now: float) -> list[tuple[str, float, int]]:
        silent = [n for n in names if n in self.seen and self.seen[n].silent_since is not None]
        if len(names) > 1 and len(silent) == len(names):
            return []
        out = []
        for n in silent:
            state = self.seen[n]
            if state.gone(now):
                out.append((n, now - state.silent_since, state.misses))
        return out
