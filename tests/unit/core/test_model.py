"""meshrun.core.model: wire shapes (round trip, hostile input), endpoints, option checks."""

from __future__ import annotations

import pytest

from meshrun.core.model import (
    Member,
    Network,
    check_interface,
    check_mtu,
    check_name,
    check_port,
    default_node_name,
    parse_endpoint,
)
from meshrun.errors import UsageError

KEY_A = "j0DFrbaPJWJK5bIU6nZ6bslNgp09e14a0bpvPiE4KF8="
KEY_B = "omjXDyOxNCkYbimc/y3YipnkEnnasAyCC8uW60+7wVU="
FP = "0123456789abcdef" * 4


def network(**over) -> Network:
    fields = dict(
        name="lab",
        cidr="10.213.0.0/16",
        interface="meshrun0",
        listen_port=51820,
        mtu=1420,
        coordinator_ip="10.213.0.1",
        coordinator_public_key=KEY_A,
        endpoints=("203.0.113.1:51820",),
        fingerprint=FP,
    )
    fields.update(over)
    return Network(**fields)


def member(**over) -> Member:
    fields = dict(
        name="gpu-a",
        public_key=KEY_B,
        overlay_ip="10.213.0.2",
        endpoint="198.51.100.2:40000",
        candidates=("172.31.40.46:51820",),
        is_coordinator=False,
        last_handshake=1700000000,
    )
    fields.update(over)
    return Member(**fields)


class TestNetwork:
    def test_to_dict_exact(self):
        assert network().to_dict() == {
            "name": "lab",
            "cidr": "10.213.0.0/16",
            "interface": "meshrun0",
            "listen_port": 51820,
            "mtu": 1420,
            "coordinator_ip": "10.213.0.1",
            "coordinator_public_key": KEY_A,
            "endpoints": ["203.0.113.1:51820"],
            "fingerprint": FP,
            "api_port": 51821,
            "rdzv_port": 29400,
        }

    def test_round_trip(self):
        n = network(endpoints=("203.0.113.1:51820", "[2001:db8::1]:51820"), api_port=6000, rdzv_port=6001)
        assert Network.from_dict(n.to_dict()) == n

    def test_prefixlen(self):
        assert network().prefixlen == 16

    @pytest.mark.parametrize(
        "change",
        [
            {"name": "Bad"},
            {"name": "lab\n"},
            {"name": ""},
            {"name": None},
            {"cidr": "10.213.0.1/16"},
            {"cidr": "nope"},
            {"cidr": 5},
            {"interface": "x" * 16},
            {"interface": "wg0\n"},
            {"interface": "a b"},
            {"listen_port": 0},
            {"listen_port": 65536},
            {"listen_port": "51820"},
            {"listen_port": True},
            {"listen_port": 51820.0},
            {"mtu": 1279},
            {"mtu": 9001},
            {"mtu": None},
            {"coordinator_ip": "10.213.0.256"},
            {"coordinator_ip": "::1"},
            {"coordinator_ip": 1},
            {"coordinator_public_key": "A" * 44},
            {"coordinator_public_key": KEY_A[:-1]},
            {"endpoints": "203.0.113.1:51820"},
            {"endpoints": [1]},
            {"endpoints": ["x"] * 65},
            {"fingerprint": FP.upper()},
            {"fingerprint": FP + "\n"},
            {"fingerprint": FP[:-1]},
            {"api_port": -1},
            {"rdzv_port": 2**70},
        ],
        ids=repr,
    )
    def test_from_dict_rejects(self, change):
        d = network().to_dict()
        d.update(change)
        with pytest.raises(ValueError):
            Network.from_dict(d)

    @pytest.mark.parametrize(
        "key",
        [
            "name",
            "cidr",
            "interface",
            "listen_port",
            "mtu",
            "coordinator_ip",
            "coordinator_public_key",
            "endpoints",
            "fingerprint",
            "api_port",
            "rdzv_port",
        ],
    )
    def test_from_dict_missing_field(self, key):
        d = network().to_dict()
        del d[key]
        with pytest.raises(ValueError):
            Network.from_dict(d)

    @pytest.mark.parametrize("value", [None, [], "network", 1])
    def test_from_dict_not_an_object(self, value):
        with pytest.raises(ValueError, match="^network must be an object$"):
            Network.from_dict(value)

    def test_from_dict_messages(self):
        d = network().to_dict()
        d["mtu"] = 100
        with pytest.raises(ValueError, match=r"^mtu must be an integer in 1280\.\.9000$"):
            Network.from_dict(d)
        d = network().to_dict()
        d["coordinator_public_key"] = "x"
        with pytest.raises(ValueError, match="^coordinator_public_key is not a WireGuard public key$"):
            Network.from_dict(d)


