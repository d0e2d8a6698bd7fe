"""meshrun.jobs.rdzv_backend with ``coordinators=``: torch's Store and RendezvousBackend over the coordinators'
rendezvous API (meshrun.mesh.coordinator.rendezvous served over HTTP on 127.0.0.1), failing over between them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

# The Python-floor run of tests/unit (tests/unit/project/test_python_floor.py) has no torch; everything here needs it.
pytest.importorskip("torch.distributed", reason="torch is not installed (the Python 3.10 floor venv has none)")

import torch.distributed as dist  # noqa: E402
from support import rendezvous_together  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
)
from torch.distributed.elastic.utils import store as store_util  # noqa: E402

from meshrun.errors import CoordinatorError, StateError, UsageError  # noqa: E402
from meshrun.jobs import rdzv_backend  # noqa: E402
from meshrun.jobs.rdzv_backend import (  # noqa: E402
    Coordinators,
    coordinator_backend,
    coordinator_store,
    parse_coordinators,
)
from meshrun.mesh.coordinator.rendezvous import MemoryKV, RendezvousService  # noqa: E402
from meshrun.system.sockets import transport  # noqa: E402
from meshrun.system.sockets.transport import JSONServer  # noqa: E402

JOBS = ("J", "J2")


class Coordinator:
    """One coordinator's rendezvous API on 127.0.0.1: POST /v1/rdzv/<job> routed to a RendezvousService."""

    def __init__(self, kv) -> None:
        self.service = RendezvousService(kv, lambda job: {"127.0.0.1"} if job in JOBS else None)
        self.requests = 0
        self.srv = JSONServer(("127.0.0.1", 0), self.handle)
        threading.Thread(target=self.srv.serve_forever, args=(0.02,), daemon=True).start()
        self.addr = ("127.0.0.1", self.srv.server_address[1])
        self.stopped = False

    def handle(self, req: transport.Request) -> transport.Response:
        self.requests += 1
        return self.service.serve(req)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.srv.shutdown()
            self.srv.server_close()


@pytest.fixture
def kv() -> MemoryKV:
    return MemoryKV()


@pytest.fixture
def coordinators(kv):
    """Two coordinators over one shared store (as two coordinators over one etcd)."""
    pair = [Coordinator(kv), Coordinator(kv)]
    yield pair
    for c in pair:
        c.stop()


