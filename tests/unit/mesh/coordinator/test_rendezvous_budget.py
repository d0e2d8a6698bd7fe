"""meshrun.mesh.coordinator.rendezvous's budgets (issue 35, item 4): a job's rendezvous may not fill the
coordinators' shared store. torch's own rendezvous for 1000 nodes fits; a flooding job is refused with a typed
error (429 for its write rate, 400 for what it holds) while other jobs and the control plane's writes go on;
and the compaction in meshrun.system.control.etcdjobs.EtcdKV keeps etcd (the fake's model of its quota, then a real
etcd with a 32 MiB quota) far from full however much a job overwrites."""

from __future__ import annotations

import base64
import json

import pytest

from meshrun.core.jobspec import JobRecord, JobState
from meshrun.errors import ControlStateError, UsageError
from meshrun.jobs.rdzv_backend import STATE_BASE, STATE_PER_NODE, keep_alive_interval
from meshrun.mesh.coordinator import rendezvous
from meshrun.mesh.coordinator.rendezvous import (
    JOB_BYTES,
    MAX_VALUE,
    WRITE_BURST,
    WRITE_PER_S,
    Budget,
    MemoryKV,
    OverBudget,
    RendezvousService,
    WriteRateExceeded,
    http_status,
)
from meshrun.system.control import etcdjobs
from meshrun.system.control.etcdjobs import EtcdKV, JobReplica
from meshrun.system.control.fakeetcd import NOSPACE, FakeEtcd
from meshrun.system.sockets.transport import Request

NODE, OTHER = "10.77.0.2", "10.77.0.9"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def service(kv, clock: Clock, budget: Budget | None = None, members=None) -> RendezvousService:
    jobs = members or {"J": {NODE}, "K": {OTHER}}
    return RendezvousService(kv, jobs.get, budget=budget, clock=clock)


def put(svc: RendezvousService, key: str, size: int, job: str = "J", caller: str = NODE) -> dict:
    return svc.handle(caller, job, {"op": "set", "key": key, "value": b64(b"x" * size)})


# --------------------------------------------------------------------------- torch's own rendezvous fits


def test_a_1000_node_rendezvous_fits_its_budget():
    """What torch writes for 1000 nodes, as fast as the store takes it: the joins (each rewrites the whole state,
    ~72 bytes a node, by compare-and-swap), the agents' store round (role infos, assigned ranks, a barrier of
    counted adds), and heartbeats at the interval meshrun.jobs.rdzv_backend picks: nothing is refused, and a
    round takes a small share of what a job may hold."""
    n = 1000
    ips = {f"10.77.{i // 250}.{i % 250 + 2}" for i in range(n)}
    clock, kv = Clock(), MemoryKV()
    svc = service(kv, clock, members={"J": ips})
    ip = sorted(ips)

    def set_state(i: int, size: int) -> None:
        for _ in range(3):  # torch re-reads and tries again when another node's write came first
            cur = svc.handle(ip[i], "J", {"op": "get_state"})
            body = {"op": "set_state", "state": b64(b"s" * size), "token": cur["token"]}
            if svc.handle(ip[i], "J", body)["ok"]:
                return
        raise AssertionError("set_state lost thrice without contention")

    for i in range(n):  # 1000 joins within 20 s
        set_state(i, STATE_PER_NODE * (i + 1) + STATE_BASE)
        clock.now += 0.02
    prefix = "torch.rendezvous.J.0/torchelastic/"
    for i in range(n):
        svc.handle(ip[i], "J", {"op": "set", "key": f"{prefix}role_info/{i}", "value": b64(b"r" * 64)})
    for start in range(0, n, 256):
        keys = [f"{prefix}assigned_ranks/{i}" for i in range(start, min(n, start + 256))]
        svc.handle(ip[0], "J", {"op": "multi_set", "keys": keys, "values": [b64(b"a" * 48)] * len(keys)})
    for i in range(n):
        body = {"op": "add", "key": f"{prefix}barrier/num_members", "amount": 1, "id": f"add-{i:060d}"}
        svc.handle(ip[i], "J", body)
        svc.handle(ip[i], "J", {"op": "set", "key": f"{prefix}barrier/{i}_trace", "value": b64(b"<val_ignored>")})
    keys, held = kv.usage("rdzv/J/")
    assert keys < rendezvous.JOB_KEYS / 10 and held < JOB_BYTES / 4, (keys, held)
    # Heartbeats: every node rewrites the whole state once an interval, for three intervals.
    interval = keep_alive_interval(n)
    assert 5 < interval <= 90
    full = STATE_PER_NODE * n + STATE_BASE
    for _ in range(3 * n):
        clock.now += interval / n
        svc.handle(ip[0], "J", {"op": "set_state", "state": b64(b"h" * full), "token": svc._state_answer("J")["token"]})
    assert n * full / interval <= WRITE_PER_S / 2
    assert sum(u.refused for u in svc._usage.values()) == 0


