"""Telling a machine that is gone from one that is slow, from probes of its agent's port (pure).

The supervisor sends a TCP handshake to every node of a job each PROBE_EVERY_S. The node's kernel
answers it (with SYN-ACK, or RST where the agent is down), however busy the agent or its training
processes are, so only a machine that is gone, or cut off the overlay, stays silent. A node is called
gone once it has been silent for GONE_AFTER_S across at least MIN_MISSES probes in a row: one lost
datagram, or a second of a starved WireGuard, is not enough. An agent that answers the handshake but
not its API is left to the slower rule (the supervisor's LOST_AFTER_S).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 1.5  # one SYN, no retransmission (Linux resends a SYN after 1 s, then 3 s)
# 3 s: under load (busy loops on every core, an iperf3 flood through meshrun0) 0 of 179 probes was missed and
# the slowest answer took 0.23 s (benchmarks/results/loss_detection.json), so three 1.5 s timeouts in a row
# say the machine is gone; each second here is a second of every survivor's standstill (issue 39: < 15 s).
GONE_AFTER_S = 3.0
MIN_MISSES = 3


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
