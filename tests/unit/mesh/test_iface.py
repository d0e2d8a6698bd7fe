"""meshrun.mesh.iface on FakeDevices: every member's interface comes up behind its forward guard."""

from __future__ import annotations

import pytest
from fakemesh import FakeMesh

from meshrun.core.model import Network
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
