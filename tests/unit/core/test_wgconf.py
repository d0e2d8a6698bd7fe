"""meshrun.core.wgconf: wg-quick rendering (checked by `wg-quick strip`) and `wg show dump` parsing."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from meshrun.core.peers import PeerSpec, PeerState
from meshrun.core.wgconf import parse_dump, read_quick, render_quick

PRIV = "UGPrxkGtf7NS043XEah/Axhqr7YTXB4MzFvrfrAZyUs="
PUB = "omjXDyOxNCkYbimc/y3YipnkEnnasAyCC8uW60+7wVU="
KEY_A = "j0DFrbaPJWJK5bIU6nZ6bslNgp09e14a0bpvPiE4KF8="
KEY_B = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg="
PEERS = [
    PeerSpec(KEY_B, ("10.213.0.3/32",), None, 25, "gpu-b"),
    PeerSpec(KEY_A, ("10.213.0.1/32", "10.213.9.0/24"), "203.0.113.1:51820", 25, "coord"),
]

EXPECTED = f"""[Interface]
# meshrun network lab (node gpu-a)
# managed by meshrun
PrivateKey = {PRIV}
Address = 10.213.0.2/16
ListenPort = 51820
MTU = 1420

# coord
[Peer]
PublicKey = {KEY_A}
AllowedIPs = 10.213.0.1/32, 10.213.9.0/24
Endpoint = 203.0.113.1:51820
PersistentKeepalive = 25

