"""Member-list deltas: what changed between two member-list versions, and applying it on a node.

Pure. For every version it publishes, the coordinator records which members changed (joined, new
endpoint, candidates or MTU), which were removed, and for which node pairs the path changed
(`History.record`). An agent holding version K then receives only the members that changed for it
since K (`History.since`) and applies them to the list it holds (`apply_delta`): one join in a mesh
of n members costs O(n) bytes in all, not O(n^2). An agent further behind than the history reaches
(or any agent after a coordinator restart: the history lives in memory) gets the full list again.

A member's `last_handshake` (with the coordinator) is informational and changes without a new
version, so it does not make a member "changed": a node's copy of it may lag.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from meshrun.core.model import Member

HISTORY_SIZE = 512  # published versions a delta can reach back over


def signature(m: Member) -> tuple:
    """What a member-list version says about `m` for every receiver alike (not its per-receiver path,
    not the informational last_handshake): members with equal signatures need not be sent again."""
    return (m.name, m.overlay_ip, m.endpoint, m.candidates, m.is_coordinator, m.mtu)


def member_changes(old: Mapping[str, tuple], new: Mapping[str, tuple]) -> tuple[frozenset[str], frozenset[str]]:
    """(keys added or changed, keys removed) from one {public key: signature} map to the next."""
    return (frozenset(k for k, sig in new.items() if old.get(k) != sig), frozenset(k for k in old if k not in new))


@dataclass(frozen=True)
class Change:
    """What one published version changed, relative to the version published before it."""

    start: int  # the version published before
    end: int  # this version
    members: frozenset[str]  # keys of members added or changed (for everyone)
    removed: frozenset[str]  # keys of members removed
    paths: Mapping[str, frozenset[str]]  # node name -> keys of the peers whose path with it changed


class History:
    """The changes of the last `size` published versions, starting at `version`."""

    def __init__(self, version: int, size: int = HISTORY_SIZE) -> None:
        self.oldest = version  # `since` answers for versions from here on
        self.latest = version
        self.size = size
        self.changes: deque[Change] = deque()

    def record(
        self,
        version: int,
        members: Collection[str] = (),
        removed: Collection[str] = (),
        paths: Mapping[str, Collection[str]] | None = None,
    ) -> None:
        """Publishing `version` changed these members, removed these, and changed these pairs' paths.

        A record that names no newer version joins the latest change (versions only move on; what
        an agent holding the latest version was told already covers it once it is re-sent).
        """
        members, removed = frozenset(members), frozenset(removed)
        paths = {n: frozenset(keys) for n, keys in (paths or {}).items() if keys}
        if version <= self.latest:
            if not (members or removed or paths):
                return
            if self.changes:  # merge into the latest change
                last = self.changes.pop()
                merged = dict(last.paths)
                for n, keys in paths.items():
                    merged[n] = merged.get(n, frozenset()) | keys
                self.changes.append(
                    Change(last.start, last.end, last.members | members, last.removed | removed, merged)
                )
                return
            self.oldest = self.latest  # nothing to merge into: agents at `latest` get a full list
            version = self.latest + 1
        self.changes.append(Change(self.latest, version, members, removed, paths))
        self.latest = version
        while len(self.changes) > self.size:
            self.oldest = self.changes.popleft().end

    def since(self, known: int, node: str) -> tuple[set[str], set[str]] | None:
        """(keys of the members that changed for `node` since version `known`, keys removed since), or
        None when the history does not reach back to `known`: then only the full list will do."""
        if not self.oldest <= known <= self.latest:
            return None
        changed: set[str] = set()
        removed: set[str] = set()
        for c in reversed(self.changes):
            if c.end <= known:
                break
            changed |= c.members
            changed |= c.paths.get(node, frozenset())
            removed |= c.removed
        return changed - removed, removed


def apply_delta(members: Sequence[Member], changed: Sequence[Member], removed: Collection[str]) -> list[Member]:
    """`members` with `changed` put in place (by public key), new members appended in the order given,
    and the keys in `removed` dropped: the list the coordinator would have sent in full."""
    new = {m.public_key: m for m in changed}
    gone = set(removed)
    out = [new.pop(m.public_key, m) for m in members if m.public_key not in gone]
    out += [n for m in changed if (n := new.pop(m.public_key, None)) is not None and m.public_key not in gone]
    return out