@pytest.fixture
def dead_addr() -> tuple[str, int]:
    """An address where nothing listens (connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return ("127.0.0.1", port)


class Recorder:
    """transport.call, recording which coordinator each attempt went to."""

    def __init__(self) -> None:
        self.tried: list[int] = []

    def __call__(self, host, port, *args, **kw):
        self.tried.append(port)
        return transport.call(host, port, *args, **kw)


def client(addrs, job="J", **kw) -> Coordinators:
    return Coordinators([a for a in addrs], job, **kw)


class TestStore:
    def test_every_operation_through_torchs_prefix_store(self, coordinators):
        store = coordinator_store(client([coordinators[0].addr]), timedelta(seconds=5))
        p = dist.PrefixStore("torch.rendezvous.J.0", store)
        p.set("MASTER_ADDR", "10.77.0.2")
        p.set("bin", b"\x00\xff")
        assert p.get("MASTER_ADDR") == b"10.77.0.2" and p.get("bin") == b"\x00\xff"
        assert (p.add("n", 1), p.add("n", 2)) == (1, 3)
        assert p.check(["MASTER_ADDR", "n"]) and not p.check(["MASTER_ADDR", "nope"])
        assert p.compare_set("cas", "", "a") == b"a"
        assert p.compare_set("cas", "a", "b") == b"b"
        assert p.compare_set("cas", "a", "c") == b"b"
        p.multi_set(["r/0", "r/1"], ["zero", b"one"])
        assert p.multi_get(["r/1", "r/0"]) == [b"one", b"zero"]
        p.wait(["r/0", "r/1"])
        p.wait(["r/0"], timedelta(seconds=1))
        assert p.num_keys() == 6  # through getNumKeys: PrefixStore counts the store's keys, as TCPStore's does
        assert p.delete_key("r/0") is True and p.delete_key("r/0") is False  # through deleteKey
        assert store.get("torch.rendezvous.J.0/n") == b"3"  # the prefix is part of the key at the coordinator
        p.set_timeout(timedelta(seconds=7))
        assert store.timeout == timedelta(seconds=7)

    def test_get_and_wait_wait_for_a_key_another_agent_sets(self, coordinators):
        mine = coordinator_store(client([coordinators[0].addr]), timedelta(seconds=10))
        other = coordinator_store(client([coordinators[1].addr]), timedelta(seconds=10))
        threading.Timer(0.3, other.set, args=("late", "here")).start()
        start = time.monotonic()
        assert mine.get("late") == b"here"
        assert 0.25 < time.monotonic() - start < 3
        threading.Timer(0.3, other.multi_set, args=(["a", "b"], ["1", "2"])).start()
        mine.wait(["a", "b"])
        assert mine.multi_get(["a", "b"]) == [b"1", b"2"]

    def test_a_key_not_set_in_time_raises_what_tcpstore_raises(self, coordinators):
        store = coordinator_store(client([coordinators[0].addr]), timedelta(seconds=0.3))
        p = dist.PrefixStore("pre", store)
        for wait in (lambda: p.get("never"), lambda: p.wait(["never"]), lambda: p.multi_get(["never"])):
            start = time.monotonic()
            with pytest.raises(dist.DistStoreError, match="wait timeout.*pre/never"):
                wait()
            assert time.monotonic() - start < 2
        with pytest.raises(dist.DistStoreError):
            p.wait(["never"], timedelta(milliseconds=1))

    def test_torchs_agent_helpers_synchronize_and_barrier(self, coordinators):
        # What torch's agent runs on the rendezvous store: synchronize (set, multi_get, add, wait) and the
        # exit barrier (add, set, wait), each agent with its own client, half at each coordinator.
        world = 3
        results: dict[int, list[bytes]] = {}
        errors: list[BaseException] = []

        def agent(rank: int) -> None:
            try:
                base = coordinator_store(client([coordinators[rank % 2].addr]), timedelta(seconds=20))
                store = dist.PrefixStore("torch.rendezvous.J.1", base)
                results[rank] = store_util.synchronize(store, f"agent {rank}".encode(), rank, world, "sync/")
                store_util.barrier(store, world, "torchelastic/exit", barrier_timeout=20)
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=agent, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        want = [f"agent {r}".encode() for r in range(world)]
        assert results == {r: want for r in range(world)}

    @pytest.mark.parametrize(
        "current,expected,desired",
        [(None, "", "x"), (None, "q", "x"), ("v", "v", "w"), ("v", "u", "w"), ("v", "", "w")],
    )
    def test_compare_set_does_what_torchs_hashstore_does(self, coordinators, current, expected, desired):
        ours, ref = coordinator_store(client([coordinators[0].addr]), timedelta(seconds=1)), dist.HashStore()
        for store in (ours, ref):
            if current is not None:
                store.set("k", current)
        assert ours.compare_set("k", expected, desired) == ref.compare_set("k", expected, desired)
        assert ours.check(["k"]) == ref.check(["k"])
        if ref.check(["k"]):
            assert ours.get("k") == ref.get("k")

    def test_many_keys_travel_in_parts(self, coordinators):
        recorder = Recorder()
        store = coordinator_store(client([coordinators[0].addr], call=recorder), timedelta(seconds=5))
        keys = [f"torchelastic/role_info/{i}" for i in range(600)]
        store.multi_set(keys, [str(i) for i in range(600)])
        assert len(recorder.tried) == 3  # 256 + 256 + 88
        assert store.multi_get(keys) == [str(i).encode() for i in range(600)]
        assert store.check(keys)

    def test_large_values_are_sent_one_request_each(self, coordinators):
        store = coordinator_store(client([coordinators[0].addr]), timedelta(seconds=5))
        big = [b"x" * 100_000, b"y" * 100_000]
        store.multi_set(["a", "b"], big)
        assert store.multi_get(["a", "b"]) == big


class TestBackend:
    def test_get_and_set_state_with_fencing_tokens(self, coordinators):
        backend = coordinator_backend(client([coordinators[0].addr]))
        assert backend.name == "meshrun-coordinators"
        assert backend.get_state() is None
        state, token, ok = backend.set_state(b"s1")
        assert (state, ok) == (b"s1", True)
        assert backend.set_state(b"other") == (b"s1", token, False)  # no token: only when there is no state
        state2, token2, ok2 = backend.set_state(b"s2", token)
        assert (state2, ok2) == (b"s2", True) and token2 != token
        assert backend.set_state(b"s3", token) == (b"s2", token2, False)  # stale token
        assert backend.set_state(b"s3", object()) == (b"s2", token2, False)  # not one of ours
        assert backend.get_state() == (b"s2", token2)

    def test_two_agents_racing_with_one_token_exactly_one_wins(self, coordinators):
        a = coordinator_backend(client([coordinators[0].addr]))
        b = coordinator_backend(client([coordinators[1].addr]))
        _, token, _ = a.set_state(b"s0")
        start = threading.Barrier(2)
        results = {}

        def write(name, backend):
            start.wait()
            results[name] = backend.set_state(name.encode(), token)

        threads = [threading.Thread(target=write, args=x) for x in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r[2] for r in results.values()) == [False, True]
        assert results["a"][:2] == results["b"][:2] == a.get_state()


class TestFailover:
    def test_calls_keep_working_through_the_second_coordinator_when_the_first_stops(self, coordinators):
        first, second = coordinators
        c = client([first.addr, second.addr])
        store, backend = coordinator_store(c, timedelta(seconds=5)), coordinator_backend(c)
        store.set("before", "1")
        _, token, _ = backend.set_state(b"s1")
        assert first.requests == 2 and second.requests == 0
        first.stop()
        store.set("after", "2")
        assert store.multi_get(["before", "after"]) == [b"1", b"2"]
        assert store.add("n", 5) == 5
        assert backend.set_state(b"s2", token)[0::2] == (b"s2", True)
        assert backend.get_state()[0] == b"s2"
        assert second.requests == 5

    def test_a_request_starts_at_the_coordinator_that_answered_last(self, coordinators, dead_addr):
        recorder = Recorder()
        store = coordinator_store(client([dead_addr, coordinators[0].addr], call=recorder), timedelta(seconds=5))
        store.set("k", "v")
        assert recorder.tried == [dead_addr[1], coordinators[0].addr[1]]
        store.get("k")
        assert recorder.tried[2:] == [coordinators[0].addr[1]]

    def test_a_coordinator_whose_store_is_down_passes_the_request_on(self, kv):
        class DownKV(MemoryKV):
            def get(self, key):
                raise CoordinatorError("no etcd majority answers", "wait")

        down, up = Coordinator(DownKV()), Coordinator(kv)
        try:
            store = coordinator_store(client([down.addr, up.addr]), timedelta(seconds=5))
            store.set("k", "v")
            assert store.get("k") == b"v"
            assert down.requests == 1
        finally:
            down.stop()
            up.stop()

    def test_a_refusal_is_final_and_keeps_its_class(self, coordinators):
        recorder = Recorder()
        c = client([coordinators[0].addr, coordinators[1].addr], job="ended", call=recorder)
        store = coordinator_store(c)
        p = dist.PrefixStore("pre", store)
        with pytest.raises(StateError, match="no job 'ended'") as caught:
            p.set("k", "v")
        assert caught.value.status == 404
        assert recorder.tried == [coordinators[0].addr[1]]  # the second was not asked
        with pytest.raises(RendezvousError) as err:
            coordinator_backend(c).get_state()
        assert not isinstance(err.value, RendezvousConnectionError)
        assert isinstance(err.value.__cause__, StateError)

    def test_no_coordinator_answering_gives_up_after_the_failover_timeout(self, dead_addr):
        c = client([dead_addr, dead_addr], failover_timeout=1, call_timeout=1)
        start = time.monotonic()
        with pytest.raises(CoordinatorError, match="no coordinator answered job J's rendezvous for 1 s") as caught:
            coordinator_store(c).set("k", "v")
        assert caught.value.status is None
        assert 0.9 < time.monotonic() - start < 5
        with pytest.raises(RendezvousConnectionError, match="no coordinator answered"):
            coordinator_backend(c).get_state()


class FakeCall:
    """transport.call answering from a script: per port, a list of answers or errors, in turn."""

    def __init__(self, script: dict[int, list]) -> None:
        self.script = script
        self.tried: list[int] = []

    def __call__(self, host, port, method, path, body, timeout):
        self.tried.append(port)
        assert (method, path, timeout) == ("POST", "/v1/rdzv/J", 3)
        outcome = self.script[port].pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def unreachable() -> CoordinatorError:
    return CoordinatorError("cannot reach it over TCP (Connection refused)", "check")


def answered(status: int, cls=CoordinatorError) -> Exception:
    return cls(f"HTTP {status}", "fix", status=status)


class TestCoordinators:
    def make(self, script, clock=None):
        slept: list[float] = []
        now = [0.0]

        def sleep(s):
            slept.append(s)
            now[0] += s

        call = FakeCall(script)
        c = Coordinators([("10.77.0.1", 1), ("10.77.0.5", 2)], "J", call=call, sleep=sleep, clock=lambda: now[0])
        return c, call, slept

    @pytest.mark.parametrize("status", [429, 502, 503, 504])
    def test_an_unreachable_or_busy_coordinator_passes_the_request_on(self, status):
        c, call, slept = self.make({1: [unreachable(), answered(status)], 2: [{"a": 1}, {"a": 2}]})
        assert c.request({}) == {"a": 1}
        assert c.request({}) == {"a": 2}  # starts at the second now
        assert call.tried == [1, 2, 2] and slept == []

    @pytest.mark.parametrize("status", [400, 403, 404, 500])
    def test_other_error_answers_are_final(self, status):
        c, call, _ = self.make({1: [answered(status, UsageError)], 2: []})
        with pytest.raises(UsageError) as caught:
            c.request({})
        assert caught.value.status == status and call.tried == [1]

    def test_rounds_over_every_coordinator_pause_longer_each_time_until_the_failover_timeout(self):
        c, call, slept = self.make({1: [unreachable()] * 50, 2: [unreachable()] * 50})
        with pytest.raises(CoordinatorError, match="for 60 s"):
            c.request({})
        assert slept[:5] == [0.2, 0.4, 0.8, 1.6, 2.0] and set(slept[5:-1]) == {2.0}
        assert sum(slept) == pytest.approx(60)
        assert call.tried[:4] == [1, 2, 1, 2]

    def test_a_later_round_finds_the_coordinator_that_came_back(self):
        c, call, slept = self.make({1: [unreachable(), unreachable(), {"ok": 1}], 2: [unreachable(), unreachable()]})
        assert c.request({}) == {"ok": 1}
        assert slept == [0.2, 0.4]

    def test_needs_a_coordinator_and_a_job_id(self):
        with pytest.raises(UsageError, match="no coordinator"):
            Coordinators([], "J")
        with pytest.raises(UsageError, match="not a meshrun job id"):
            Coordinators([("10.77.0.1", 1)], "a/b")


class TestConf:
    def test_parse_coordinators(self):
        assert parse_coordinators("10.77.0.1:51821+10.77.0.5:51822") == [("10.77.0.1", 51821), ("10.77.0.5", 51822)]
        assert parse_coordinators(" [fd00::1]:51821 ") == [("fd00::1", 51821)]

    @pytest.mark.parametrize("text", ["", "10.77.0.1", "10.77.0.1:", ":51821", "10.77.0.1:0", "10.77.0.1:65536", "a:b"])
    def test_parse_coordinators_refuses(self, text):
        with pytest.raises(UsageError, match="IP:PORT"):
            parse_coordinators(text)

    def test_torchruns_conf_string_carries_the_list(self):
        from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

        conf = _parse_rendezvous_config("coordinators=10.77.0.1:51821+10.77.0.5:51821,join_timeout=60")
        assert parse_coordinators(conf["coordinators"]) == [("10.77.0.1", 51821), ("10.77.0.5", 51821)]

    @pytest.mark.parametrize("key", ["read_timeout", "call_timeout", "failover_timeout"])
    def test_timeouts_must_be_positive(self, key):
        params = RendezvousParameters("meshrun", "", "J", 1, 1, coordinators="127.0.0.1:1", **{key: "0"})
        with pytest.raises(UsageError, match=key):
            rdzv_backend.coordinators_backend(params)


def params(coordinators, **conf) -> RendezvousParameters:
    conf = {"join_timeout": "20", "last_call_timeout": "1", "keep_alive_interval": "1", **conf}
    return RendezvousParameters(
        "meshrun",
        "",
        "J",
        2,
        2,
        local_addr="127.0.0.1",
        coordinators="+".join(f"{h}:{p}" for h, p in coordinators),
        **conf,
    )


def test_two_torchrun_handlers_rendezvous_at_the_coordinators(coordinators, dead_addr, monkeypatch):
    """torch's whole dynamic rendezvous (our handler, as torchrun's agent calls it) over the coordinators:
    world of two, one rank-0 agent store bound to the overlay address, its address shared through our store."""
    monkeypatch.delenv("MESHRUN_INTERFACE", raising=False)
    addrs = [dead_addr, coordinators[0].addr, coordinators[1].addr]
    handlers = [rdzv_backend.create_handler(params(addrs)) for _ in range(2)]
    assert [h.get_backend() for h in handlers] == ["meshrun", "meshrun"]
    infos, errors = rendezvous_together(handlers, 30)
    try:
        assert errors == []
        assert sorted(info.rank for info in infos.values()) == [0, 1]
        assert {info.world_size for info in infos.values()} == {2}
        boot = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos.values()}
        assert len(boot) == 1 and next(iter(boot))[0] == "127.0.0.1"
        # The agent store rank 0 serves for its workers answers there.
        rank0 = next(h for i, h in enumerate(handlers) if infos[i].rank == 0)
        assert rank0._shared_tcp_store_server.port == next(iter(boot))[1]
        assert handlers[0].num_nodes_waiting() == 0
    finally:
        for h in handlers:
            h.shutdown()
    assert handlers[0].is_closed()


# --------------------------------------------------------------------------- real torchrun agents on loopback

WORKER = """
import ctypes, os, signal, time

