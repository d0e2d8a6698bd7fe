"""End-to-end NAT traversal: relays for symmetric NAT pairs, same-site private paths, small-MTU hops."""

from __future__ import annotations

import itertools
import re
import threading
import time

from support import TESTS

from meshrun.lab.testbed import DatacenterSpec, Mesh

SCRIPTS = TESTS / "scripts"


def wait_pairs(mesh: Mesh, names: list[str], timeout: float = 60) -> None:
    """Every ordered pair pings over the overlay (checked in parallel)."""
    ips = {n: mesh.overlay_ip(n) for n in names}
    errors = []

    def one(a, b):
        try:
            mesh.wait_ping(a, ips[b], timeout=timeout)
        except Exception as exc:  # collected, reported below
            errors.append(f"{a}->{b}: {exc}")

    ts = [threading.Thread(target=one, args=p) for p in itertools.permutations(names, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def test_symmetric_pair_is_relayed_others_direct(world_factory):
    """4 datacenters, two behind symmetric NAT: all 12 ordered pairs ping; only the pair of
    symmetric-NAT nodes is relayed through the coordinator, every other pair is direct."""
    world = world_factory(
        [
            DatacenterSpec("hq"),
            DatacenterSpec("dca"),
            DatacenterSpec("dcb"),
            DatacenterSpec("dcc", nat="symmetric"),
            DatacenterSpec("dcd", nat="symmetric"),
        ]
    )
    mesh = Mesh(world, "hq-a")
    mesh.init()
    nodes = ["dca-a", "dcb-a", "dcc-a", "dcd-a"]
    for n in nodes:
        mesh.join(n)
    wait_pairs(mesh, nodes, timeout=60)
    deadline = time.monotonic() + 30
    while True:
        pairs = {(p["a"], p["b"]): p for p in mesh.status("hq-a")["pairs"]}
        if len(pairs) == 6 and all(p["verified"] or p["path"] == "relayed" for p in pairs.values()):
            break
        assert time.monotonic() < deadline, pairs
        time.sleep(1)
    for (a, b), p in pairs.items():
        want = "relayed" if {a, b} == {"dcc-a", "dcd-a"} else "direct (public)"
        assert p["path"] == want, (a, b, p)
    peers = {p["name"]: p for p in mesh.status("dcc-a")["peers"]}
    assert peers["dcd-a"]["path"] == "relayed"
    assert peers["dca-a"]["path"] == "direct (public)"
    assert peers["dcd-a"]["latency_ms"] is not None
    out = mesh.meshrun("dcc-a", "ping", "dcd-a", "--count", "3").stdout
    assert re.match(
        r"dcd-a \(10\.213\.0\.\d+\) relayed: rtt min/avg/max [\d.]+/[\d.]+/[\d.]+ ms \(3/3 answered\)", out
    ), out


def test_same_site_nodes_talk_privately(fresh_mesh):
    """Two nodes behind one gateway (same public IP) use their private addresses: status says
    direct (private), and their traffic does not cross the gateway."""
    mesh = fresh_mesh([DatacenterSpec("hq"), DatacenterSpec("site", nat="cone", nodes=2)], "hq-a")
    world = mesh.world
    for n in ("site-a", "site-b"):
        mesh.join(n)
    wait_pairs(mesh, ["site-a", "site-b"], timeout=60)
    deadline = time.monotonic() + 40
    while True:
        peers = {p["name"]: p for p in mesh.status("site-a")["peers"]}
        if peers["site-b"]["path"] == "direct (private)" and peers["site-b"]["latest_handshake"]:
            break
        assert time.monotonic() < deadline, peers
        time.sleep(1)
    assert peers["site-b"]["endpoint"].startswith("172.31.40.")
    before = world.gateway_counters("site")
    b_ip = mesh.overlay_ip("site-b")
    world.node("site-a").run("ping", "-q", "-c", "200", "-i", "0.005", "-s", "1000", b_ip)
    after = world.gateway_counters("site")
    forwarded = after["forward_packets"] - before["forward_packets"]
    assert forwarded < 50, (before, after)  # keepalives to the coordinator only, not 400 ping packets


def test_small_mtu_hop_does_not_hang(fresh_mesh):
    """A datacenter whose uplink has MTU 1280: the node lowers its overlay MTU to fit, and a
    64 MiB gloo all-reduce with a node elsewhere completes."""
    mesh = fresh_mesh([DatacenterSpec("hq"), DatacenterSpec("small", mtu=1280), DatacenterSpec("big")], "hq-a")
    world = mesh.world
    out = mesh.join("small-a").stdout
    assert "mtu 1220" in out, out
    assert "mtu 1420" in mesh.join("big-a").stdout
    # The larger-MTU members size packets for the small node (wireguard-go sends with UDP GSO, which
    # the kernel will not fragment: without this route bulk traffic to small-a stalls).
    small_ip = mesh.overlay_ip("small-a")
    for n in ("big-a", "hq-a"):
        deadline = time.monotonic() + 30
        while f"{small_ip} scope link mtu 1216" not in (
            routes := world.node(n).run("ip", "-4", "route", "show", "dev", "meshrun0").stdout
        ):
            assert time.monotonic() < deadline, f"{n}: {routes}"
            time.sleep(0.5)
    res = mesh.meshrun(
        "hq-a", "train", "--timeout", "60", "allreduce.py", "--mib", "64", cwd=SCRIPTS, timeout=240, check=False
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"allreduce mib=64 world=2 seconds=[\d.]+", res.stdout), res.stdout