class TestMember:
    def test_to_dict_exact(self):
        assert member().to_dict() == {
            "name": "gpu-a",
            "public_key": KEY_B,
            "overlay_ip": "10.213.0.2",
            "endpoint": "198.51.100.2:40000",
            "candidates": ["172.31.40.46:51820"],
            "is_coordinator": False,
            "last_handshake": 1700000000,
            "path": "",
            "mtu": 0,
            "site": "",
            "relay": True,
            "via": "",
            "via_port": 0,
            "lan": False,
            "lan_routed": False,
            "tunnels": 1,
        }

    @pytest.mark.parametrize(
        "m",
        [
            member(),
            member(endpoint=None, candidates=(), last_handshake=0),
            member(is_coordinator=True, endpoint="[2001:db8::2]:51820"),
            member(site="dc1"),
            member(tunnels=4),
        ],
    )
    def test_round_trip(self, m):
        assert Member.from_dict(m.to_dict()) == m

    def test_minimal_dict_gets_defaults(self):
        assert Member.from_dict({"name": "n1", "public_key": KEY_A, "overlay_ip": "10.0.0.2"}) == Member(
            "n1", KEY_A, "10.0.0.2", None, (), False, 0
        )

    def test_endpoint_normalised(self):
        assert Member.from_dict(member(endpoint=" h.example:0443").to_dict()).endpoint == "h.example:443"

    @pytest.mark.parametrize(
        "change",
        [
            {"name": "-a"},
            {"name": "a" * 33},
            {"name": "gpu-a\n"},
            {"name": 1},
            {"public_key": "nope"},
            {"public_key": None},
            {"overlay_ip": "10.213.0.0/16"},
            {"overlay_ip": "fd00::1"},
            {"endpoint": "no-port"},
            {"endpoint": "1.2.3.4:0"},
            {"endpoint": {"a": 1}},
            {"candidates": "1.2.3.4:5"},
            {"candidates": [None]},
            {"candidates": ["bad host:1"]},
            {"last_handshake": -1},
            {"last_handshake": "0"},
            {"last_handshake": None},
            {"last_handshake": 2**41},
            {"site": "DC 1"},
            {"site": 7},
        ],
        ids=repr,
    )
    def test_from_dict_rejects(self, change):
        d = member().to_dict()
        d.update(change)
        with pytest.raises(ValueError):
            Member.from_dict(d)

    @pytest.mark.parametrize("value", [None, ["x"], "member"])
    def test_from_dict_not_an_object(self, value):
        with pytest.raises(ValueError, match="^member must be an object$"):
            Member.from_dict(value)


