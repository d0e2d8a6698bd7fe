"""Several tunnels per same-site pair (`meshrun join --tunnels 3`), as a user runs them and as a neighbour tries them.

Real meshrun and wireguard-go in the NAT'd namespace world: hq (coordinator) and one site dc1 of three nodes,
dc1-a and dc1-b with three tunnels per pair, dc1-c with the default one. The flows between a and b spread over
all three tunnels (each device's counters move), each connection's answers come back on the tunnel its data
takes, an overlay store bound as meshrun binds it answers on every one of them, a pair with c stays on meshrun0
alone (c's one tunnel is known: nothing dials it on another), a tunnel whose wireguard-go dies mid-transfer
leaves the spread and the transfer finishes, a LAN neighbour cannot reach a's overlay address around WireGuard
now that its listeners are bound to the address alone, and `leave` takes it all away.
"""

from __future__ import annotations

import json
import textwrap
import time

import pytest
from support import UDP_LISTEN, joined_mesh, wait_for

from meshrun.core import tunnels
from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec
from meshrun.system.machine import procs

pytestmark = pytest.mark.slow

COUNT = 3
EXTRA = tunnels.device_names("meshrun0", COUNT)
DEVICES = ["meshrun0", *EXTRA]
PORT = 39410
# The receiver: accepts `flows` connections on its overlay address (or fewer, when `seconds` pass with no new
# one), prints the bytes once they have closed.
SINK = textwrap.dedent("""\
    import socket, sys, threading, time
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.listen(64)
    s.settimeout(float(sys.argv[3]))
    flows = int(sys.argv[4])
    total, lock, threads = [0], threading.Lock(), []
    def drain(c):
        n = 0
        while True:
            b = c.recv(1 << 16)
            if not b:
                break
            n += len(b)
        with lock:
            total[0] += n
    print("ready", flush=True)
    while len(threads) < flows:
        try:
            c, _ = s.accept()
        except TimeoutError:
            break
        t = threading.Thread(target=drain, args=(c,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    print(total[0], flush=True)
""")
# The sender: `flows` connections, each sending 64 KiB every `gap` s for `seconds` s; prints the bytes sent.
SOURCE = textwrap.dedent("""\
    import socket, sys, threading, time
    dst, port, flows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    seconds, gap = float(sys.argv[4]), float(sys.argv[5])
    chunk, sent, lock = b"x" * (1 << 16), [0], threading.Lock()
    def flow():
        c = socket.create_connection((dst, port), timeout=30)
        end, n = time.monotonic() + seconds, 0
        while True:
            c.sendall(chunk)
            n += len(chunk)
            if time.monotonic() >= end:
                break
            time.sleep(gap)
        c.close()
        with lock:
            sent[0] += n
    ts = [threading.Thread(target=flow) for _ in range(flows)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(sent[0], flush=True)
""")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    dcs = [DatacenterSpec("hq"), DatacenterSpec("dc1", nat="cone", nodes=3)]
    with joined_mesh(tmp_path_factory, dcs, "hq-a", ()) as m:
        for n in ("dc1-a", "dc1-b"):
            m.join(n, "--site", "fra", "--tunnels", str(COUNT))
        m.join("dc1-c", "--site", "fra")
        wait_for(
            lambda: live(m, "dc1-a", "dc1-b") == [1, 2], "dc1-a's tunnels to dc1-b answer", 90, (m, "dc1-a", "dc1-b")
        )
        wait_for(
            lambda: live(m, "dc1-b", "dc1-a") == [1, 2], "dc1-b's tunnels to dc1-a answer", 90, (m, "dc1-b", "dc1-a")
        )
        yield m


def record(mesh: Mesh, node: str) -> dict:
    path = mesh.state_dir(mesh.world.node(node)) / "tunnels.json"
    return json.loads(path.read_text()) if path.exists() else {}


def live(mesh: Mesh, node: str, peer: str) -> list[int] | None:
    """The extra tunnels carrying `node`'s flows to `peer` now (None: `peer` is not planned on them)."""
    p = record(mesh, node).get("peers", {}).get(peer)
    return p["live"] if p else None


def tx_bytes(mesh: Mesh, node: str, counter: str = "tx_bytes") -> dict[str, int]:
    cmd = " ; ".join(f"cat /sys/class/net/{d}/statistics/{counter} 2>/dev/null || echo 0" for d in DEVICES)
    out = mesh.world.node(node).run("sh", "-c", cmd).stdout.split()
    return dict(zip(DEVICES, (int(x) for x in out)))