import torch
import torch.distributed as dist

# Workers run in sessions of their own (torch starts them so): die with this node's agent, as on a lost machine.
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
step = 0
while True:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    step += 1
    print(f"STEP node={os.environ['NODE']} world={world} rank={rank} restart={restart} step={step}", flush=True)
    if world == 1 and step >= int(os.environ["STEPS_ALONE"]):
        break
    time.sleep(0.05)
dist.destroy_process_group()
"""


class Agent:
    """One node's torchrun (`--rdzv-backend meshrun` at the coordinators), its output in a file."""

    def __init__(self, name: str, coordinators: list[Coordinator], script: Path, tmp_path: Path) -> None:
        self.name = name
        self.log = tmp_path / f"{name}.log"
        conf = "coordinators={},join_timeout=40,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1:2", "--nproc-per-node", "1",
            "--rdzv-backend", "meshrun", "--rdzv-id", "J",
            "--rdzv-conf", conf.format("+".join(f"{h}:{p}" for h, p in (c.addr for c in coordinators))),
            "--local-addr", "127.0.0.1", "--max-restarts", "3", "--monitor-interval", "0.5",
            str(script),
        ]  # fmt: skip
        drop = ("MESHRUN_INTERFACE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
        env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC_")}
        env.update(NODE=name, STEPS_ALONE="20", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def steps(self) -> list[dict]:
        return [
            dict(kv.split("=") for kv in line.split()[1:])
            for line in self.log.read_text(errors="replace").splitlines()
            if line.startswith("STEP ")
        ]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the agent (its workers follow it)
        self.proc.wait(10)


def wait_for(what: str, cond, timeout: float, agents: list[Agent]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {a.name}\n{a.log.read_text(errors='replace')[-4000:]}" for a in agents)
            pytest.fail(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


@pytest.mark.slow
def test_torchrun_survives_the_loss_of_a_coordinator_and_then_of_a_node(kv, tmp_path):
    """Two real torchrun agents rendezvous at two coordinators (one shared store): they train at world 2, keep
    training when the first coordinator stops, and when one node is killed the survivor re-rendezvouses
    (through the second coordinator only) at world 1 and finishes."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    coordinators = [Coordinator(kv), Coordinator(kv)]
    agents: list[Agent] = []
    try:
        agents = [Agent(name, coordinators, script, tmp_path) for name in ("a", "b")]
        a, b = agents

        def at_world(n: int, agent: Agent) -> list[dict]:
            return [s for s in agent.steps() if s["world"] == str(n)]

        # (a) both nodes in one world of 2
        wait_for("a world of 2", lambda: all(len(at_world(2, x)) >= 5 for x in agents), 90, agents)

        # (b) the first coordinator stops: the agents' heartbeats and num_nodes_waiting go to the second
        first, second = coordinators
        assert first.requests > 0
        first.stop()
        before = {x.name: len(x.steps()) for x in agents}
        heard = second.requests
        time.sleep(4)  # 8 monitor intervals, 4 heartbeats
        assert [x.proc.poll() for x in agents] == [None, None]
        assert all(len(x.steps()) > before[x.name] + 10 for x in agents)
        assert {x.steps()[-1]["world"] for x in agents} == {"2"}
        assert second.requests > heard

        # (c) the node whose worker is rank 0 (its agent hosts the workers' store) is lost with its workers
        lost = next(x for x in agents if at_world(2, x)[-1]["rank"] == "0")
        survivor = b if lost is a else a
        lost.kill()
        assert survivor.proc.wait(90) == 0, survivor.log.read_text(errors="replace")[-4000:]
        alone = at_world(1, survivor)
        assert alone and alone[-1]["step"] == "20" and int(alone[-1]["restart"]) >= 1
    finally:
        for x in agents:
            x.kill()
        for c in coordinators:
            c.stop()


# --------------------------------------------------------------------------- torch's rendezvous polling
def test_small_jobs_poll_the_rendezvous_faster_and_large_ones_at_torchs_pace():
    assert rdzv_backend.sync_poll_s(3) == rdzv_backend.SYNC_POLL_MIN_S
    assert rdzv_backend.sync_poll_s(50) == pytest.approx(0.5)
    assert rdzv_backend.sync_poll_s(100) == rdzv_backend.sync_poll_s(1000) == 1.0  # torch's own second
    assert rdzv_backend.sync_poll_s(0) == rdzv_backend.SYNC_POLL_MIN_S


def test_only_torchs_fixed_second_of_waiting_is_shortened_and_never_twice():
    """torch's executor waits `_delay(seconds=1)` between looks at the others' changes (SYNC) and random spans
    elsewhere: only the first becomes the poll. Patched again (a second handler in one process), the wrapper
    wraps torch's own function, not itself."""
    import types

    slept: list = []
    dr = types.SimpleNamespace(_delay=slept.append)
    assert rdzv_backend.poll_faster(dr, 0.1)
    dr._delay(1)
    dr._delay((0, 0.3))
    assert rdzv_backend.poll_faster(dr, 0.2)
    dr._delay(1)
    assert slept == [0.1, (0, 0.3), 0.2]
    assert not rdzv_backend.poll_faster(types.SimpleNamespace(), 0.1)  # another torch: nothing to change


def test_the_handler_puts_the_faster_poll_into_torchs_rendezvous(coordinators, monkeypatch):
    """What torchrun's agent gets: torch's own delay, wrapped; its one-second wait sleeps the job's poll."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous import utils

    handler = rdzv_backend.create_handler(params([c.addr for c in coordinators]))  # a job of 2 nodes
    try:
        assert dr._meshrun_original_delay is utils._delay and dr._delay is not utils._delay
        slept: list = []
        monkeypatch.setattr(utils.time, "sleep", slept.append)
        dr._delay(1)
        assert slept == [rdzv_backend.SYNC_POLL_MIN_S]
    finally:
        monkeypatch.undo()
        handler.shutdown()


def test_torchruns_agent_store_takes_a_port_of_the_stores_range_where_the_guard_judges_loopback(tmp_path, monkeypatch):
    """The agent store is bound to the overlay device, which nft's loopback lookup misses: it goes where the job
    guard refuses loopback connections of no job (the range above the network's rdzv_port), skipping a taken
    port; without a member's state, or with the range full, anywhere (an ephemeral port); where torch names a
    port, there."""
    from meshrun.core import keys
    from meshrun.core.model import STORE_PORTS, Network
    from meshrun.jobs.share import STATE_ENV
    from meshrun.system.files.statedir import StateDir

    with socket.socket() as probe:  # a base below the ephemeral ports (which `anywhere` comes from), varied per run
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1] % 10000 + 20000
    net = Network(
        "t", "10.213.0.0/16", "meshrun0", 51820, 1420, "10.213.0.1", keys.public_key(keys.generate_private_key()),
        ("192.0.2.1:51820",), "0" * 64, rdzv_port=base,
    )  # fmt: skip
    state = StateDir(tmp_path / "node")
    state.create()
    state.write_json("member.json", {"role": "node", "name": "n1", "network": net.to_dict(), "overlay_ip": "10.0.0.5"})
    monkeypatch.delenv("MESHRUN_INTERFACE", raising=False)
    monkeypatch.setenv(STATE_ENV, str(state.path))
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        first = rdzv_backend.agent_store("127.0.0.1", 0)
        second = rdzv_backend.agent_store("127.0.0.1", None)
    assert base + 1 < first.port < second.port < base + STORE_PORTS
    monkeypatch.delenv(STATE_ENV)
    anywhere = rdzv_backend.agent_store("127.0.0.1", 0)
    assert not base < anywhere.port < base + STORE_PORTS
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        named = free.getsockname()[1]
    assert rdzv_backend.agent_store("127.0.0.1", named).port == named
