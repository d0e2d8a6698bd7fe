"""Sites: which members share a private network, from what they said and what their pairs proved. Pure.

A site is a set of members that reach each other directly on a private network (a datacenter's LAN or
fabric). A member that joined with ``--site NAME`` is in site NAME. A member without one is put with
the members it reaches on the private path (a verified ``private`` pair: both behind one public
address, their LAN addresses answering each other, see meshrun.core.pairpaths): such a group takes the
site name one of them was given (the first by name), else ``lan-`` and the public address they share.
A member that reaches no one privately is a site of its own, named after itself.

A job numbers its sites in the order of its ranks (`placement`): what ``MESHRUN_SITE_RANK`` and
``MESHRUN_NUM_SITES`` say to its workers (meshrun.core.launch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshrun.core.model import Member
from meshrun.core.pairpaths import PRIVATE, PairState, host_of, private_candidate

__all__ = ["Site", "Placement", "assign", "placement"]


@dataclass(frozen=True)
class Site:
    """A member's site: its name, the member's own address on the site network ("" when it has no
    private candidate), and whether the name was inferred (no ``--site`` given to any member of it)."""

    name: str
    addr: str = ""
    inferred: bool = False


@dataclass(frozen=True)
class Placement:
    """A node's site within one job: name, index among the job's sites, their number, its site address."""

    site: str
    rank: int
    count: int
    addr: str = ""


def assign(members: Sequence[Member], pairs: Mapping[tuple[str, str], PairState]) -> dict[str, Site]:
    """Every member's site, by name (the coordinator's too)."""
    names = sorted(m.name for m in members)
    by_name = {m.name: m for m in members}
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for (a, b), st in pairs.items():
        if st.mode != PRIVATE or not st.verified or a not in parent or b not in parent:
            continue
        # Two members told apart by --site stay apart even if their LANs answer each other.
        sa, sb = by_name[a].site, by_name[b].site
        if sa and sb and sa != sb:
            continue
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)
    out: dict[str, Site] = {}
    for group in groups.values():
        given = sorted({by_name[n].site for n in group if by_name[n].site})
        if given:
            inferred_name, inferred = given[0], False
        elif len(group) > 1:
            inferred_name, inferred = f"lan-{host_of(by_name[group[0]].endpoint) or group[0]}", True
        else:
            inferred_name, inferred = group[0], True
        for n in group:
            m = by_name[n]
            addr = host_of(private_candidate(m)) or ""
            out[n] = Site(m.site or inferred_name, addr, inferred=not m.site and inferred)
    return out


def placement(order: Sequence[str], sites: Mapping[str, Site]) -> dict[str, Placement]:
    """Each of `order`'s members (a job's nodes, in rank order) with its site's index among the job's sites
    (in order of first appearance) and their number. A member with no site is a site of its own."""
    site_of = {n: sites[n] if n in sites else Site(n) for n in order}
    index: dict[str, int] = {}
    for n in order:
        index.setdefault(site_of[n].name, len(index))
    # The site address is worth giving only when the site has another node of the job to talk to.
    sizes: dict[str, int] = {}
    for n in order:
        sizes[site_of[n].name] = sizes.get(site_of[n].name, 0) + 1
    return {
        n: Placement(
            site_of[n].name,
            index[site_of[n].name],
            len(index),
            site_of[n].addr if sizes[site_of[n].name] > 1 else "",
        )
        for n in order
    }
