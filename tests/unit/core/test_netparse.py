"""meshrun.core.netparse: what `ip` prints, parsed without running it (captured output)."""

from __future__ import annotations

from meshrun.core import netparse
from meshrun.core.model import overlay_mtu

ROUTES = """\
default via 172.31.32.1 dev eth0
172.31.32.0/20 dev eth0 proto kernel scope link src 172.31.40.46
10.213.0.0/16 dev meshrun0 proto kernel scope link src 10.213.0.2
local 127.0.0.1 dev lo table local proto kernel scope host src 127.0.0.1
local 172.31.40.46 dev eth0 table local proto kernel scope host src 172.31.40.46
broadcast 172.31.47.255 dev eth0 table local proto kernel scope link src 172.31.40.46
unreachable 10.99.0.0/16
blackhole 10.98.0.0/16
192.168.7.0/24 via 10.1.1.1 onlink
"""

ADDRS = """\
2: eth0    inet 172.31.40.46/20 brd 172.31.47.255 scope global eth0\\       valid_lft forever preferred_lft forever
3: meshrun0    inet 10.213.0.2/16 scope global meshrun0\\       valid_lft forever preferred_lft forever
4: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\\       valid_lft forever
"""


def test_routes_keep_destinations_and_devices_and_drop_defaults_and_non_destinations():
    assert netparse.routes(ROUTES) == [
        ("172.31.32.0/20", "eth0"),
        ("10.213.0.0/16", "meshrun0"),
        ("127.0.0.1/32", "lo"),
        ("172.31.40.46/32", "eth0"),
        ("192.168.7.0/24", "?"),
    ]
    assert netparse.routes("") == []


def test_addresses_per_device_and_exclusion():
    assert netparse.addresses(ADDRS) == [
        ("eth0", "172.31.40.46"),
        ("meshrun0", "10.213.0.2"),
        ("docker0", "172.17.0.1"),
    ]
    assert [a for _, a in netparse.addresses(ADDRS, exclude="meshrun0")] == ["172.31.40.46", "172.17.0.1"]
    assert netparse.addresses("7: eth1    inet6 fe80::1/64 scope link") == []


def test_default_device():
    assert netparse.default_device("default via 172.31.32.1 dev eth0 proto dhcp metric 100") == "eth0"
    assert netparse.default_device("") is None
    assert netparse.default_device("default via 10.0.0.1 dev") is None


def test_overlay_mtu_fits_the_probed_path():
    assert overlay_mtu(1420, None) == 1420  # nothing learned: keep the configured MTU
    assert overlay_mtu(1420, 1500) == 1420
    assert overlay_mtu(1420, 1280) == 1220  # a 1280-byte hop: 60 bytes of WireGuard over IPv4
    assert overlay_mtu(1420, 600) == 576  # never below IPv4's minimum


def test_route_mtus_reads_only_host_routes_with_an_mtu():
    text = (
        '[{"dst":"10.213.0.0/16","protocol":"kernel","scope":"link","prefsrc":"10.213.0.3","flags":[]},'
        '{"dst":"10.213.0.2","scope":"link","flags":[],"metrics":[{"mtu":1216}]},'
        '{"dst":"10.213.0.9","scope":"link","flags":[]}]'
    )
    assert netparse.route_mtus(text) == {"10.213.0.2": 1216}
    assert netparse.route_mtus("") == {} and netparse.route_mtus("not json") == {}


def test_route_get_gives_device_next_hop_and_source_of_a_unicast_route():
    via = '[{"dst":"8.8.8.8","gateway":"192.0.2.1","dev":"eth0","prefsrc":"192.0.2.2","flags":[],"uid":0}]'
    assert netparse.route_get(via) == ("eth0", "192.0.2.1", "192.0.2.2")
    on_link = '[{"dst":"10.2.0.2","dev":"veth1","prefsrc":"10.2.0.1","flags":[],"uid":0,"cache":[]}]'
    assert netparse.route_get(on_link) == ("veth1", "10.2.0.2", "10.2.0.1")
    local = '[{"type":"local","dst":"127.0.0.1","dev":"lo","prefsrc":"127.0.0.1","flags":[]}]'
    assert netparse.route_get(local) is None
    assert netparse.route_get("") is None and netparse.route_get("RTNETLINK answers: Network is unreachable") is None