class TestParseEndpoint:
    @pytest.mark.parametrize(
        "value,default,expected",
        [
            ("203.0.113.1:51820", None, "203.0.113.1:51820"),
            ("[2001:db8::1]:51820", None, "[2001:db8::1]:51820"),
            ("vpn.example.com:443", None, "vpn.example.com:443"),
            ("203.0.113.1", 51820, "203.0.113.1:51820"),
            ("vpn.example.com", 7000, "vpn.example.com:7000"),
            ("[2001:db8::1]", 51820, "[2001:db8::1]:51820"),
            (" h:080 ", None, "h:80"),
            ("203.0.113.1:1", None, "203.0.113.1:1"),
            ("203.0.113.1:65535", None, "203.0.113.1:65535"),
        ],
    )
    def test_good(self, value, default, expected):
        assert parse_endpoint(value, default) == expected

    @pytest.mark.parametrize(
        "value,default,message",
        [
            ("203.0.113.1", None, "endpoint '203.0.113.1' has no port"),
            ("203.0.113.1:0", None, "endpoint port '0' is not a port number"),
            ("203.0.113.1:65536", None, "endpoint port '65536' is not a port number"),
            ("203.0.113.1:http", None, "endpoint port 'http' is not a port number"),
            ("203.0.113.1:", None, "endpoint port '' is not a port number"),
            ("a b:1", None, "endpoint host 'a b' is not an address or DNS name"),
            (":5", None, "endpoint host '' is not an address or DNS name"),
            ("2001:db8::1", 51820, "endpoint host '2001:db8::1' is not an address or DNS name"),
            ("2001:db8::1", None, "endpoint '2001:db8::1' has no port"),
        ],
    )
    def test_bad(self, value, default, message):
        with pytest.raises(ValueError) as info:
            parse_endpoint(value, default)
        assert str(info.value) == message

    def test_bad_ipv6_in_brackets(self):
        with pytest.raises(ValueError):
            parse_endpoint("[zz]:1")


class TestChecks:
    @pytest.mark.parametrize("value", ["meshrun0", "wg0", "a", "x" * 15, "wg_0.a=b+c-d"])
    def test_interface_ok(self, value):
        assert check_interface(value) == value

    @pytest.mark.parametrize("value", ["", "x" * 16, "wg 0", "wg/0", ".", "..", "wg0\n", "wgé"])
    def test_interface_bad(self, value):
        with pytest.raises(UsageError) as info:
            check_interface(value)
        assert str(info.value) == (
            f"--interface {value!r} is not a valid interface name; "
            "use 1-15 letters, digits or -_.=+, e.g. --interface meshrun0"
        )

    @pytest.mark.parametrize("value", [1, 51820, 65534])
    def test_port_ok(self, value):
        assert check_port(value) == value

    @pytest.mark.parametrize("value", [0, -1, 65535, 70000])
    def test_port_bad(self, value):
        with pytest.raises(UsageError) as info:
            check_port(value)
        assert str(info.value) == f"--port {value} is not a usable port; pick 1-65534, e.g. --port 51820"

    def test_port_option_name(self):
        with pytest.raises(UsageError, match=r"^--api-port 0 is not a usable port; pick 1-65534, e.g. --api-port"):
            check_port(0, "--api-port")

    @pytest.mark.parametrize("value", [1280, 1420, 9000])
    def test_mtu_ok(self, value):
        assert check_mtu(value) == value

    @pytest.mark.parametrize("value", [100, 1279, 9001])
    def test_mtu_bad(self, value):
        with pytest.raises(UsageError) as info:
            check_mtu(value)
        assert str(info.value) == (
            f"--mtu {value} is outside 1280..9000; use 1420 for a 1500-byte underlay, 1280 for the smallest paths"
        )
        assert info.value.exit_code == 2

    @pytest.mark.parametrize("value", ["gpu-a", "a", "0", "a" * 32, "a-"])
    def test_name_ok(self, value):
        assert check_name(value) == value

    @pytest.mark.parametrize("value", ["", "-a", "GPU", "gpu_a", "a" * 33, "gpu.a", "gpu a", "gpu-a\n"])
    def test_name_bad(self, value):
        with pytest.raises(UsageError) as info:
            check_name(value)
        assert str(info.value) == (
            f"--name {value!r} is not a valid name; use 1-32 lower-case letters, digits "
            "and '-', starting with a letter or digit, e.g. --name gpu-a"
        )


class TestDefaultNodeName:
    @pytest.mark.parametrize(
        "hostname,expected",
        [
            ("GPU_Box.local", "gpu-box"),
            ("gpu-a", "gpu-a"),
            ("ip-172-31-40-46.ec2.internal", "ip-172-31-40-46"),
            ("---", "node"),
            ("", "node"),
            (".hidden", "node"),
            ("A" * 40, "a" * 32),
            ("héllo-wörld", "h-llo-w-rld"),
            ("a" * 31 + "-b", "a" * 31),
        ],
    )
    def test_cases(self, hostname, expected):
        assert default_node_name(hostname) == expected
        check_name(expected)
