"""Trusted sites on the coordinator: `meshrun site list|trust|untrust`, and the `lan` mark the roster gives pairs.

The roster runs on a real CoordinatorDB (SQLite in tmp_path) with a real PairDriver loading the pair states
saved there; admin, the CLI and the whole loop run on a real coordinator state (tests/fakemesh.py), whose
agents keep their site LAN path on a FakeLanLink (meshrun.system.kernel.lanlink): no root, no kernel.
"""

from __future__ import annotations

import json

import pytest
from fakemesh import FakeMesh
from support import JOB_NETWORK
from typer.testing import CliRunner

from meshrun.cli import app
from meshrun.core import lanpath, pairpaths
from meshrun.core.model import Member
from meshrun.core.pairpaths import PRIVATE, PUBLIC, PairState
from meshrun.errors import UsageError
from meshrun.mesh.coordinator import admin
from meshrun.mesh.coordinator.pairs import PairDriver
from meshrun.mesh.coordinator.roster import Roster
from meshrun.mesh.node.lan import LanPaths
from meshrun.system.control.coordinatordb import CoordinatorDB
from meshrun.system.kernel.lanlink import FakeLanLink

T0 = 1_700_000_000.0
NET = JOB_NETWORK  # overlay 10.213.0.0/16 on meshrun0
# name -> (site, LAN address); a, b, c and d share dc1, e is in dc2, f and g in dc3, h in none.
NODES = {
    "a": ("dc1", "10.1.0.2"),
    "b": ("dc1", "10.1.0.3"),
    "c": ("dc1", "10.1.0.4"),
    "d": ("dc1", "10.1.0.5"),
    "e": ("dc2", "10.2.0.2"),
    "f": ("dc3", "10.3.0.2"),
    "g": ("dc3", "10.3.0.3"),
    "h": ("", "10.1.0.9"),
}
PAIRS = {
    ("a", "b"): PairState(PRIVATE, T0, True),  # proven, private, same site
    ("a", "c"): PairState(PRIVATE, T0, False),  # private, not proven yet
    ("a", "d"): PairState(PUBLIC, T0, True),  # proven, but over the public addresses
    ("a", "e"): PairState(PRIVATE, T0, True),  # across sites
    ("f", "g"): PairState(PRIVATE, T0, True),  # dc3 is never trusted here
    ("a", "h"): PairState(PRIVATE, T0, True),  # h named no site
}


def key(i: int) -> str:
    return f"{i:042d}A="


@pytest.fixture
def db(tmp_path):
    d = CoordinatorDB.create(tmp_path / "coordinator.db")
    d.add_coordinator("coordinator", NET.coordinator_public_key, NET.coordinator_ip)
    d.add_token("tok0000001", b"s" * 32, 3600, None)
    for i, (name, (site, lan)) in enumerate(NODES.items()):
        m, _ = d.enrol("tok0000001", b"s" * 32, name, key(i), [], NET.cidr)
        d.heartbeat(m.overlay_ip, [f"{lan}:51820"], site=site or None)
    d.save_pairs(PAIRS)
    yield d
    d.close()


def trust(db: CoordinatorDB, *sites: str) -> None:
    db.set_meta(**{lanpath.TRUST_META: lanpath.trusted_to_meta(sites)})


def roster(db: CoordinatorDB) -> Roster:
    return Roster(db, NET, PairDriver(db))


def member(db: CoordinatorDB, name: str) -> Member:
    m = db.member_by_name(name)
    assert m is not None
    return m


def lan_peers(r: Roster, caller: Member | None) -> set[str]:
    return {d["name"] for d in r.payload(caller) if d.get("lan")}


def test_every_pair_inside_a_trusted_site_is_offered_the_lan_path_and_no_other(db):
    """Whatever path its WireGuard pair takes (proven, unproven, public): the ends' probes decide."""
    trust(db, "dc1", "dc2")
    r = roster(db)
    assert r.trusted == {"dc1": "vxlan", "dc2": "vxlan"}
    assert lan_peers(r, member(db, "a")) == {"b", "c", "d"}
    assert lan_peers(r, member(db, "b")) == {"a"}  # both ends (b-c and b-d have no pair state here)
    assert lan_peers(r, member(db, "d")) == {"a"}
    # Not e (another site, though trusted), h (no site), f and g (dc3, untrusted), nor the coordinator.
    for name in ("e", "h", "f", "g"):
        assert lan_peers(r, member(db, name)) == set(), name
    assert lan_peers(r, member(db, "coordinator")) == set()
    assert lan_peers(r, None) == set()
    entry = next(d for d in r.payload(member(db, "a")) if d["name"] == "b")
    assert entry["path"] == PRIVATE and entry["endpoint"] == "10.1.0.3:51820"
    assert Member.from_dict(entry).lan is True  # as the agent reads it