# gpu-b
[Peer]
PublicKey = {KEY_B}
AllowedIPs = 10.213.0.3/32
PersistentKeepalive = 25
"""


def render(peers=PEERS, **kw) -> str:
    return render_quick(
        PRIV,
        "10.213.0.2/16",
        51820,
        1420,
        peers,
        comment=kw.pop("comment", "meshrun network lab (node gpu-a)\nmanaged by meshrun"),
        **kw,
    )


def wg_quick_strip(tmp_path, text: str, iface: str = "meshrun0") -> str:
    path = tmp_path / f"{iface}.conf"
    path.write_text(text)
    os.chmod(path, 0o600)
    res = subprocess.run(["wg-quick", "strip", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout


needs_wg_quick = pytest.mark.skipif(shutil.which("wg-quick") is None, reason="wireguard-tools not installed")


class TestRender:
    def test_exact_text(self):
        assert render() == EXPECTED

    def test_peers_sorted_by_key_whatever_the_input_order(self):
        assert render(list(reversed(PEERS))) == render(PEERS)

    def test_no_peers_no_comment(self):
        assert render([], comment="") == (
            f"[Interface]\nPrivateKey = {PRIV}\nAddress = 10.213.0.2/16\nListenPort = 51820\nMTU = 1420\n"
        )

    def test_keepalive_zero_and_no_name_omitted(self):
        text = render([PeerSpec(KEY_A, ("10.213.0.1/32",), None, 0, "")], comment="")
        assert text.endswith(f"[Peer]\nPublicKey = {KEY_A}\nAllowedIPs = 10.213.0.1/32\n")
        assert "PersistentKeepalive" not in text and "#" not in text

    def test_read_back(self):
        iface, peers = read_quick(render())
        assert iface == {"PrivateKey": PRIV, "Address": "10.213.0.2/16", "ListenPort": 51820, "MTU": 1420}
        assert peers == {
            KEY_A: {
                "PublicKey": KEY_A,
                "AllowedIPs": ["10.213.0.1/32", "10.213.9.0/24"],
                "Endpoint": "203.0.113.1:51820",
                "PersistentKeepalive": 25,
            },
            KEY_B: {"PublicKey": KEY_B, "AllowedIPs": "10.213.0.3/32", "PersistentKeepalive": 25},
        }

    @needs_wg_quick
    def test_wg_quick_strip_accepts_it(self, tmp_path):
        stripped = wg_quick_strip(tmp_path, render())
        # strip removes wg-quick-only keys (Address, MTU); what is left is for `wg setconf`.
        assert "Address" not in stripped and "MTU" not in stripped
        assert f"PrivateKey = {PRIV}" in stripped and "ListenPort = 51820" in stripped
        iface, peers = read_quick(stripped)
        assert iface == {"PrivateKey": PRIV, "ListenPort": 51820}
        assert set(peers) == {KEY_A, KEY_B}
        assert peers[KEY_A]["Endpoint"] == "203.0.113.1:51820"

    @needs_wg_quick
    def test_wg_quick_strip_with_ipv6_endpoint_and_many_peers(self, tmp_path):
        import base64

        many = [
            PeerSpec(
                base64.b64encode(bytes([i]) * 32).decode(),
                (f"10.213.1.{i}/32",),
                f"[2001:db8::{i:x}]:51820" if i % 2 else None,
                25,
                f"n{i}",
            )
            for i in range(1, 40)
        ]
        stripped = wg_quick_strip(tmp_path, render(many), iface="wg-test.1")
        _, peers = read_quick(stripped)
        assert len(peers) == 39
        assert peers[many[0].public_key]["Endpoint"] == "[2001:db8::1]:51820"

    @needs_wg_quick
    def test_wg_quick_strip_refuses_a_bad_file_name(self, tmp_path):
        # Sanity check of the checker itself: it does fail on what it validates.
        path = tmp_path / "interface-name-too-long.conf"
        path.write_text(render())
        res = subprocess.run(["wg-quick", "strip", str(path)], capture_output=True, text=True)
        assert res.returncode == 1
        assert "must be a valid interface name" in res.stderr

    def test_every_line_is_wg_syntax(self):
        # `wg-quick strip` is lenient, so also check the shape `wg setconf` requires.
        section = None
        allowed = {
            "Interface": {"PrivateKey", "Address", "ListenPort", "MTU"},
            "Peer": {"PublicKey", "AllowedIPs", "Endpoint", "PersistentKeepalive"},
        }
        for line in render().splitlines():
            if not line or line.startswith("# "):
                continue
            if line in ("[Interface]", "[Peer]"):
                section = line[1:-1]
                continue
            key, sep, value = line.partition(" = ")
            assert sep and value and key in allowed[section], line


DUMP = (
    f"{PRIV}\t{PUB}\t51820\toff\n"
    f"{KEY_A}\t(none)\t203.0.113.1:51820\t10.213.0.1/32\t1700000000\t1234\t5678\t25\n"
    f"{KEY_B}\t(none)\t(none)\t10.213.0.3/32,10.213.9.0/24\t0\t0\t0\toff\n"
    f"{PUB}\t(none)\t[2001:db8::1]:4000\t(none)\t1700000100\t1\t2\t10\n"
)


class TestParseDump:
    def test_full_dump(self):
        port, peers = parse_dump(DUMP)
        assert port == 51820
        assert peers == [
            PeerState(KEY_A, "203.0.113.1:51820", ("10.213.0.1/32",), 1700000000, 1234, 5678, 25),
            PeerState(KEY_B, None, ("10.213.0.3/32", "10.213.9.0/24"), 0, 0, 0, 0),
            PeerState(PUB, "[2001:db8::1]:4000", (), 1700000100, 1, 2, 10),
        ]

    def test_without_interface_line(self):
        port, peers = parse_dump(DUMP.split("\n", 1)[1])
        assert port == 0 and len(peers) == 3

    def test_allowed_ips_sorted(self):
        _, peers = parse_dump(f"{KEY_A}\t(none)\t(none)\t10.213.9.0/24,10.213.0.1/32\t0\t0\t0\toff\n")
        assert peers[0].allowed_ips == ("10.213.0.1/32", "10.213.9.0/24")

    def test_empty_and_blank_lines(self):
        assert parse_dump("") == (0, [])
        assert parse_dump(f"\n{PRIV}\t{PUB}\t0\toff\n\n") == (0, [])

    def test_interface_line_with_no_listen_port(self):
        assert parse_dump("(none)\t(none)\t(none)\toff\n") == (0, [])

    def test_wrong_field_count(self):
        with pytest.raises(ValueError, match=r"^unexpected `wg show dump` line with 5 fields$"):
            parse_dump("a\tb\tc\td\te\n")

    def test_private_key_not_in_result(self):
        port, peers = parse_dump(DUMP)
        assert PRIV not in repr(peers)
