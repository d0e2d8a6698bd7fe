"""One Device contract (tests/device_contract.py), two devices: FakeDevice here, WireGuardDevice on wireguard-go in a
network namespace of its own (root)."""

from __future__ import annotations

import device_contract
from support import TESTS

from meshrun.system.kernel.fakedevice import FakeDevice

HERE = TESTS


def test_the_fake_keeps_the_contract(tmp_path):
    results = device_contract.run_all(lambda: FakeDevice(name="mr-contract"), tmp_path)
    assert results == {name: "ok" for name in device_contract.CASES}, results
