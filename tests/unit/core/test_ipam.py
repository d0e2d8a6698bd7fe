"""meshrun.core.ipam: overlay CIDR checks and address allocation (pure)."""

from __future__ import annotations

import ipaddress

import pytest

from meshrun.core.ipam import DEFAULT_CIDR, allocate, check_overlap, coordinator_address, parse_cidr
from meshrun.errors import NetworkError, UsageError

NET = ipaddress.IPv4Network("10.213.0.0/16")


class TestParseCidr:
    @pytest.mark.parametrize(
        "value", ["10.213.0.0/16", "172.16.0.0/12", "192.168.7.0/24", "10.0.0.0/29", " 10.231.0.0/16 ", "10.0.0.0/8"]
    )
    def test_good(self, value):
        assert parse_cidr(value) == ipaddress.IPv4Network(value.strip())

    def test_default_is_valid(self):
        assert str(parse_cidr(DEFAULT_CIDR)) == "10.213.0.0/16"

    def test_not_a_network(self):
        with pytest.raises(UsageError) as info:
            parse_cidr("banana")
        assert str(info.value) == (
            "--cidr 'banana' is not a network address "
            "('banana' does not appear to be an IPv4 or IPv6 network); "
            "give the network's first address and a prefix, e.g. --cidr 10.213.0.0/16"
        )
        assert info.value.exit_code == 2

    def test_prefix_too_long(self):
        with pytest.raises(UsageError, match=r"^--cidr '10\.0\.0\.0/33' is not a network address"):
            parse_cidr("10.0.0.0/33")

    def test_host_bits_set(self):
        with pytest.raises(UsageError) as info:
            parse_cidr("10.213.0.1/16")
        assert str(info.value).startswith(
            "--cidr '10.213.0.1/16' is not a network address (10.213.0.1/16 has host bits set)"
        )

    def test_ipv6(self):
        with pytest.raises(UsageError) as info:
            parse_cidr("fd00::/64")
        assert str(info.value) == (
            "--cidr 'fd00::/64' is IPv6; meshrun overlays are IPv4 for now; "
            "use an IPv4 private range, e.g. --cidr 10.213.0.0/16"
        )

    @pytest.mark.parametrize("value", ["10.0.0.0/30", "10.0.0.0/31", "10.0.0.1/32"])
    def test_too_small(self, value):
        with pytest.raises(UsageError) as info:
            parse_cidr(value)
        assert str(info.value) == (
            f"--cidr {value!r} leaves room for fewer than 6 members; use a prefix of /29 or shorter, e.g. /24 or /16"
        )

    @pytest.mark.parametrize(
        "value",
        [
            "8.8.0.0/16",
            "100.64.0.0/10",
            "127.0.0.0/8",
            "169.254.0.0/16",
            "0.0.0.0/16",
            "240.0.0.0/16",
            "198.18.0.0/16",
            "192.0.2.0/24",
            "224.0.0.0/24",
            "10.0.0.0/7",
            "172.0.0.0/8",
        ],
    )
    def test_not_private(self, value):
        with pytest.raises(UsageError) as info:
            parse_cidr(value)
        assert str(info.value) == (
            f"--cidr {value!r} is not a private range; pick a range from 10.0.0.0/8, "
            "172.16.0.0/12 or 192.168.0.0/16, e.g. 10.213.0.0/16"
        )


class TestOverlap:
    def test_no_routes(self):
        check_overlap(NET, [])

    def test_disjoint_routes(self):
        check_overlap(NET, [("10.0.0.0/16", "eth0"), ("172.31.32.0/20", "ens5"), ("10.214.0.0/16", "wg1")])

    def test_default_route_ignored(self):
        check_overlap(NET, [("0.0.0.0/0", "eth0"), ("default", "eth0")])

    def test_garbage_and_ipv6_routes_ignored(self):
        check_overlap(NET, [("fe80::/64", "eth0"), ("::/0", "eth0"), ("not-a-route", "x")])

    def test_overlap_refused_naming_route_and_device(self):
        with pytest.raises(NetworkError) as info:
            check_overlap(NET, [("172.31.0.0/16", "eth0"), ("10.0.0.0/8", "ens5")])
        assert str(info.value) == (
            "overlay range 10.213.0.0/16 overlaps the local route 10.0.0.0/8 on ens5; "
            "pick a range that no local network uses with --cidr, e.g. --cidr 10.213.0.0/16 "
            "or 10.231.0.0/16"
        )

    def test_host_route_inside(self):
        with pytest.raises(NetworkError, match=r"overlaps the local route 10\.213\.5\.9/32 on docker0"):
            check_overlap(NET, [("10.213.5.9", "docker0")])

    def test_route_with_host_bits(self):
        with pytest.raises(NetworkError, match=r"overlaps the local route 10\.213\.0\.0/24 on br0"):
            check_overlap(NET, [("10.213.0.7/24", "br0")])


class TestAllocate:
    def test_coordinator_address(self):
        assert coordinator_address(NET) == ipaddress.IPv4Address("10.213.0.1")

    def test_lowest_free_skips_coordinator(self):
        assert allocate(NET, []) == ipaddress.IPv4Address("10.213.0.2")

    def test_coordinator_never_handed_out_even_if_not_listed(self):
        assert allocate(NET, ["10.213.0.2"]) == ipaddress.IPv4Address("10.213.0.3")

    def test_lowest_hole(self):
        taken = ["10.213.0.1", "10.213.0.2", "10.213.0.4", "10.213.0.5"]
        assert allocate(NET, taken) == ipaddress.IPv4Address("10.213.0.3")

    def test_crosses_octet(self):
        taken = [str(NET.network_address + i) for i in range(1, 256)]
        assert allocate(NET, taken) == ipaddress.IPv4Address("10.213.1.0")

    def test_addresses_outside_net_do_not_matter(self):
        assert allocate(NET, ["192.168.0.2", "10.214.0.2"]) == ipaddress.IPv4Address("10.213.0.2")

    def test_never_returns_taken(self):
        net = ipaddress.IPv4Network("10.9.0.0/28")
        taken: list[str] = []
        for _ in range(13):
            ip = allocate(net, taken)
            assert str(ip) not in taken and ip != coordinator_address(net) and ip in net
            assert ip not in (net.network_address, net.broadcast_address)
            taken.append(str(ip))
        assert taken[0] == "10.9.0.2" and taken[-1] == "10.9.0.14"

    def test_exhausted(self):
        net = ipaddress.IPv4Network("10.9.0.0/29")
        taken = ["10.9.0.2", "10.9.0.3", "10.9.0.4", "10.9.0.5", "10.9.0.6"]
        with pytest.raises(NetworkError) as info:
            allocate(net, taken)
        assert str(info.value) == (
            "overlay range 10.9.0.0/29 has no free address left (6 hosts); create a new network with a larger --cidr"
        )