def test_small_jobs_keep_torchs_heartbeat():
    assert keep_alive_interval(1) == keep_alive_interval(64) == keep_alive_interval(256) == 5
    assert keep_alive_interval(500) < keep_alive_interval(1000) <= 90


# --------------------------------------------------------------------------- a flooding job is refused


def test_a_flood_is_refused_at_its_write_rate_and_other_jobs_go_on():
    clock, kv = Clock(), MemoryKV()
    svc = service(kv, clock)
    big = MAX_VALUE
    accepted = refused = 0
    for _ in range(2000):  # 350 MB offered within 20 s (the overlay gate would let 50 requests a second through)
        clock.now += 0.01
        try:
            put(svc, "k", big)
            accepted += 1
        except WriteRateExceeded as err:
            refused += 1
            assert http_status(err) == 429 and "keep_alive_interval" in err.fix
    written = accepted * (big + 64)
    assert refused > 0 and written <= WRITE_BURST + WRITE_PER_S * 20 + big, (accepted, refused)
    # Another job's rendezvous is untouched by it ...
    put(svc, "k", big, job="K", caller=OTHER)
    # ... and the flooding job may write again once its rate allows.
    clock.now += big / WRITE_PER_S + 0.1
    put(svc, "k", big)


def test_what_a_job_holds_is_capped_in_keys_and_bytes():
    clock, kv = Clock(), MemoryKV()
    svc = service(kv, clock, Budget(keys=50, live_bytes=64 * 1024, per_s=1e12, burst=1 << 40))
    for i in range(50):
        put(svc, f"k{i}", 10)
    with pytest.raises(OverBudget) as err:
        put(svc, "one-more", 10)
    assert "50" in str(err.value) and "meshrun cancel J" in err.value.fix and http_status(err.value) == 400
    put(svc, "k1", 20)  # overwriting a key it holds is no new key
    svc.handle(NODE, "J", {"op": "delete_key", "key": "k2"})
    put(svc, "one-more", 10)  # a delete made room
    svc.forget("J")
    with pytest.raises(OverBudget) as err:
        put(svc, "huge", 65 * 1024)
    assert "MiB" in str(err.value)
    # A refused multi_set writes none of its keys, and a refused add counts nothing.
    with pytest.raises(OverBudget):
        svc.handle(NODE, "J", {"op": "multi_set", "keys": ["a", "b"], "values": [b64(b"1" * 40000)] * 2})
    assert kv.get("rdzv/J/store/a") is None
    put(svc, "K", 10, job="K", caller=OTHER)


def test_refusals_are_answered_429_and_400_with_one_line():
    clock, kv = Clock(), MemoryKV()
    svc = service(kv, clock, Budget(keys=1, live_bytes=1 << 20, per_s=1.0, burst=4096))

    def serve(key: str, size: int):
        body = {"op": "set", "key": key, "value": b64(b"x" * size)}
        return svc.serve(Request("POST", "/v1/rdzv/J", NODE, body))

    assert serve("a", 100).status == 200
    over = serve("b", 100)
    assert over.status == 400 and over.body["kind"] == "UsageError" and "\n" not in over.body["error"]
    fast = serve("a", 4000)
    assert fast.status == 429 and "a second" not in fast.body["error"] and "/s" in fast.body["error"]