def transfer(
    mesh: Mesh, src: str, dst: str, flows: int, seconds: float, gap: float, during=None, idle: float = 30
) -> tuple[int, int]:
    """(bytes sent, bytes received) of `flows` TCP connections from `src` to `dst`'s overlay address; `during()`
    runs once the flows have started; the receiver stops waiting for a connection after `idle` s."""
    sink = mesh.world.node(dst).popen(
        mesh.python, "-c", SINK, mesh.overlay_ip(dst), str(PORT), str(idle), str(flows),
        stdout=-1, stderr=-1, text=True,
    )  # fmt: skip
    try:
        assert sink.stdout.readline().strip() == "ready"
        source = mesh.world.node(src).popen(
            mesh.python, "-c", SOURCE, mesh.overlay_ip(dst), str(PORT), str(flows), str(seconds), str(gap),
            stdout=-1, stderr=-1, text=True,
        )  # fmt: skip
        try:
            if during is not None:
                time.sleep(min(3.0, seconds / 3))
                during()
            out, err = source.communicate(timeout=seconds + 120)
            assert source.returncode == 0, err
        finally:
            if source.poll() is None:
                source.kill()
                source.wait()
        got, err = sink.communicate(timeout=60)
        assert sink.returncode == 0, err
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    return int(out.split()[-1]), int(got.split()[-1])


def test_a_pairs_flows_spread_over_its_tunnels_and_status_says_so(mesh):
    before = tx_bytes(mesh, "dc1-a")
    sent, got = transfer(mesh, "dc1-a", "dc1-b", flows=24, seconds=2, gap=0.0)
    after = tx_bytes(mesh, "dc1-a")
    assert sent == got > 0
    moved = {d: after[d] - before[d] for d in DEVICES}
    # 24 flows hashed by their ports over 3 next hops: each gets some (all on one: 3 x (2/3)^24, about 2e-4).
    assert all(v > sent / 24 for v in moved.values()), moved
    row = next(r for r in mesh.status("dc1-a")["peers"] if r["name"] == "dc1-b")
    assert row["tunnels"] == COUNT and row["path"].endswith(f", {COUNT} tunnels"), row
    assert set(row["tunnel_bytes"]) == set(EXTRA) and all(v > 0 for v in row["tunnel_bytes"].values()), row
    assert mesh.meshrun("dc1-a", "status").stdout.count(f"{COUNT} tunnels") >= 1


def test_a_connections_answers_come_back_on_the_tunnel_its_data_takes(mesh):
    """One connection at a time from a to b: the device a sends its data on is the one b sends its
    acknowledgements on. Data on one tunnel and answers on another cost a single stream 0.4 of its rate on
    these machines (the kernel's own multipath route did that: a connecting socket's next hop was not its
    ports' hash)."""
    used = []
    for _ in range(8):
        a0, b0 = tx_bytes(mesh, "dc1-a", "tx_packets"), tx_bytes(mesh, "dc1-b", "tx_packets")
        sent, got = transfer(mesh, "dc1-a", "dc1-b", flows=1, seconds=1, gap=0.0)
        a1, b1 = tx_bytes(mesh, "dc1-a", "tx_packets"), tx_bytes(mesh, "dc1-b", "tx_packets")
        assert sent == got > 0
        data = {d: a1[d] - a0[d] for d in DEVICES}
        acks = {d: b1[d] - b0[d] for d in DEVICES}
        assert max(data, key=data.get) == max(acks, key=acks.get), (data, acks)
        used.append(max(data, key=data.get))
    # 8 connections hashed over 3 tunnels: all on one has odds 3 x (1/3)^8, about 5e-4.
    assert len(set(used)) > 1, used


