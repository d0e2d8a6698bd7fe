"""meshrun.core.tunnels: names, ports, the plan of the extra tunnels' peers, route and guard text."""

from __future__ import annotations

import pytest

from meshrun.core import lanpath, relays, tunnels
from meshrun.core.model import Member
from meshrun.errors import UsageError


def member(i: int, path: str = "private", lan: str | None = None, count: int = 3) -> Member:
    return Member(
        f"n{i}",
        f"{i:042d}A=",
        f"10.213.0.{i + 2}",
        f"198.51.100.9:{40000 + i}",
        (f"{lan or f'10.1.0.{i + 2}'}:51820",),
        path=path,
        tunnels=count,
    )


ME = member(0, path="")


@pytest.mark.parametrize("count", [0, -1, tunnels.MAX_TUNNELS + 1])
def test_a_count_out_of_range_is_refused_naming_it_and_the_range(count):
    with pytest.raises(UsageError) as exc:
        tunnels.check_count(count)
    assert f"--tunnels {count}" in exc.value.message and f"to {tunnels.MAX_TUNNELS}" in exc.value.fix


def test_the_extra_ports_miss_the_lan_path_the_relays_and_the_default_wireguard_port():
    ports = {tunnels.port(i) for i in range(1, tunnels.MAX_TUNNELS)}
    assert len(ports) == tunnels.MAX_TUNNELS - 1
    assert not ports & set(relays.RELAY_PORTS)
    assert lanpath.LAN_PORT not in ports and 51820 not in ports


def test_a_network_port_among_the_tunnels_ports_is_refused_with_a_count_that_fits():
    tunnels.check_listen_port(51820, tunnels.MAX_TUNNELS)
    tunnels.check_listen_port(51813, 1)  # one tunnel: no extra port
    with pytest.raises(UsageError) as exc:
        tunnels.check_listen_port(51813, 4)
    assert "51813" in exc.value.message and "--tunnels 3" in exc.value.fix


def test_device_names_fit_the_kernels_limit_and_differ_from_the_lan_paths():
    names = tunnels.device_names("a-very-long-iface", tunnels.MAX_TUNNELS)
    assert len(names) == tunnels.MAX_TUNNELS - 1 and len(set(names)) == len(names)
    assert all(len(n) <= 15 for n in names)
    assert lanpath.interface_name("a-very-long-iface") not in names
    assert tunnels.device_names("meshrun0", 1) == []


def test_the_plan_holds_the_private_path_peers_with_an_ipv4_lan_address_only():
    members = [
        ME,
        member(1),
        member(2, path="public"),
        member(3, path="relayed"),
        member(4, lan="[fd00::4]"),
        member(5),
    ]
    plan = tunnels.plan(ME.public_key, members, 3)
    assert [(p.name, p.lan_ip, p.overlay_ip) for p in plan] == [
        ("n1", "10.1.0.3", "10.213.0.3"),
        ("n5", "10.1.0.7", "10.213.0.7"),
    ]
    assert tunnels.plan(ME.public_key, members, 1) == ()


def test_a_pair_uses_as_many_tunnels_as_the_member_with_fewer_runs():
    """A peer that runs fewer tunnels (it reports its `--tunnels` with every sync) is planned on those only; one
    that runs one is not planned: nothing would answer it on an extra tunnel."""
    members = [ME, member(1, count=2), member(2, count=8), member(3, count=1), member(4, count=4)]
    plan = {p.name: p for p in tunnels.plan(ME.public_key, members, 4)}
    assert {n: p.count for n, p in plan.items()} == {"n1": 2, "n2": 4, "n4": 4}
    assert list(plan["n1"].extra) == [1] and list(plan["n2"].extra) == [1, 2, 3]


def test_a_member_without_a_reported_count_runs_one_tunnel():
    d = member(1).to_dict()
    assert d["tunnels"] == 3 and Member.from_dict(d).tunnels == 3
    d.pop("tunnels")
    assert Member.from_dict(d).tunnels == 1  # an older agent's, or a coordinator's, record
    for bad in (0, tunnels.MAX_TUNNELS + 1, "3", 2.0, True):
        with pytest.raises(ValueError):
            Member.from_dict({**d, "tunnels": bad})


