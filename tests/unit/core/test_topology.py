"""meshrun.core.topology: members' sites from `--site` and from proven private paths, and a job's numbering."""

from __future__ import annotations

from meshrun.core import topology
from meshrun.core.model import Member
from meshrun.core.pairpaths import PRIVATE, PUBLIC, PairState
from meshrun.core.topology import Placement, Site

KEY = "A" * 43 + "="


def node(name: str, public: str, lan: str | None, site: str = "") -> Member:
    return Member(name, KEY, "10.213.0.9", f"{public}:40000", (f"{lan}:51820",) if lan else (), site=site)


def private(verified: bool = True) -> PairState:
    return PairState(PRIVATE, 0.0, verified)


# Two datacenters of two nodes each behind their own NAT, and one node alone.
DC1 = [node("a1", "198.51.100.1", "10.1.0.2"), node("a2", "198.51.100.1", "10.1.0.3")]
DC2 = [node("b1", "198.51.100.2", "10.2.0.2"), node("b2", "198.51.100.2", "10.2.0.3")]
LONE = node("c1", "198.51.100.3", "10.3.0.2")
PAIRS = {("a1", "a2"): private(), ("b1", "b2"): private(), ("a1", "b1"): PairState(PUBLIC, 0.0, True)}


def test_members_whose_private_path_works_form_a_site_named_after_their_public_address():
    sites = topology.assign([*DC1, *DC2, LONE], PAIRS)
    assert sites["a1"] == Site("lan-198.51.100.1", "10.1.0.2", inferred=True)
    assert sites["a2"] == Site("lan-198.51.100.1", "10.1.0.3", inferred=True)
    assert sites["b1"].name == sites["b2"].name == "lan-198.51.100.2"
    assert sites["c1"] == Site("c1", "10.3.0.2", inferred=True)  # reaches no one privately: a site of its own


def test_a_private_path_not_yet_proven_makes_no_site():
    sites = topology.assign(DC1, {("a1", "a2"): private(verified=False)})
    assert sites["a1"].name == "a1" and sites["a2"].name == "a2"


def test_a_given_site_names_the_group_and_keeps_apart_what_it_tells_apart():
    named = [node("a1", "198.51.100.1", "10.1.0.2", site="fra"), DC1[1]]
    sites = topology.assign(named, PAIRS)
    assert sites["a1"] == Site("fra", "10.1.0.2") and sites["a2"] == Site("fra", "10.1.0.3")  # a2 takes a1's name
    apart = [node("a1", "198.51.100.1", "10.1.0.2", site="x"), node("a2", "198.51.100.1", "10.1.0.3", site="y")]
    sites = topology.assign(apart, PAIRS)
    assert (sites["a1"].name, sites["a2"].name) == ("x", "y")
    # Given without any private path (no LAN candidate): the name alone groups, there is no site address.
    far = [node("p", "203.0.113.1", None, site="pool"), node("q", "203.0.113.2", None, site="pool")]
    assert topology.assign(far, {}) == {"p": Site("pool"), "q": Site("pool")}


def test_a_job_numbers_its_sites_in_rank_order_and_gives_site_addresses_only_to_shared_sites():
    sites = topology.assign([*DC1, *DC2, LONE], PAIRS)
    got = topology.placement(["b2", "a1", "c1", "a2", "b1"], sites)
    assert got == {
        "b2": Placement("lan-198.51.100.2", 0, 3, "10.2.0.3"),
        "a1": Placement("lan-198.51.100.1", 1, 3, "10.1.0.2"),
        "c1": Placement("c1", 2, 3, ""),  # alone in the job: no site network to use
        "a2": Placement("lan-198.51.100.1", 1, 3, "10.1.0.3"),
        "b1": Placement("lan-198.51.100.2", 0, 3, "10.2.0.2"),
    }
    # A job on one node of a site: the site network has no one else of the job on it.
    assert topology.placement(["a1", "b1"], sites)["a1"] == Placement("lan-198.51.100.1", 0, 2, "")
    # A member the coordinator does not know (a share planned alone): a site of its own.
    assert topology.placement(["new"], {}) == {"new": Placement("new", 0, 1, "")}
