"""End-to-end on kernel WireGuard with WAN delay and loss, in a VM (tests/vm.py, scenario in scripts/vm_mesh.py).

This host's kernel has neither WireGuard nor netem; Debian's kernel under QEMU has both. One boot
runs the whole scenario (a boot costs ~40 s under TCG): three NAT'd datacenters with 25 ms each way
and 1% loss on every WAN link mesh on kernel WireGuard, a symmetric-NAT node joins later and is
reached by all without restarts, its pair with the other symmetric-NAT node is relayed, 512 KiB cross
the relayed pair over TCP, and leave/down remove the interfaces.
"""

from __future__ import annotations

import os

import pytest
import vm
from support import TESTS

SCENARIO = TESTS / "scripts" / "vm_mesh.py"
EXPECTED = [
    "netem_on_the_wan",
    "three_datacenters_all_pairs_ping",
    "a_later_node_is_reached_by_all",
    "without_restarts",
    "kernel_backend",
    "symmetric_pair_relayed_others_direct",
    "tcp_transfer_over_the_relayed_pair",
    "leave_removes_the_interface",
    "down_removes_the_interface",
    "world_torn_down",
]


@pytest.fixture(scope="module")
def vm_run(tmp_path_factory):
    why = vm.unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the VM test: {why}")
        pytest.skip(why)
    return vm.run(SCENARIO, tmp_path_factory.mktemp("vm"), timeout=1500)  # ~7 min alone, twice that beside a worker


@pytest.mark.load
def test_kernel_wireguard_mesh_under_wan_delay_and_loss(vm_run):
    checks = {c["check"]: c for c in vm_run["checks"]}
    context = f"guest log:\n{vm_run['log'][-4000:]}\nvng:\n{vm_run['vng'][-2000:]}"
    failed = [c for c in vm_run["checks"] if not c["ok"]]
    assert not failed, f"{failed}\n{context}"
    assert list(checks) == EXPECTED, context
    assert vm_run["done"] and vm_run["rc"] == 0, context
    assert checks["kernel_backend"]["backends"] == dict.fromkeys(("dc1-a", "dc2-a", "dc3-a", "dc4-a"), "kernel")
    transfer = checks["tcp_transfer_over_the_relayed_pair"]
    assert transfer["received"] == transfer["sent"] and transfer["sent"].startswith(f"{512 << 10} ")
