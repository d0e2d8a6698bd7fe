"""meshrun.core.lanpath: the site LAN path's names, numbers, plan, guard rules and probe record (pure).

The guard script is also checked by nft itself (`nft -c`, which changes nothing) where nft is installed and
this runs as root; elsewhere that one test skips, saying why.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess

import pytest

from meshrun.core import lanpath
from meshrun.core.lanpath import LanPeer, LanPlan
from meshrun.core.model import Member

OWN = "10.213.0.2"


def key(i: int) -> str:
    return f"{i:042d}A="


def member(i: int, *candidates: str, lan: bool = True, **kw) -> Member:
    return Member(f"n{i}", key(i), f"10.213.0.{i + 2}", f"198.51.100.9:{40000 + i}", tuple(candidates), lan=lan, **kw)


def me(*candidates: str) -> Member:
    return member(0, *candidates, lan=False)


# names and numbers ------------------------------------------------------------


@pytest.mark.parametrize("ip", ["10.213.0.2", "10.213.255.254", "100.64.0.1", "0.0.0.0", "255.255.255.255"])
def test_a_members_mac_is_locally_administered_unicast_and_carries_its_overlay_address(ip):
    mac = lanpath.mac_for(ip)
    octets = [int(x, 16) for x in mac.split(":")]
    assert len(octets) == 6 and all(len(x) == 2 for x in mac.split(":"))
    assert octets[0] & 0x02 and not octets[0] & 0x01  # locally administered, not multicast
    assert bytes(octets[2:]) == ipaddress.IPv4Address(ip).packed
    assert lanpath.mac_for(ip) == mac


def test_macs_differ_per_member():
    ips = [f"10.213.{i // 250}.{i % 250 + 2}" for i in range(600)]
    assert len({lanpath.mac_for(ip) for ip in ips}) == len(ips)


@pytest.mark.parametrize("name", ["lab", "prod", "a", "x" * 32, "cluster-7"])
def test_the_vni_is_stable_nonzero_and_24_bits(name):
    v = lanpath.vni(name)
    assert v == lanpath.vni(name) and 0 < v < 2**24


def test_networks_get_different_vnis():
    assert len({lanpath.vni(f"net{i}") for i in range(50)}) == 50


@pytest.mark.parametrize("iface", ["mr", "meshrun0", "meshrun-lab", "abcdefghijklmno"])
def test_the_lan_device_name_fits_the_kernels_15_characters(iface):
    name = lanpath.interface_name(iface)
    assert len(name) <= 15 and name.endswith("-lan") and name.startswith(iface[:11])
    assert name != iface


# plan ---------------------------------------------------------------------------


def test_the_plan_has_the_lan_peers_with_a_private_candidate_from_the_own_lan_address():
    members = [
        me("10.1.0.2:51820"),
        member(1, "10.1.0.3:51820"),
        member(2, "10.1.0.4:51820", lan=False),  # not marked by the coordinator
        member(3, "93.184.216.34:51820"),  # no private candidate
        member(4, "93.184.216.35:51820", "10.1.0.5:51820"),  # its first private one counts
        Member("coordinator", key(99), "10.213.0.1", "203.0.113.1:51820", is_coordinator=True),
    ]
    assert lanpath.plan(key(0), members) == LanPlan(
        "10.1.0.2", (LanPeer("n1", "10.213.0.3", "10.1.0.3"), LanPeer("n4", "10.213.0.6", "10.1.0.5"))
    )


def test_peers_are_sorted_by_name_and_the_member_itself_is_never_one():
    members = [member(3, "10.1.0.9:51820"), member(1, "10.1.0.8:51820"), member(0, "10.1.0.2:51820", lan=True)]
    plan = lanpath.plan(key(0), members)
    assert [p.name for p in plan.peers] == ["n1", "n3"] and plan.local_ip == "10.1.0.2"


def test_no_lan_path_without_an_own_lan_address_or_without_peers():
    peer = member(1, "10.1.0.3:51820")
    assert lanpath.plan(key(0), [me("93.184.216.34:51820"), peer]) == LanPlan(None)  # own: public only
    assert lanpath.plan(key(0), [me(), peer]) == LanPlan(None)  # own: no candidate at all
    assert lanpath.plan(key(0), [peer]) == LanPlan(None)  # not in the list
    assert lanpath.plan(key(0), [me("10.1.0.2:51820"), member(1, "10.1.0.3:51820", lan=False)]) == LanPlan(None)


def test_the_plan_is_routed_when_its_peers_are_marked_routed_and_not_when_one_is_not():
    own = me("10.1.0.2:51820")
    routed = [member(i, f"10.1.0.{i + 2}:51820", lan_routed=True) for i in (1, 2)]
    assert lanpath.plan(own.public_key, [own, *routed]).routed
    mixed = [routed[0], member(2, "10.1.0.4:51820")]  # a list caught between two trust changes: VXLAN
    assert not lanpath.plan(own.public_key, [own, *mixed]).routed
    assert not lanpath.plan(own.public_key, [own, member(1, "10.1.0.3:51820")]).routed


def test_the_trust_metadata_holds_each_sites_encapsulation():
    meta = lanpath.trust_to_meta({"dc1": "vxlan", "rack7": "none"})
    assert meta == {lanpath.TRUST_META: '["dc1", "rack7"]', lanpath.ROUTED_META: '["rack7"]'}
    assert lanpath.trust_from_meta(meta.get) == {"dc1": "vxlan", "rack7": "none"}
    # A routed list naming a site no longer trusted routes nothing (trust comes first).
    assert lanpath.trust_from_meta({lanpath.ROUTED_META: '["rack7"]'}.get) == {}
    # What coordinators wrote before encapsulations existed: every trusted site is VXLAN.
    assert lanpath.trust_from_meta({lanpath.TRUST_META: '["dc1"]'}.get) == {"dc1": "vxlan"}


def test_peers_sharing_a_lan_address_are_left_out():
    members = [
        me("10.1.0.2:51820"),
        member(1, "10.1.0.3:51820"),
        member(2, "10.1.0.3:51820"),  # the same LAN address as n1: neither is a LAN
        member(3, "10.1.0.2:51820"),  # the own LAN address
        member(4, "10.1.0.4:51820"),
    ]
    assert lanpath.plan(key(0), members) == LanPlan("10.1.0.2", (LanPeer("n4", "10.213.0.6", "10.1.0.4"),))


def test_an_ipv6_lan_candidate_plans_no_lan_path():
    # Candidates may be [v6]:port; the LAN path (and its guard) is IPv4. Such a peer stays on WireGuard.
    assert lanpath.plan(key(0), [me("10.1.0.2:51820"), member(1, "[fd00::3]:51820")]) == LanPlan(None)
    assert lanpath.plan(key(0), [me("[fd00::2]:51820"), member(1, "10.1.0.3:51820")]) == LanPlan(None)


# guard ------------------------------------------------------------------------------


PEERS = (LanPeer("n2", "10.213.0.4", "10.1.0.20"), LanPeer("n1", "10.213.0.3", "10.1.0.3"))


def _hex(ip: str) -> str:
    return "0x" + ipaddress.IPv4Address(ip).packed.hex()


def test_the_guard_admits_each_peer_only_from_its_lan_address_with_its_own_overlay_address():
    script = lanpath.guard_script(OWN, PEERS)
    rules = [line.strip() for line in script.splitlines() if line.strip().startswith("udp dport")]
    port = lanpath.LAN_PORT
    assert rules == [
        f"udp dport {port} ip saddr != {{ 10.1.0.3, 10.1.0.20 }} drop",  # by address, not as text
        f"udp dport {port} @th,224,16 != 0x0800 drop",
        f"udp dport {port} @th,368,32 != {_hex(OWN)} drop",
        f"udp dport {port} ip saddr 10.1.0.3 @th,336,32 != {_hex('10.213.0.3')} drop",
        f"udp dport {port} ip saddr 10.1.0.20 @th,336,32 != {_hex('10.213.0.4')} drop",
    ]
    assert script.splitlines()[:3] == [
        f"table inet {lanpath.GUARD_TABLE} {{}}",
        f"delete table inet {lanpath.GUARD_TABLE}",  # re-created whole, in one nft -f
        f"table inet {lanpath.GUARD_TABLE} {{",
    ]


def test_the_guard_offsets_point_into_the_inner_ipv4_header():
    # From the UDP header: UDP 8, VXLAN 8, then the inner Ethernet header (its type at byte 12), then IPv4
    # (source at byte 12, destination at byte 16).
    inner_eth, inner_ip = (8 + 8) * 8, (8 + 8 + 14) * 8
    script = lanpath.guard_script(OWN, PEERS)
    assert f"@th,{inner_eth + 12 * 8},16 != 0x0800" in script
    assert f"@th,{inner_ip + 12 * 8},32 != " in script and f"@th,{inner_ip + 16 * 8},32 != {_hex(OWN)}" in script


def test_without_peers_the_guard_drops_every_datagram_on_the_port():
    script = lanpath.guard_script(OWN, [])
    assert f"    udp dport {lanpath.LAN_PORT} drop" in script.splitlines()
    assert "ip saddr" not in script


def test_the_guard_takes_another_port():
    assert "udp dport 4789 " in lanpath.guard_script(OWN, PEERS, port=4789)


def test_routed_the_guard_admits_on_the_lan_interface_only_the_peers_overlay_addresses():
    script = lanpath.guard_script(OWN, PEERS, routed_via="eth1")
    lines = [line.strip() for line in script.splitlines()]
    assert f'ip daddr {OWN} iifname "eth1" ip saddr != {{ 10.213.0.3, 10.213.0.4 }} drop' in lines
    # Everything else addressed to this member comes only from the overlay, its LAN path or loopback.
    assert f'ip daddr {OWN} iifname != {{ "eth1", "lo", "meshrun0", "meshrun0-lan" }} drop' in lines
    # A host on the LAN cannot use this member to reach WireGuard.
    assert "type filter hook forward priority filter - 2; policy accept;" in lines
    assert 'iifname "eth1" oifname "meshrun0" drop' in lines
    # The VXLAN port stays shut to anyone but the peers (no VXLAN device answers there anyway).
    assert f"udp dport {lanpath.LAN_PORT} ip saddr != {{ 10.1.0.3, 10.1.0.20 }} drop" in lines


def test_routed_without_peers_the_guard_drops_all_the_lan_interface_brings_to_this_member():
    lines = [line.strip() for line in lanpath.guard_script(OWN, [], routed_via="eth1").splitlines()]
    assert f'ip daddr {OWN} iifname "eth1" drop' in lines


def test_the_vxlan_guard_has_no_forward_chain_and_does_not_admit_the_lan_interface():
    script = lanpath.guard_script(OWN, PEERS)
    assert "hook forward" not in script
    assert f'ip daddr {OWN} iifname != {{ "lo", "meshrun0", "meshrun0-lan" }} drop' in script


def _nft_unavailable() -> str | None:
    if shutil.which("nft") is None:
        return "nft is not installed"
    if os.geteuid() != 0:
        return "nft -c needs root (it asks the kernel)"
    probe = subprocess.run(["nft", "-c", "-f", "-"], input=b"table inet meshrun_probe {}\n", capture_output=True)
    if probe.returncode != 0:
        return f"nft cannot check here: {probe.stderr.decode().strip()[:120]}"
    return None


@pytest.mark.parametrize("routed_via", [None, "eth1"], ids=["vxlan", "routed"])
@pytest.mark.parametrize("peers", [PEERS, PEERS[:1], ()], ids=["two", "one", "none"])
def test_nft_accepts_the_guard(peers, routed_via):
    reason = _nft_unavailable()
    if reason:
        pytest.skip(reason)
    script = lanpath.guard_script(OWN, peers, routed_via=routed_via)
    res = subprocess.run(["nft", "-c", "-f", "-"], input=script, capture_output=True, text=True)  # -c: changes nothing
    assert res.returncode == 0, res.stderr


# probe record ------------------------------------------------------------------------------


def test_answers_in_a_row_activate_a_peer():
    h = lanpath.Health()
    for _ in range(lanpath.PROBE_OKS - 1):
        assert h.record("10.213.0.3", True) is False
    assert h.record("10.213.0.3", True) is True
    assert h.active == {"10.213.0.3"}
    assert h.record("10.213.0.3", True) is False  # already active: nothing moves


def test_misses_in_a_row_deactivate_it_and_a_single_miss_does_not():
    h = lanpath.Health()
    for _ in range(lanpath.PROBE_OKS):
        h.record("ip", True)
    assert h.record("ip", False) is False and h.active == {"ip"}
    assert h.record("ip", True) is False  # an answer ends the run of misses
    for _ in range(lanpath.PROBE_FAILS - 1):
        assert h.record("ip", False) is False
    assert h.active == {"ip"}
    assert h.record("ip", False) is True and h.active == set()
    # Back again only after PROBE_OKS answers in a row.
    for _ in range(lanpath.PROBE_OKS - 1):
        assert h.record("ip", True) is False
    assert h.record("ip", True) is True and h.active == {"ip"}


def test_misses_alone_never_activate_and_an_unknown_peer_starts_inactive():
    h = lanpath.Health()
    assert [h.record("ip", False) for _ in range(10)] == [False] * 10
    assert h.active == set()


def test_keep_forgets_peers_no_longer_planned():
    h = lanpath.Health()
    for ip in ("a", "b"):
        for _ in range(lanpath.PROBE_OKS):
            h.record(ip, True)
    h.record("c", False)
    h.keep(["a"])
    assert h.active == {"a"} and set(h.streak) == {"a"}
    # b starts over: one answer is not enough.
    assert h.record("b", True) is (lanpath.PROBE_OKS == 1)


# trusted sites in the coordinator's metadata ------------------------------------------------------


def test_trusted_sites_round_trip_sorted_and_once():
    meta = lanpath.trusted_to_meta(["dc2", "dc1", "dc2"])
    assert meta == '["dc1", "dc2"]'
    assert lanpath.trusted_from_meta(meta) == frozenset({"dc1", "dc2"})
    assert lanpath.trusted_to_meta([]) == "[]"


@pytest.mark.parametrize(
    "value",
    [None, "", "not json", "{", '{"dc1": true}', '"dc1"', "7", "null", "[1, null, {}]", '["BAD NAME!", ""]'],
)
def test_unreadable_trust_metadata_trusts_nothing(value):
    assert lanpath.trusted_from_meta(value) == frozenset()


def test_only_the_valid_names_of_a_mixed_list_are_trusted():
    assert lanpath.trusted_from_meta('["dc1", 3, "Bad Name", null, "x-2"]') == frozenset({"dc1", "x-2"})
