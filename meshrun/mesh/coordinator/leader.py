"""Which coordinator leads: an etcd key held with the leader's lease.

With several coordinators (`meshrun coordinator add`), every one answers enrolment and sync, but one
decides what a single mind must: observed endpoints, every pair's path and relay, new member-list
versions (meshrun.mesh.coordinator.daemon). That one holds K_LEADER, written with a lease it keeps alive
each tick; when it stops (machine gone, partitioned from etcd's majority), the lease runs out after
LEASE_TTL_S and the next coordinator to try takes the key. The key's value is this coordinator's fence
(its name and a nonce): everything only a leader writes compares it (EtcdCoordinatorDB.fence), so a
coordinator that lost the lead without noticing writes nothing.
"""

from __future__ import annotations

import logging
import secrets
import time

from meshrun.errors import ControlStateError
from meshrun.system.control.etcd import Compare, Put
from meshrun.system.control.etcdstate import K_LEADER

log = logging.getLogger("meshrun.mesh.coordinator.leader")

LEASE_TTL_S = 5  # a lost leader is replaced within this (plus one tick)


def leader_name(fence: bytes | None) -> str | None:
    """The coordinator name in a fence (K_LEADER's value), None for none."""
    return fence.decode().split("/", 1)[0] if fence else None


class Leadership:
    """This coordinator's side of the election; `step()` once a tick. Not thread-safe: the loop owns it."""

    def __init__(self, client, name: str, ttl: int = LEASE_TTL_S, clock=time.monotonic) -> None:
        self.client = client
        self.name = name
        self.ttl = ttl
        self.clock = clock
        self.fence = f"{name}/{secrets.token_hex(8)}".encode()
        self.lease = 0
        self.leading = False
        self.renewed = 0.0  # clock() of the last keep-alive etcd confirmed
        self.current: bytes | None = None  # K_LEADER's value as last read (whoever leads)

    def step(self) -> bool:
        """Keep the lease alive, take the lead when nobody holds it; whether this coordinator leads now.

        Unable to reach etcd's majority, it stops leading once its lease may have run out (it cannot know
        that it still holds the key): another coordinator may be leading by then."""
        try:
            if self.lease and self.client.lease_keepalive(self.lease) > 0:
                self.renewed = self.clock()
            else:
                self.lease = self.client.lease_grant(self.ttl)
                self.renewed = self.clock()
                self.leading = False  # the key went with the old lease, if it had it
            res = self.client.txn(
                [Compare(K_LEADER, "CREATE", "EQUAL", 0)],
                [Put(K_LEADER, self.fence, self.lease)],
            )
            if res.succeeded:
                self.current = self.fence
            else:
                kv = self.client.get(K_LEADER)
                self.current = kv.value if kv is not None else None
            was = self.leading
            self.leading = self.current == self.fence
            if self.leading and not was:
                log.info("this coordinator (%s) leads now", self.name)
            elif was and not self.leading:
                log.warning("this coordinator (%s) lost the lead to %s", self.name, leader_name(self.current))
        except ControlStateError as exc:
            if self.leading and self.clock() - self.renewed >= self.ttl - 1:
                log.warning("cannot reach etcd's majority (%s): no longer leading", exc)
                self.leading = False
            self.current = self.fence if self.leading else None
        return self.leading

    @property
    def leader(self) -> str | None:
        """The leading coordinator's name as last seen, None when unknown."""
        return leader_name(self.current)

    def resign(self) -> None:
        """Give the lead (and the lease) back at once: a clean stop hands over without waiting LEASE_TTL_S."""
        if self.lease:
            try:
                self.client.lease_revoke(self.lease)
            except ControlStateError as exc:
                log.warning("could not give the lead back (%s): it passes on in %d s", exc, self.ttl)
        self.lease, self.leading = 0, False
