"""A real etcd with a 32 MiB quota (--quota-backend-bytes; meshrun's other flags as etcdconf writes them):
three coordinators' rendezvous clients (meshrun.system.control.etcdjobs.EtcdKV) overwrite one key with the largest
value a rendezvous takes, 2.5 times the quota in all. Before issue 35 (item 4) 304 such writes filled an etcd of
64 MiB for good; with EtcdKV's compaction its database stays far below the quota and control writes work."""

from __future__ import annotations

import os

import pytest
from realetcd import RealEtcd

from meshrun.errors import ControlStateError
from meshrun.mesh.coordinator.rendezvous import MAX_VALUE
from meshrun.system.control.etcdjobs import EtcdKV

QUOTA = 32 * 1024 * 1024


@pytest.fixture
def small_etcd(tmp_path):
    """Three clients of one real etcd with a 32 MiB quota."""
    server = RealEtcd(tmp_path, quota=QUOTA)
    clients = [server.make_client(timeout=10.0) for _ in range(3)]
    try:
        yield clients
    finally:
        for c in clients:
            c.close()
        server.stop()


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
