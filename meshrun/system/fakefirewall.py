"""An in-memory stand-in for meshrun.system.firewall, for tests that must not touch the kernel.

The same three calls the job API makes (`allow`, `sweep`), recorded; a share started by a fake start
function never makes a guard, so nothing else is needed.
"""

from __future__ import annotations

from collections.abc import Iterable


class FakeFirewall:
    """Records `allow` calls; `sweep` removes nothing."""

    def __init__(self) -> None:
        self.allowed: list[tuple[str, str, list[str]]] = []
        self.sweeps = 0

    def allow(self, job_id: str, node: str, ips: Iterable[str]) -> None:
        from meshrun.core import firewall as rules
        rules.add_allowed(rules.job_table(job_id, node), ips)     # the same checks as the real one
        self.allowed.append((job_id, node, list(ips)))

    def sweep(self) -> list[str]:
        self.sweeps += 1
        return []