def test_the_budget_counts_what_other_coordinators_wrote():
    """Each coordinator counts its own writes and reads back what the job holds every USAGE_TTL_S."""
    clock, kv = Clock(), MemoryKV()
    budget = Budget(keys=10, live_bytes=1 << 20, per_s=1e12, burst=1 << 40)
    one, two = service(kv, clock, budget), service(kv, clock, budget)
    for i in range(6):
        put(one, f"a{i}", 1)
    for i in range(4):
        put(two, f"b{i}", 1)
    with pytest.raises(OverBudget):  # the two wrote 6 + 4 = 10 keys: `one` sees them once it looks again
        clock.now += rendezvous.USAGE_TTL_S
        put(one, "c", 1)


# --------------------------------------------------------------------------- etcd stays usable


def running_job(store, job_id: str, ips: list[str]) -> JobReplica:
    rep = JobReplica(store, job_id, "a")
    rep.create({}, JobRecord(job_id, state=JobState.RUNNING))
    rep.allow(ips)
    return rep


def flood(services: list[RendezvousService], clock: Clock, writes: int) -> int:
    """`writes` sets of the largest value to one key, round-robin over `services` (the coordinators); the
    clock moves fast enough that the write rate refuses nothing: compaction alone must keep etcd's space."""
    refused = 0
    for i in range(writes):
        clock.now += 1.0
        try:
            put(services[i % len(services)], "k", MAX_VALUE)
        except ControlStateError:
            refused += 1
    return refused


@pytest.mark.parametrize("compacting", [True, False])
def test_rendezvous_floods_cannot_fill_etcd_when_its_clients_compact(compacting):
    """Three coordinators' clients over one etcd (the fake, with etcd's quota accounting: 64 MiB), a job
    overwriting one key with the largest value 600 times (over 100 MiB; 304 such writes filled a real etcd of
    this quota). With EtcdKV's compaction etcd stays under a quarter of its quota and every control write
    works; without it (the negative control) etcd raises NOSPACE and the control plane stops."""
    quota = 64 * 1024 * 1024
    store = FakeEtcd(quota=quota)
    rep = running_job(store, "J", [NODE])
    assert rep.own()
    clock = Clock()
    every = etcdjobs.COMPACT_EVERY * quota // etcdconf_quota() if compacting else 1 << 40
    services = [
        RendezvousService(EtcdKV(store, compact_every=every), lambda j: etcdjobs.job_allowed(store, j), clock=clock)
        for _ in range(3)
    ]
    refused = flood(services, clock, 600)
    if not compacting:
        assert refused > 0 and store.nospace
        with pytest.raises(ControlStateError) as err:
            rep.save(JobRecord("J", state=JobState.SUCCEEDED))
        assert NOSPACE in str(err.value)
        rep.release()
        return
    assert refused == 0 and not store.nospace
    assert store.db_size() < quota // 4, store.db_size()
    rep.save(JobRecord("J", state=JobState.SUCCEEDED))  # the owner's record
    store.put(b"/control/leader", b"b", lease=store.lease_grant(5))  # a leader key, with its lease
    rep.release()


def etcdconf_quota() -> int:
    from meshrun.core.etcdconf import QUOTA_BYTES

    return QUOTA_BYTES


def test_an_over_budget_job_does_not_block_the_control_plane_in_etcd():
    """Refusals at the budget touch nothing in etcd: the job's owner, another job and `allowed` (who may
    rendezvous, the record `meshrun remove` changes) are written as before."""
    store = FakeEtcd(quota=64 * 1024 * 1024)
    job = running_job(store, "J", [NODE])
    other = running_job(store, "K", [OTHER])
    clock = Clock()
    svc = RendezvousService(EtcdKV(store), lambda j: etcdjobs.job_allowed(store, j), clock=clock)
    refused = 0
    for i in range(400):
        try:
            put(svc, f"k{i % 3}", MAX_VALUE)
        except UsageError:
            refused += 1
    assert refused > 0 and not store.nospace
    put(svc, "k", 100, job="K", caller=OTHER)
    job.allow([])  # the node was removed: it is no longer one of the job's nodes
    clock.now += 1
    assert json.loads(store.get(etcdjobs.JOBS + b"J/allowed").value) == []
    other.save(JobRecord("K", state=JobState.SUCCEEDED))