def test_an_encapsulation_change_is_published_to_the_sites_members_with_the_routed_mark(db):
    """`meshrun site trust dc1 --encapsulation none` on a trusted site: only dc1's members hear of each other
    again, now marked routed; back to vxlan, again, without the mark."""
    trust(db, "dc1", "dc2")
    r = roster(db)
    r.publish(db.bump_version())
    known = r.version
    db.set_meta(**lanpath.trust_to_meta({"dc1": "none", "dc2": "vxlan"}))
    assert r.trust_moved()
    r.publish(db.bump_version())
    delta = r.delta(member(db, "a"), known)
    assert delta is not None
    changed = {d["name"]: d for d in delta["changed"]}
    assert set(changed) == {"b", "c", "d"}
    assert all(changed[n]["lan"] is True and changed[n]["lan_routed"] is True for n in changed)
    assert r.delta(member(db, "e"), known) == {"since": known, "changed": [], "removed": []}  # dc2 stays vxlan
    assert lanpath.plan(member(db, "a").public_key, [Member.from_dict(d) for d in r.payload(member(db, "a"))]).routed
    known = r.version
    db.set_meta(**lanpath.trust_to_meta({"dc1": "vxlan", "dc2": "vxlan"}))
    r.publish(db.bump_version())
    delta = r.delta(member(db, "b"), known)
    assert delta is not None and {d["name"] for d in delta["changed"]} == {"a", "c", "d"}  # dc1's others
    assert not any(d.get("lan_routed") for d in delta["changed"])


def test_nothing_takes_the_lan_path_while_no_site_is_trusted(db):
    r = roster(db)
    assert r.trusted == {} and not r.trust_moved()
    assert all(lan_peers(r, member(db, n)) == set() for n in NODES)


def test_an_untrusted_site_keeps_its_proven_private_pairs_on_wireguard(db):
    trust(db, "dc1")
    r = roster(db)
    assert lan_peers(r, member(db, "f")) == set() and lan_peers(r, member(db, "g")) == set()


def test_a_trust_change_is_published_to_the_sites_members_as_a_delta(db):
    r = roster(db)
    a, e = member(db, "a"), member(db, "e")
    known = r.version
    trust(db, "dc1")
    assert r.trust_moved()  # `meshrun site trust` ran in another process: the daemon publishes
    r.publish(db.bump_version())
    assert not r.trust_moved()
    delta = r.delta(a, known)
    assert delta is not None
    changed = {d["name"]: d for d in delta["changed"]}
    assert set(changed) == {"b", "c", "d"}  # every other member of dc1, not e, f, g, h or the coordinator
    assert all(changed[n].get("lan") is True for n in ("b", "c", "d"))
    assert delta["removed"] == []
    assert r.delta(e, known) == {"since": known, "changed": [], "removed": []}  # dc2: nothing moved for it
    # And back: untrusted, the same members hear of each other again, without the mark.
    known = r.version
    trust(db)
    assert r.trust_moved()
    r.publish(db.bump_version())
    delta = r.delta(member(db, "b"), known)
    assert delta is not None and {d["name"] for d in delta["changed"]} == {"a", "c", "d"}
    assert not any(d.get("lan") for d in delta["changed"])
    assert not r.trust_moved()


def test_unreadable_trust_metadata_trusts_nothing(db):
    db.set_meta(**{lanpath.TRUST_META: "{not json"})
    r = roster(db)
    assert r.trusted == {} and not r.trust_moved()
    assert lan_peers(r, member(db, "a")) == set()


# admin and CLI, on a real coordinator state ------------------------------------------------------------


@pytest.fixture
def mesh(tmp_path):
    return FakeMesh(tmp_path)


def join(mesh: FakeMesh, name: str, public: str, private: str, site: str | None):
    """Enrol `name`; its agent's site LAN path runs on a FakeLanLink whose probes always answer."""
    n = mesh.join(name, public, private, site=site)
    n.agent.lan = LanPaths(n.state, n.agent.network, n.agent.rec, FakeLanLink, lambda ip, port, source: 0.001)
    return n


