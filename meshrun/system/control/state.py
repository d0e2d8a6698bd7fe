"""`ControlState`: the coordinator's control state as the rest of meshrun sees it, whatever keeps it.

Two implementations: `coordinatordb.CoordinatorDB` (SQLite, one coordinator) and `etcdstate.EtcdCoordinatorDB`
(etcd, several coordinators; its client may be `fakeetcd.FakeEtcd` in tests). Both are held to one contract,
tests/control_state_contract.py, run against SQLite, etcd in memory and a real etcd by
tests/unit/system/test_control_state.py: a third backend is one module here and one fixture there.

What the protocol holds: network metadata and the member list's version; join tokens; members (enrolment
under meshrun.core.admission's rules, heartbeats, what WireGuard observed, removal for good); each node pair's
path (meshrun.core.pairpaths); the coordinators' public faces; and the whole state as a dump, which is how it
moves from one backend to the other (`meshrun coordinator add` and the last `remove`). Jobs are not in it: a
lone coordinator keeps a job in its directory (system/files/joblogs), several replicate it in etcd
(etcdjobs.JobReplica), and only the latter needs a store the coordinators share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from meshrun.core.model import Member
from meshrun.core.pairpaths import PairState
from meshrun.system.control.coordinatordb import CoordinatorInfo, TokenInfo

__all__ = ["ControlState"]


class ControlState(Protocol):
    """The coordinator's state: every method is safe from several threads, and each write is atomic (all of
    it or none). `path` names the store in errors; `removals` counts members seen removed, so views kept in
    memory (the roster) know to drop theirs."""

    path: object
    readonly: bool
    removals: int

    def close(self) -> None: ...

    # network metadata and the member list's version (agents long-poll on it)
    def set_meta(self, **values: str) -> None: ...
    def meta(self, key: str) -> str | None: ...
    def version(self) -> int: ...
    def bump_version(self) -> int: ...

    # join tokens (the secret only ever as its hash)
    def add_token(
        self, token_id: str, secret: bytes, ttl_s: int, max_uses: int | None, now: float | None = None
    ) -> None: ...
    def tokens(self) -> list[TokenInfo]: ...
    def revoke_token(self, token_id: str, now: float | None = None) -> bool: ...

    # members
    def add_coordinator(self, name: str, public_key: str, overlay_ip: str) -> None: ...
    def enrol(
        self,
        token_id: str,
        secret: bytes,
        name: str,
        public_key: str,
        candidates: list[str],
        cidr: str,
        now: float | None = None,
    ) -> tuple[Member, bool]: ...
    def members(self) -> list[Member]: ...
    def member_by_ip(self, ip: str) -> Member | None: ...
    def member_by_name(self, name: str) -> Member | None: ...
    def recently_removed(self, grace_s: float, now: float | None = None) -> list[Member]: ...
    def is_removed_ip(self, ip: str) -> bool: ...
    def is_removed_key(self, public_key: str) -> bool: ...
    def abandon(self, name: str, public_key: str, now: float | None = None) -> bool: ...
    def remove_member(self, name: str, now: float | None = None) -> Member | None: ...
    def heartbeat(
        self,
        ip: str,
        candidates: list[str],
        now: float | None = None,
        touch: bool = False,
        mtu: int | None = None,
        site: str | None = None,
        relay: bool | None = None,
        tunnels: int | None = None,
    ) -> None: ...
    def observe(self, observations: dict[str, tuple[str | None, int]]) -> bool: ...

    # node pairs' paths
    def pairs(self) -> dict[tuple[str, str], PairState]: ...
    def save_pairs(self, states: Mapping[tuple[str, str], PairState], drop: Iterable[str] = ()) -> None: ...

    # the coordinators (one row for a lone coordinator)
    def coordinators(self) -> list[CoordinatorInfo]: ...

    # the whole state, to move it between backends
    def dump(self) -> dict: ...
    def load(self, dump: dict) -> None: ...
