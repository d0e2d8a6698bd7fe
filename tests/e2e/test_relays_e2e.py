"""Peer relays in the namespace world: a pair behind two symmetric NATs is relayed by a member, not the
coordinator; the relay losing its uplink moves the pair to another relay within 10 s while a TCP transfer
carries on; and with the coordinator cut off for 60 s, direct and peer-relayed pairs keep a gloo job going.

World: hq (the coordinator), dca and dcb (one-to-one NAT: reachable members), dcc and dcd (symmetric NAT:
never direct with each other)."""

from __future__ import annotations

import json
import time

from support import TESTS

from meshrun.lab.testbed import DatacenterSpec

SCRIPTS = TESTS / "scripts"
WORLD = [
    DatacenterSpec("hq"),
    DatacenterSpec("dca"),
    DatacenterSpec("dcb"),
    DatacenterSpec("dcc", nat="symmetric"),
    DatacenterSpec("dcd", nat="symmetric"),
]
NODES = ["dca-a", "dcb-a", "dcc-a", "dcd-a"]


def settled(mesh, timeout: float = 90) -> dict:
    """The coordinator's pairs once every pair is decided: verified direct, or relayed."""
    deadline = time.monotonic() + timeout
    while True:
        pairs = {frozenset((p["a"], p["b"])): p for p in mesh.status("hq-a")["pairs"]}
        if len(pairs) == 6 and all(p["verified"] or p["path"] == "relayed" for p in pairs.values()):
            return pairs
        assert time.monotonic() < deadline, pairs
        time.sleep(1)


def relay_of(mesh, a: str, b: str) -> str | None:
    for p in mesh.status("hq-a")["pairs"]:
        if {p["a"], p["b"]} == {a, b}:
            return p.get("relay")
    return None


def test_a_symmetric_pair_is_relayed_by_a_member_and_moves_within_10_s_when_it_goes(fresh_mesh):
    mesh = fresh_mesh(WORLD, "hq-a", NODES)
    pairs = settled(mesh)
    cd = pairs[frozenset(("dcc-a", "dcd-a"))]
    assert cd["path"] == "relayed" and cd["relay"] in ("dca-a", "dcb-a"), cd  # a member, not the coordinator
    relay = cd["relay"]
    other = "dcb-a" if relay == "dca-a" else "dca-a"
    for p in pairs.values():
        if p is not cd:
            assert p["path"] == "direct (public)" and p["verified"], p
    # Both ends name the relay; the relay knows what it forwards.
    for me, peer in (("dcc-a", "dcd-a"), ("dcd-a", "dcc-a")):
        row = {r["name"]: r for r in mesh.status(me)["peers"]}[peer]
        assert row["path"] == "relayed" and row["relay"] == relay, row
    assert sorted(map(sorted, mesh.status(relay)["relaying"])) == [["dcc-a", "dcd-a"]]
    assert mesh.status(other)["relaying"] == []
    d_ip = mesh.overlay_ip("dcd-a")
    mesh.wait_ping("dcc-a", d_ip, timeout=30)

    # 64 MiB from dcc-a to dcd-a at about 4 MiB/s; 4 s in, the relay loses its uplink.
    world = mesh.world
    recv = world.node("dcd-a").popen(
        mesh.python, str(SCRIPTS / "tcp_transfer.py"), "recv", d_ip, "39001", stdout=-1, stderr=-1, text=True
    )
    time.sleep(1)
    send = world.node("dcc-a").popen(
        mesh.python,
        str(SCRIPTS / "tcp_transfer.py"),
        "send",
        d_ip,
        "39001",
        str(64 << 20),
        "4",
        "7",
        stdout=-1,
        stderr=-1,
        text=True,
    )
    try:
        time.sleep(4)
        assert send.poll() is None, "the transfer ended before the relay was cut"
        cut_at = time.monotonic()
        world.node(relay).run("ip", "link", "set", "eth0", "down")
        moved = None
        while time.monotonic() - cut_at < 30:
            now_relay = relay_of(mesh, "dcc-a", "dcd-a")
            if now_relay not in (relay, None):
                moved = time.monotonic() - cut_at
                break
            time.sleep(0.25)
        assert moved is not None, "the pair kept its dead relay"
        assert moved < 10, f"the pair took {moved:.1f} s to move to another relay"
        back = mesh.wait_ping("dcc-a", d_ip, timeout=20) + moved
        sent = json.loads(send.communicate(timeout=120)[0].strip().splitlines()[-1])
        got = json.loads(recv.communicate(timeout=60)[0].strip().splitlines()[-1])
    finally:
        for p in (send, recv):
            if p.poll() is None:
                p.kill()
                p.wait()
        world.node(relay).run("ip", "link", "set", "eth0", "up", check=False)
    assert got["bytes"] == sent["bytes"] == 64 << 20 and got["sha256"] == sent["sha256"]
    print(
        f"relay {relay} cut: pair on {relay_of(mesh, 'dcc-a', 'dcd-a')} after {moved:.1f} s, pings after {back:.1f} s"
    )
    assert relay_of(mesh, "dcc-a", "dcd-a") in (other, "coordinator")


def test_with_the_coordinator_cut_off_for_60_s_direct_and_relayed_pairs_keep_a_job_running(fresh_mesh):
    mesh = fresh_mesh(WORLD, "hq-a", NODES)
    pairs = settled(mesh)
    relay = pairs[frozenset(("dcc-a", "dcd-a"))]["relay"]
    assert relay in ("dca-a", "dcb-a")
    ranks = ["dca-a", "dcc-a", "dcd-a"]  # dcc-a <-> dcd-a is peer-relayed, the rest direct
    master = mesh.overlay_ip(ranks[0])
    procs = []
    for r, name in enumerate(ranks):
        env = {
            "MASTER_ADDR": master,
            "MASTER_PORT": "29533",
            "RANK": str(r),
            "WORLD_SIZE": "3",
            "GLOO_SOCKET_IFNAME": "meshrun0",
        }
        procs.append(
            mesh.world.node(name).popen(
                mesh.python,
                str(SCRIPTS / "steady_allreduce.py"),
                "--iters",
                "180",
                "--gap",
                "0.5",
                env=env,
                stdout=-1,
                stderr=-1,
                text=True,
            )
        )
    hq = mesh.world.node("hq-a")
    try:
        time.sleep(8)  # connected and running
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
        hq.run("ip", "link", "set", "eth0", "down")
        cut = time.monotonic()
        time.sleep(30)
        # The agents say so, and keep every tunnel as it was.
        st = mesh.status("dcc-a")
        assert any("the coordinator has not answered" in w for w in st["warnings"]), st["warnings"]
        assert {r["name"]: r for r in st["peers"]}["dcd-a"]["relay"] == relay
        time.sleep(max(0.0, 60 - (time.monotonic() - cut)))
        assert all(p.poll() is None for p in procs), "a rank stopped while the coordinator was away"
        hq.run("ip", "link", "set", "eth0", "up")
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        hq.run("ip", "link", "set", "eth0", "up", check=False)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    final = json.loads(outs[0][0].strip().splitlines()[-1])
    assert final["done"] == 180, final
    # Once the coordinator is back, the agents hear from it again.
    deadline = time.monotonic() + 60
    while any("the coordinator has not answered" in w for w in mesh.status("dcc-a")["warnings"]):
        assert time.monotonic() < deadline, "the agent never heard from the coordinator again"
        time.sleep(1)