@pytest.mark.parametrize("name", ["BAD_NAME!", "DC1", "", "x" * 40, "dc 1"])
def test_a_bad_site_name_is_refused_naming_it(mesh, name):
    for trusted in (True, False):
        with pytest.raises(UsageError) as err:
            admin.trust_site(mesh.coord_state, name, trusted)
        assert repr(name) in err.value.message and err.value.fix == "see the sites with `meshrun site list`"
    assert admin.site_table(mesh.coord_state) == []


def test_untrusting_a_site_that_is_not_trusted_is_refused(mesh):
    with pytest.raises(UsageError, match="site 'dc1' is not trusted") as err:
        admin.trust_site(mesh.coord_state, "dc1", False)
    assert err.value.fix == "trusted sites: none"
    admin.trust_site(mesh.coord_state, "dc2")
    with pytest.raises(UsageError) as err:
        admin.trust_site(mesh.coord_state, "dc1", False)
    assert err.value.fix == "trusted sites: dc2"


def test_the_site_table_lists_named_and_trusted_sites(mesh):
    join(mesh, "a", "198.51.100.9:40000", "10.1.0.2:51820", "dc1")
    join(mesh, "b", "198.51.100.9:40002", "10.1.0.3:51820", "dc1")
    join(mesh, "c", "198.51.100.7:40000", "10.2.0.2:51820", "dc2")
    join(mesh, "d", "198.51.100.6:40000", "10.3.0.2:51820", None)
    assert admin.site_table(mesh.coord_state) == []  # a node's site is what its agent reports when it syncs
    mesh.sync()
    assert admin.trust_site(mesh.coord_state, "dc1") == {"nodes": ["a", "b"], "was": None}
    # Again: the same, no error, and it says it was trusted already.
    assert admin.trust_site(mesh.coord_state, "dc1") == {"nodes": ["a", "b"], "was": "vxlan"}
    assert admin.trust_site(mesh.coord_state, "lab9") == {"nodes": [], "was": None}  # no node there yet
    assert admin.site_table(mesh.coord_state) == [
        {"site": "dc1", "nodes": ["a", "b"], "trusted": True, "encapsulation": "vxlan"},
        {"site": "dc2", "nodes": ["c"], "trusted": False, "encapsulation": None},
        {"site": "lab9", "nodes": [], "trusted": True, "encapsulation": "vxlan"},
    ]
    assert admin.trust_site(mesh.coord_state, "lab9", False) == {"nodes": [], "was": "vxlan"}
    assert [r["site"] for r in admin.site_table(mesh.coord_state)] == ["dc1", "dc2"]


def test_trusting_a_site_puts_its_proven_pair_on_the_lan_path_and_untrusting_takes_it_off(mesh):
    a = join(mesh, "a", "198.51.100.9:40000", "10.1.0.2:51820", "dc1")
    b = join(mesh, "b", "198.51.100.9:40002", "10.1.0.3:51820", "dc1")
    c = join(mesh, "c", "198.51.100.7:40000", "10.2.0.2:51820", "dc2")
    for n in (a, b, c):
        mesh.see(n)
    for _ in range(3):
        mesh.sync()
    mesh.handshake(a, b)
    mesh.sync()  # the agents report it, the next tick judges it
    mesh.sync()
    assert mesh.coord.pairs.mode("a", "b") == PairState(PRIVATE, mesh.coord.pairs.mode("a", "b").since, True)
    assert not mesh.member_seen_by(a, b).lan and a.agent.lan.plan == lanpath.LanPlan(None)

    admin.trust_site(mesh.coord_state, "dc1")
    mesh.sync()  # the tick sees the trust moved and publishes; the agents get it
    assert mesh.member_seen_by(a, b).lan and mesh.member_seen_by(b, a).lan
    assert not mesh.member_seen_by(a, c).lan and not mesh.member_seen_by(c, a).lan
    assert a.agent.lan.plan == lanpath.LanPlan("10.1.0.2", (lanpath.LanPeer("b", b.ip, "10.1.0.3"),))
    assert b.agent.lan.link.peers == {a.ip: lanpath.LanPeer("a", a.ip, "10.1.0.2")}
    assert c.agent.lan.link.calls == []
    for _ in range(lanpath.PROBE_OKS):
        a.agent.lan.check()
    assert a.agent.lan.active() == ["b"]
    assert a.state.read_json("lan.json")["active"] == ["b"]

    admin.trust_site(mesh.coord_state, "dc1", False)
    mesh.sync()
    assert not mesh.member_seen_by(a, b).lan
    assert a.agent.lan.plan == lanpath.LanPlan(None) and a.agent.lan.link.calls[-1] == ("delete",)
    assert a.agent.lan.active() == []
    assert mesh.member_seen_by(a, b).path == pairpaths.PRIVATE  # the pair stays on its WireGuard tunnel