def test_the_guard_drops_the_overlay_address_on_every_interface_but_the_overlays_own():
    names = tunnels.overlay_interfaces("meshrun0", 3, routed_via="eth1")
    assert names == ["meshrun0", "meshrun0-lan", "meshrun0-t1", "meshrun0-t2", "eth1"]
    script = tunnels.ruleset("10.213.0.2", names, {})
    rule = next(line for line in script.splitlines() if "drop" in line)
    assert rule.strip() == (
        'ip daddr 10.213.0.2 iifname != { "eth1", "lo", "meshrun0", "meshrun0-lan", "meshrun0-t1", "meshrun0-t2" } drop'
    )
    assert script.startswith(f"table inet {tunnels.GUARD_TABLE} {{}}\ndelete table inet {tunnels.GUARD_TABLE}")
    assert "vmap" not in script  # nothing live: no flow is moved


def chains(script: str) -> dict[str, list[str]]:
    """{chain name: its rules} of an nft script as ruleset writes it (one statement per line)."""
    out: dict[str, list[str]] = {}
    name = None
    for line in (x.strip() for x in script.splitlines()):
        if line.startswith("chain "):
            name = line.split()[1]
            out[name] = []
        elif line == "}":
            name = None
        elif name and not line.startswith("type "):
            out[name].append(line)
    return out


def test_flows_to_a_peer_spread_over_the_interface_and_its_live_tunnels_only():
    script = tunnels.ruleset("10.213.0.2", ["meshrun0"], {"10.213.0.9": [3, 1], "10.213.0.3": [2], "10.213.0.5": []})
    c = chains(script)
    assert c["spread"] == [
        "meta mark 0 meta l4proto { tcp, udp } ip daddr vmap { 10.213.0.3 : goto peer0, 10.213.0.9 : goto peer1 }"
    ]
    seed = hex(tunnels.HASH_SEED)
    assert c["peer0"] == [
        f"meta mark set jhash ip saddr . ip daddr . th sport . th dport mod 2 seed {seed} "
        f"map {{ 0 : 0x0, 1 : {hex(tunnels.spread_mark(2))} }}"
    ]
    assert c["peer1"] == [
        f"meta mark set jhash ip saddr . ip daddr . th sport . th dport mod 3 seed {seed} "
        f"map {{ 0 : 0x0, 1 : {hex(tunnels.spread_mark(1))}, 2 : {hex(tunnels.spread_mark(3))} }}"
    ]


def test_both_ends_of_a_pair_hash_a_flows_fields_in_one_order():
    """A packet from .2 to .9 carries (saddr .2, daddr .9, sport p2, dport p9); its answer (.9, .2, p9, p2). Each
    end's expression must read (.2, .9, p2, p9) from the packets it sends, so a flow and its answers share a
    tunnel."""
    low = chains(tunnels.ruleset("10.213.0.2", ["meshrun0"], {"10.213.0.9": [1]}))["peer0"][0]
    high = chains(tunnels.ruleset("10.213.0.9", ["meshrun0"], {"10.213.0.2": [1]}))["peer0"][0]
    fields = {"ip saddr": "own", "ip daddr": "peer", "th sport": "own port", "th dport": "peer port"}

    def read(rule: str, own: str, peer: str) -> list[str]:
        expr = rule.split("jhash ")[1].split(" mod ")[0].split(" . ")
        sent = {"own": own, "peer": peer, "own port": f"{own}:port", "peer port": f"{peer}:port"}
        return [sent[fields[f]] for f in expr]

    assert read(low, "10.213.0.2", "10.213.0.9") == read(high, "10.213.0.9", "10.213.0.2")
    assert read(low, "10.213.0.2", "10.213.0.9") == ["10.213.0.2", "10.213.0.9", "10.213.0.2:port", "10.213.0.9:port"]
    # 10.213.0.10 sorts above 10.213.0.9 as an address, below it as text
    assert "ip saddr . ip daddr" in chains(tunnels.ruleset("10.213.0.9", ["m"], {"10.213.0.10": [1]}))["peer0"][0]


def test_spread_marks_and_rules_sit_after_the_lan_path_and_apart_from_the_probes():
    assert [tunnels.spread_pref(i) for i in (1, 7)] == [5181, 5187]
    assert tunnels.spread_pref(1) > lanpath.ACTIVE_PREF > tunnels.probe_pref(7)
    marks = {tunnels.spread_mark(i) for i in range(1, 8)} | {tunnels.probe_mark(i) for i in range(1, 8)}
    assert len(marks) == 14 and lanpath.PROBE_MARK not in marks


def test_the_lan_paths_guard_lets_the_tunnels_through_too():
    script = lanpath.guard_script("10.213.0.2", [], "meshrun0", tunnels=tunnels.device_names("meshrun0", 3))
    rule = next(line for line in script.splitlines() if "iifname !=" in line)
    assert '"meshrun0-t1"' in rule and '"meshrun0-t2"' in rule
