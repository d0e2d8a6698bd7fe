"""One Device contract (tests/device_contract.py), two devices: FakeDevice here, WireGuardDevice on wireguard-go in a
network namespace of its own (root)."""

from __future__ import annotations

import json
import subprocess
import sys

import device_contract
import pytest
from support import TESTS, netns_unavailable_reason, unique_prefix

HERE = TESTS


def test_wireguard_go_keeps_the_contract(tmp_path):
    """The same cases on the real device; a case the fake passes and this fails is a wrong fake."""
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    ns = unique_prefix() + "-dev"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        res = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                "mount -t tmpfs tmpfs /run/wireguard 2>/dev/null || { mkdir -p /run/wireguard && "
                'mount -t tmpfs tmpfs /run/wireguard; }; exec "$@"',
                "-",
                sys.executable,
                str(HERE / "device_contract.py"),
                "real",
                "mrcontract0",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PYTHONPATH": str(HERE.parent), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
        assert res.returncode == 0, res.stderr[-3000:]
        results = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    assert set(results) == set(device_contract.CASES)
    assert results == {name: "ok" for name in device_contract.CASES}, json.dumps(results, indent=1)