@pytest.fixture
def cli(mesh):
    runner = CliRunner()

    def invoke(*args: str):
        env = {"MESHRUN_STATE_DIR": str(mesh.coord_state.path), "MESHRUN_DEBUG": ""}
        return runner.invoke(app, list(args), env=env, catch_exceptions=False)

    return invoke


def test_the_cli_refuses_a_bad_site_name_in_one_line(cli):
    res = cli("site", "trust", "BAD_NAME!")
    assert res.exit_code != 0 and res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun: error: ") and "'BAD_NAME!'" in lines[0]
    assert "Traceback" not in res.stderr
    res = cli("site", "untrust", "dc1")
    assert res.exit_code != 0 and len(res.stderr.splitlines()) == 1 and "is not trusted" in res.stderr


def test_the_cli_trusts_lists_and_untrusts_a_site(mesh, cli):
    join(mesh, "a", "198.51.100.9:40000", "10.1.0.2:51820", "dc1")
    mesh.sync()
    res = cli("site", "trust", "dc1")
    assert res.exit_code == 0 and "site dc1 trusted" in res.stdout and res.stderr == ""
    res = cli("site", "trust", "dc7")
    assert res.exit_code == 0 and "no node has joined with --site dc7 yet" in res.stderr
    res = cli("site", "list", "--json")
    assert res.exit_code == 0
    assert json.loads(res.stdout) == [
        {"site": "dc1", "nodes": ["a"], "trusted": True, "encapsulation": "vxlan"},
        {"site": "dc7", "nodes": [], "trusted": True, "encapsulation": "vxlan"},
    ]
    # The encapsulation changes in the open, and an unknown one changes nothing.
    res = cli("site", "trust", "dc7", "--encapsulation", "none")
    assert res.exit_code == 0 and "site dc7: encapsulation vxlan -> none" in res.stdout
    res = cli("site", "trust", "dc7", "--encapsulation", "none")
    assert res.exit_code == 0 and "dc7 was already trusted (none); nothing changed" in res.stdout
    res = cli("site", "trust", "dc1", "--encapsulation", "ipip")
    assert res.exit_code != 0 and len(res.stderr.splitlines()) == 1
    assert "encapsulation 'ipip'" in res.stderr and "vxlan, none" in res.stderr
    res = cli("site", "list")
    assert res.exit_code == 0
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["SITE", "NETWORK", "NODES"]
    assert lines[1].split()[0] == "dc1" and "trusted (site LAN path, vxlan)" in lines[1] and lines[1].endswith("a")
    assert lines[2].split()[0] == "dc7" and "trusted (site LAN path, none)" in lines[2] and lines[2].endswith("-")
    res = cli("site", "untrust", "dc1")
    assert res.exit_code == 0 and "site dc1 untrusted" in res.stdout
    rows = json.loads(cli("site", "list", "--json").stdout)
    assert [(r["site"], r["trusted"]) for r in rows] == [("dc1", False), ("dc7", True)]  # dc1 is still named


def test_a_member_whose_site_arrives_after_the_trust_hears_of_its_site_peers_and_they_of_it(db):
    """A node's first list is made before its first heartbeat reports its site: when the site arrives, it and
    the trusted site's members get each other again, now with the mark (seen on a GPU machine: one end of a
    pair on the LAN path, the other never told)."""
    trust(db, "dc1")
    r = roster(db)
    r.publish(db.bump_version())
    known = r.version
    h = member(db, "h")
    assert lan_peers(r, h) == set()  # h has no site yet
    db.heartbeat(h.overlay_ip, ["10.1.0.9:51820"], site="dc1")
    r.publish(db.version())
    mine = {d["name"]: d for d in r.delta(member(db, "h"), known)["changed"]}
    assert mine["a"].get("lan") is True, mine
    theirs = {d["name"]: d for d in r.delta(member(db, "a"), known)["changed"]}
    assert theirs["h"].get("lan") is True, theirs