def test_a_store_meshrun_binds_for_the_overlay_answers_on_every_tunnel(mesh):
    """torchrun's store on a rank-0 node is bound as meshrun binds overlay listeners (tcpstore.listener, device
    meshrun0): beside tunnels to the address alone, so connects hashed onto any tunnel are accepted and none
    refused (a socket bound to meshrun0 answers a tunnel's SYN with a reset)."""
    accept = textwrap.dedent("""\
        import sys
        from meshrun.system.sockets import tcpstore
        s = tcpstore.listener(sys.argv[1], int(sys.argv[2]), "meshrun0")
        print("ready", flush=True)
        for _ in range(30):
            s.accept()[0].close()
        print("accepted 30", flush=True)
    """)
    connect = textwrap.dedent("""\
        import socket, sys
        for _ in range(30):
            socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
        print("connected 30")
    """)
    b_ip = mesh.overlay_ip("dc1-b")
    server = mesh.world.node("dc1-b").popen(mesh.python, "-c", accept, b_ip, "39412", stdout=-1, stderr=-1, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        before = tx_bytes(mesh, "dc1-a")
        res = mesh.world.node("dc1-a").run(mesh.python, "-c", connect, b_ip, "39412", check=False)
        after = tx_bytes(mesh, "dc1-a")
        out = server.communicate(timeout=30)[0]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert res.stdout.strip() == "connected 30", res.stdout + res.stderr
    assert "accepted 30" in out
    assert sum(after[d] - before[d] for d in EXTRA) > 0, (before, after)  # some of them took a tunnel


def test_a_peer_with_one_tunnel_is_not_dialled_on_the_extra_tunnels_and_stays_on_the_interface(mesh):
    assert live(mesh, "dc1-a", "dc1-c") is None  # c reports one tunnel: not planned, never probed
    assert record(mesh, "dc1-c") in ({}, {"count": 1}) or not record(mesh, "dc1-c").get("devices")
    keys = {r["name"]: r["public_key"] for r in mesh.status("dc1-a")["peers"]}
    dialled = mesh.world.node("dc1-a").run("wg", "show", EXTRA[0], "peers").stdout.split()
    assert keys["dc1-b"] in dialled and keys["dc1-c"] not in dialled, dialled
    before = tx_bytes(mesh, "dc1-a")
    sent, got = transfer(mesh, "dc1-a", "dc1-c", flows=12, seconds=1, gap=0.0)
    after = tx_bytes(mesh, "dc1-a")
    assert sent == got > 0
    assert after["meshrun0"] - before["meshrun0"] > sent
    assert all(after[d] - before[d] < 64 << 10 for d in EXTRA), (before, after)  # probes only


def test_a_tunnel_whose_wireguard_go_dies_mid_transfer_leaves_the_spread_and_the_transfer_finishes(mesh):
    rec = record(mesh, "dc1-b")
    pid = rec["pids"][EXTRA[0]]

    def kill():
        mesh.world.node("dc1-b").run("kill", "-9", str(pid))

    sent, got = transfer(mesh, "dc1-a", "dc1-b", flows=24, seconds=12, gap=0.05, during=kill)
    assert sent == got > 0
    # dc1-b's agent makes the tunnel anew at a later sync, and the pair takes it again once it answers.
    wait_for(lambda: record(mesh, "dc1-b")["pids"].get(EXTRA[0]) not in (None, pid), "dc1-b makes the tunnel anew", 90)
    wait_for(lambda: live(mesh, "dc1-a", "dc1-b") == [1, 2], "dc1-a takes the new tunnel again", 90)


SEND = textwrap.dedent("""\
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, int(sys.argv[4]))
    s.bind((sys.argv[2], 0))
    for _ in range(3):
        s.sendto(sys.argv[3].encode(), (sys.argv[1], 39411))
""")


def test_a_lan_neighbour_cannot_reach_the_overlay_address_around_wireguard(mesh):
    """dc1-c routes datagrams for dc1-a's overlay address straight to dc1-a's LAN address: dc1-a's listeners,
    bound to the address alone beside tunnels, must not see them (the tunnels' guard); sent the usual way
    (WireGuard) they arrive."""
    a, c = mesh.world.node("dc1-a"), mesh.world.node("dc1-c")
    a_ip, c_ip = mesh.overlay_ip("dc1-a"), mesh.overlay_ip("dc1-c")
    listener = a.popen(mesh.python, "-c", UDP_LISTEN, a_ip, "39411", "5", stdout=-1, stderr=-1, text=True)
    c.run("ip", "route", "add", f"{a_ip}/32", "via", str(a.private_ip), "dev", "eth0", "table", "77")
    c.run("ip", "rule", "add", "pref", "77", "fwmark", "77", "lookup", "77")
    try:
        assert listener.stdout.readline().strip() == "ready"
        c.run(mesh.python, "-c", SEND, a_ip, c_ip, "around-wireguard", "77")
        c.run(mesh.python, "-c", SEND, a_ip, c_ip, "control", "0")
        out = listener.communicate(timeout=30)[0]
    finally:
        c.run("ip", "rule", "del", "pref", "77", check=False)
        c.run("ip", "route", "del", f"{a_ip}/32", "table", "77", check=False)
        if listener.poll() is None:
            listener.kill()
            listener.wait()
    got = [tuple(line.split(" ", 1)) for line in out.splitlines() if line.strip()]
    assert (c_ip, "control") in got, got
    assert all(payload == "control" for _, payload in got), got


def test_leave_takes_every_tunnel_rule_route_and_guard_away(mesh):
    a = mesh.world.node("dc1-a")
    assert "jhash" in a.run("nft", "list", "table", "inet", tunnels.GUARD_TABLE).stdout  # b's flows spread
    pids = list(record(mesh, "dc1-a")["pids"].values())
    assert len(pids) == COUNT - 1
    mesh.meshrun(a, "leave")
    links = a.run("ip", "-o", "link", "show").stdout
    assert not any(d in links for d in EXTRA), links
    rules = a.run("ip", "-4", "rule", "show").stdout
    assert not any(str(tunnels.probe_table(i)) in rules for i in range(1, COUNT)), rules  # probes' and spread's
    assert tunnels.GUARD_TABLE not in a.run("nft", "list", "tables").stdout
    assert not a.run("ip", "-4", "route", "show", "table", str(tunnels.probe_table(1))).stdout.strip()
    assert not any(procs.alive(pid) for pid in pids), pids  # gone, or a zombie its parent has not reaped
