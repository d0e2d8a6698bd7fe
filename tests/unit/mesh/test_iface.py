"""meshrun.mesh.iface on FakeDevices: every member's interface comes up behind its forward guard."""

from __future__ import annotations

import pytest
from fakemesh import FakeMesh

from meshrun.core import keys
from meshrun.core.model import Network
from meshrun.core.peers import PeerSpec
from meshrun.errors import NetworkError
from meshrun.mesh import iface
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.fakedevice import FakeDevice


def test_every_member_guards_forwarding_before_its_interface_is_up(tmp_path):
    mesh = FakeMesh(tmp_path)
    n = mesh.join("gpu-a", "198.51.100.7:40000")
    for device in (mesh.coord_device, n.device):
        assert device.guarded and device.guarded_before_up, device.name


def test_an_interface_recreated_after_a_reboot_is_guarded_again(tmp_path):
    mesh = FakeMesh(tmp_path)
    n = mesh.join("gpu-a", "198.51.100.7:40000")
    n.device.delete()  # a reboot: the interface and its nftables rules are gone
    assert not n.device.guarded
    n.agent._ensure_interface()
    assert n.device.present and n.device.guarded and n.device.guarded_before_up


class Unconfigurable(FakeDevice):
    def configure(self, *a, **kw):
        raise NetworkError("wg refused the key", "check private.key")


def test_a_failed_bring_up_leaves_neither_interface_nor_guard(tmp_path):
    state = StateDir(tmp_path / "state")
    state.create()
    state.write("private.key", "x\n", secret=True)
    network = Network.from_dict(FakeMesh(tmp_path / "mesh").network.to_dict())
    device = Unconfigurable(name=network.interface)
    with pytest.raises(NetworkError):
        iface.bring_up(device, state, network, "10.213.0.9")
    assert not device.present and not device.guarded


def test_an_interface_brought_up_after_a_reboot_gets_the_peers_it_last_knew(tmp_path):
    """A coordinator of several reaches the others (its etcd member needs them) before it can read the state
    that lists them: the peers come back from the wg-quick file it last wrote, another coordinator's endpoint
    and keepalive included (nodes have none: they dial in)."""
    mesh = FakeMesh(tmp_path)
    for i, name in enumerate(("gpu-a", "gpu-b")):
        mesh.join(name, f"198.51.100.{7 + i}:40000")
    other = PeerSpec(keys.public_key(keys.generate_private_key()), ("10.213.0.9/32",), "203.0.113.9:51820", 25)
    last = [*mesh.coord.desired_peers(), other]
    ip = mesh.network.coordinator_ip
    iface.write_quick_file(mesh.coord_state, mesh.network, last, address=ip, mtu=mesh.network.mtu, comment="x")
    rebooted = FakeDevice()
    iface.bring_up(rebooted, mesh.coord_state, mesh.network, ip)
    assert rebooted.peers() == []
    assert iface.restore_peers(rebooted, mesh.coord_state, mesh.network) == 3
    got = {(p.public_key, p.allowed_ips, p.endpoint, p.keepalive) for p in rebooted.peers()}
    assert got == {(p.public_key, p.allowed_ips, p.endpoint, p.keepalive) for p in last}


def test_without_a_readable_quick_file_nothing_is_restored(tmp_path):
    mesh = FakeMesh(tmp_path)
    device = FakeDevice()
    iface.bring_up(device, mesh.coord_state, mesh.network, mesh.network.coordinator_ip)
    (mesh.coord_state / f"{mesh.network.interface}.conf").unlink(missing_ok=True)
    assert iface.restore_peers(device, mesh.coord_state, mesh.network) == 0
    (mesh.coord_state / f"{mesh.network.interface}.conf").write_text("[Peer]\nnot a line\n")
    assert iface.restore_peers(device, mesh.coord_state, mesh.network) == 0
    assert device.peers() == []
