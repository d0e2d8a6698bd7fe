"""End-to-end: the real mesh (meshrun init/join, wireguard-go, NAT'd namespaces) on one machine."""

from __future__ import annotations

import itertools
import json
import socket

import pytest

from meshrun.testbed import Mesh

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphan's zombie may linger under pid 1)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tcp_reaches(mesh: Mesh, src, dst_ip: str, port: int, listener) -> bool:
    """True if `src` completes a TCP handshake with dst_ip:port."""
    res = src.run(mesh.python, "-c", f"import socket; socket.create_connection(('{dst_ip}', {port}), timeout=2)",
                  check=False, timeout=20)
    return res.returncode == 0


def test_private_ips_do_not_route_across_datacenters(world_factory):
    """Negative control: without meshrun, a node cannot reach another datacenter's private IP.

    Every datacenter reuses 172.31.40.46, as clouds do: dialling the peer's private address
    lands on yourself (refused), while its public 1:1 address works.
    """
    world = world_factory(2)
    a, b = world.node("dc1-a"), world.node("dc2-a")
    listener = b.popen("python3", "-c", "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
                       "socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 29500)); s.listen(); time.sleep(30)")
    try:
        mesh = Mesh(world, "dc1-a")
        deadline = __import__("time").monotonic() + 10
        while not _tcp_reaches(mesh, a, b.public_ip, 29500, listener):
            assert __import__("time").monotonic() < deadline, "public path never worked"
        assert not _tcp_reaches(mesh, a, b.private_ip, 29500, listener)
    finally:
        listener.kill()
        listener.wait()


def test_three_datacenters_full_mesh_and_late_joiner(world_factory):
    """init + one token + two joins: all 6 ordered pairs ping; a 4th node joining later is
    reached by every earlier member without restarting anything."""
    world = world_factory(4)
    mesh = Mesh(world, "dc1-a")
    token = mesh.init()
    assert token.startswith("mr1.")
    for n in ("dc2-a", "dc3-a"):
        out = mesh.join(n).stdout
        assert f"as {n} at 10.213.0." in out
    first = ["dc1-a", "dc2-a", "dc3-a"]
    ips = {n: mesh.overlay_ip(n) for n in first}
    assert len(set(ips.values())) == 3
    daemons = {n: mesh.status(n)["daemon_pid"] for n in first}
    for src, dst in itertools.permutations(first, 2):
        mesh.wait_ping(src, ips[dst], timeout=20)

    # Private-IP traffic without meshrun still fails in the same world (the problem is real).
    assert not mesh.ping("dc2-a", "203.0.113.99")

    mesh.join("dc4-a")
    ips["dc4-a"] = mesh.overlay_ip("dc4-a")
    assert len(set(ips.values())) == 4
    for n in first:
        mesh.wait_ping(n, ips["dc4-a"], timeout=20)
        mesh.wait_ping("dc4-a", ips[n], timeout=20)
    # Nobody was restarted: the same daemons still run.
    assert {n: mesh.status(n)["daemon_pid"] for n in first} == daemons

    # Status on a node names every peer, with the public endpoint the coordinator observed.
    st = mesh.status("dc2-a")
    assert st["backend"] in ("wireguard-go", "kernel")
    by_name = {p["name"]: p for p in st["peers"]}
    assert set(by_name) == {"coordinator", "dc3-a", "dc4-a"}
    assert by_name["dc3-a"]["endpoint"] == f"{world.node('dc3-a').public_ip}:51820"
    assert by_name["dc3-a"]["latest_handshake"]
    text = mesh.meshrun("dc2-a", "status").stdout
    assert "dc4-a" in text and "wireguard-go" in text

    # The wg-quick file each member writes is valid for `wg-quick strip` and secret.
    conf = mesh.state_dir(world.node("dc2-a")) / "meshrun0.conf"
    assert oct(conf.stat().st_mode & 0o777) == "0o600"
    stripped = world.node("dc2-a").run("wg-quick", "strip", str(conf)).stdout
    assert stripped.count("[Peer]") == 3


def test_leave_and_down_remove_interfaces_and_daemons(world_factory):
    """leave/down stop the daemon and remove the interface; `up` brings a member back as it was."""
    world = world_factory(2)
    mesh = Mesh(world, "dc1-a")
    mesh.init()
    mesh.join("dc2-a")
    ip = mesh.overlay_ip("dc2-a")
    mesh.wait_ping("dc1-a", ip)
    node = world.node("dc2-a")
    pid = mesh.status(node)["daemon_pid"]
    assert mesh.meshrun(node, "leave").returncode == 0
    assert node.run("ip", "link", "show", "meshrun0", check=False).returncode != 0
    assert not _running(pid)
    # Joining again resumes the same identity.
    out = mesh.join(node).stdout
    assert f"resumed meshrun as dc2-a at {ip}" in out
    mesh.wait_ping("dc1-a", ip)
    assert mesh.meshrun("dc1-a", "down").returncode == 0
    assert world.node("dc1-a").run("ip", "link", "show", "meshrun0", check=False).returncode != 0
    st = json.loads(mesh.meshrun("dc1-a", "status", "--json").stdout)
    assert st["interface_up"] is False and st["daemon_pid"] is None
