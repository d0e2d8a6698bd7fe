"""A real etcd with a 32 MiB quota (--quota-backend-bytes; meshrun's other flags as etcdconf writes them):
three coordinators' rendezvous clients (meshrun.system.etcdjobs.EtcdKV) overwrite one key with the largest
value a rendezvous takes, 2.5 times the quota in all. Before issue 35 (item 4) 304 such writes filled an etcd of
64 MiB for good; with EtcdKV's compaction its database stays far below the quota and control writes work."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

from meshrun.core import etcdconf, keys
from meshrun.errors import ControlStateError
from meshrun.mesh.coordinator.rendezvous import MAX_VALUE
from meshrun.system import etcd
from meshrun.system.etcd import EtcdClient
from meshrun.system.etcdjobs import EtcdKV

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
QUOTA = 32 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def small_etcd(tmp_path):
    if not os.access(ETCD, os.X_OK):
        reason = f"etcd is not installed ({ETCD}; Debian: apt install etcd-server)"
        if os.environ.get("CI"):
            pytest.fail(f"the real-etcd tests cannot run in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    tls = tmp_path / "tls"
    tls.mkdir()
    ca = keys.new_ca("meshrun-etcd-ca")
    (tls / etcdconf.CA_FILE).write_text(ca[0])
    paths = {}
    for name in ("etcd", "client"):
        key, csr = keys.new_csr(name, "127.0.0.1")
        (tls / f"{name}.crt").write_text(keys.sign_csr(*ca, csr, "127.0.0.1"))
        (tls / f"{name}.key").write_text(key)
        (tls / f"{name}.key").chmod(0o600)
        paths[name] = (str(tls / f"{name}.crt"), str(tls / f"{name}.key"))
    client_port, peer_port = free_port(), free_port()
    argv = etcdconf.server_argv(
        "m1",
        tmp_path / "data",
        "127.0.0.1",
        client_port,
        peer_port,
        {"m1": etcdconf.peer_url("127.0.0.1", peer_port)},
        "new",
        tls,
    )
    argv[argv.index("--quota-backend-bytes") + 1] = str(QUOTA)
    log = tmp_path / "etcd.log"
    pid = etcd.start_server([ETCD, *argv], log)
    url = etcdconf.client_url("127.0.0.1", client_port)
    clients = [EtcdClient([url], str(tls / etcdconf.CA_FILE), *paths["client"], 10.0) for _ in range(3)]
    try:
        etcd.wait_healthy(clients[0], 60, log, pid)
        yield clients
    finally:
        for c in clients:
            c.close()
        etcd.stop_server(pid)


@pytest.mark.parametrize("compacting", [True, False])
def test_rendezvous_overwrites_leave_a_real_etcd_room(small_etcd, compacting):
    """With compaction the database stays under half the quota; without it (the negative control: etcd's own
    compactor, every 5 minutes) the same writes raise etcd's NOSPACE alarm and even a lease grant fails."""
    every = QUOTA // 64 if compacting else 1 << 40  # COMPACT_EVERY scaled to this quota
    kvs = [EtcdKV(c, compact_every=every) for c in small_etcd]
    value = os.urandom(MAX_VALUE)  # incompressible, as an attacker's would be
    writes = int(2.5 * QUOTA / MAX_VALUE)
    try:
        for i in range(writes):
            kv = kvs[i % 3]
            cur = kv.get("rdzv/J/store/k")
            assert kv.put_if("rdzv/J/store/k", value, cur[1] if cur is not None else 0)
    except ControlStateError as exc:
        assert not compacting and "database space exceeded" in str(exc), exc
        with pytest.raises(ControlStateError):
            small_etcd[0].lease_grant(5)
        return
    assert compacting, "the negative control did not fill etcd: the test proves nothing"
    size = small_etcd[0].status()["db_size"]
    assert size < QUOTA // 2, size
    small_etcd[0].put(b"/control/leader", b"b", lease=small_etcd[0].lease_grant(5))  # still writable
    assert small_etcd[1].get(b"/control/leader").value == b"b"
