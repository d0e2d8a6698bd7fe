"""meshrun.system.control.etcd and meshrun.system.control.fakeetcd: one contract (tests/etcd_contract.py), two
etcds: FakeEtcd in memory, and a real single-member etcd (/usr/bin/etcd) on 127.0.0.1 with TLS both ways, as
meshrun.core.etcdconf.server_argv configures it. Then what only the network client has: failover and its
limits, refused clients, what the server listens on, a broken watch stream, and the server process helpers.

Without /usr/bin/etcd the real-server tests skip, saying why; in CI (`CI` set) they fail instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import etcd_contract
import pytest
from realetcd import RealEtcd, free_port, issue

from meshrun.core import keys
from meshrun.errors import ControlStateError, StateError
from meshrun.system.control import etcd
from meshrun.system.control.etcd import FIX, Compare, EtcdClient, OutcomeUnknown, prefix_end
from meshrun.system.control.fakeetcd import FakeEtcd
from meshrun.system.machine import procs

# --------------------------------------------------------------------------- the fake


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_harness(name: str) -> etcd_contract.Harness:
    clock = Clock()
    fake = FakeEtcd(clock=clock, name="m1")

    def let_lease_expire(ttl: int) -> None:
        clock.now += ttl + 1
        fake.expire()

    return etcd_contract.Harness(fake, "fake", b"/c/" + name.encode() + b"/", let_lease_expire, "m1")


@pytest.mark.parametrize("case", sorted(etcd_contract.cases_for("fake")))
def test_the_fake_keeps_the_contract(case):
    etcd_contract.cases_for("fake")[case](fake_harness(case))


def test_run_all_reports_every_case_of_a_kind():
    results = etcd_contract.run_all(fake_harness, "fake")
    assert results == {name: "ok" for name in etcd_contract.cases_for("fake")}, results
    assert "failover_to_the_live_endpoint_and_stay" not in results


def test_the_fake_expires_leases_only_by_its_clock():
    clock = Clock()
    fake = FakeEtcd(clock=clock)
    lease = fake.lease_grant(10)
    fake.put(b"k", b"v", lease=lease)
    clock.now += 9
    assert fake.expire() == [] and fake.get(b"k") is not None
    assert fake.lease_keepalive(lease) == 10
    clock.now += 9.5
    assert fake.expire() == [] and fake.get(b"k") is not None, "the keep-alive renewed it"
    clock.now += 1
    assert fake.expire() == [lease] and fake.get(b"k") is None


def test_a_fake_watch_breaks_when_the_fake_goes_down():
    fake = FakeEtcd()
    stop = threading.Event()
    watch = fake.watch(b"", fake.revision() + 1, stop)  # a generator: the watch starts at the first next()
    fake.put(b"k", b"v")
    assert [e.kv.key for e in next(watch)] == [b"k"]
    fake.down = True
    with pytest.raises(ControlStateError):
        next(watch)


# --------------------------------------------------------------------------- a real etcd


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    server = RealEtcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()
    assert not procs.alive(server.pid)


@pytest.fixture(scope="module")
def black_hole():
    """A port that accepts TCP connections (the kernel's backlog) and never answers: a member that hangs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"https://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("case", sorted(etcd_contract.cases_for("real")))
def test_the_real_etcd_keeps_the_contract(case, real, black_hole):
    def let_lease_expire(ttl: int) -> None:
        time.sleep(ttl + 2)  # the leader looks for expired leases every 0.5 s, then revokes them through raft

    def failover_client():
        return real.make_client([black_hole, real.url], timeout=1.0), real.url

    prefix = f"/c/{case}/{time.monotonic_ns()}/".encode()
    h = etcd_contract.Harness(real.client, "real", prefix, let_lease_expire, "m1", failover_client)
    etcd_contract.cases_for("real")[case](h)


def test_a_client_without_a_certificate_is_refused(real):
    bare = EtcdClient([real.url], ca=real.ca_file)
    with pytest.raises(ControlStateError) as err:
        bare.get(b"k")
    assert real.url in err.value.message and "TLS" in err.value.message
    assert "client certificates" in err.value.fix, "a TLS refusal is no majority problem"


def test_a_client_certificate_from_another_ca_is_refused(real, tmp_path):
    other = keys.new_ca("someone-else")
    cert, key = issue(other, tmp_path, "intruder", "127.0.0.1")
    intruder = EtcdClient([real.url], ca=real.ca_file, cert=str(cert), key=str(key))
    with pytest.raises(ControlStateError):
        intruder.get(b"k")
    with pytest.raises(ControlStateError):
        intruder.revision()


def test_the_client_takes_a_replaced_certificate_on_its_next_connection(real, tmp_path):
    """A renewal or a CA rotation replaces the TLS files under a running coordinator: its long-lived client
    presents the new certificate from its next new connection on (etcd itself reads its own on each handshake)."""
    cert, key = issue(keys.new_ca("someone-else"), tmp_path, "renewed", "127.0.0.1")
    client = EtcdClient([real.url], ca=real.ca_file, cert=str(cert), key=str(key))
    try:
        with pytest.raises(ControlStateError):
            client.revision()
        (tmp_path / "g").mkdir()
        good_cert, good_key = issue(real.ca, tmp_path / "g", "good", "127.0.0.1")
        (tmp_path / "new.key").write_bytes(good_key.read_bytes())
        (tmp_path / "new.crt").write_bytes(good_cert.read_bytes())
        os.replace(tmp_path / "new.key", key)
        os.replace(tmp_path / "new.crt", cert)
        assert client.revision() > 0
    finally:
        client.close()


def test_a_server_certificate_from_another_ca_is_not_trusted(real, tmp_path):
    other_ca = tmp_path / "other.crt"
    other_ca.write_text(keys.new_ca("someone-else")[0])
    doubter = EtcdClient([real.url], ca=str(other_ca), cert=str(real.client_cert), key=str(real.client_key))
    with pytest.raises(ControlStateError, match="TLS"):
        doubter.get(b"k")


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on, from /proc (IPv4; IPv6 ones as their hex)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                addr, port = f[1].split(":")
                if table == "tcp":
                    addr = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
                out.add((addr, int(port, 16)))
    return out


def test_the_server_listens_only_on_its_address(real):
    assert _listening(real.pid) == {("127.0.0.1", real.client_port), ("127.0.0.1", real.peer_port)}
    for port in (real.client_port, real.peer_port):
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.2", port), timeout=2):
            pass


def test_every_member_unreachable_names_them_all():
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    client = EtcdClient(dead, timeout=1)
    with pytest.raises(ControlStateError) as err:
        client.put(b"k", b"v")
    assert all(d in err.value.message for d in dead) and err.value.fix == FIX
    assert not isinstance(err.value, OutcomeUnknown), "a refused connection sent nothing: the outcome is known"


def test_the_server_helpers_write_the_pid_into_the_cgroup_and_stop_only_it(tmp_path):
    procs_file = tmp_path / "cgroup.procs"
    procs_file.write_text("")
    log = tmp_path / "x.log"
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    pid = etcd.start_server([sys.executable, "-c", code], log, cgroup_procs=procs_file)
    try:
        assert procs_file.read_text() == str(pid), "the child writes its own pid before it execs"
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        deadline = time.monotonic() + 10
        while "up" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.getsid(pid) == pid, "etcd runs in a session of its own"
    finally:
        began = time.monotonic()
        etcd.stop_server(pid, timeout=0.5)  # it ignores SIGTERM: SIGKILL after the timeout
    assert not procs.alive(pid) and time.monotonic() - began < 5


def test_stop_server_leaves_a_pid_that_is_no_etcd_alone(tmp_path):
    """A PID read back from a file may belong to another process by now: only an etcd is signalled."""
    import subprocess

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        etcd.stop_server(other.pid, timeout=0.5)
        assert other.poll() is None, "a process that is not etcd was signalled"
    finally:
        other.kill()
        other.wait(5)
    etcd.stop_server(other.pid)  # gone: nothing happens


def test_wait_healthy_shows_the_log_when_the_server_exits(tmp_path):
    log = tmp_path / "etcd.log"
    pid = etcd.start_server([sys.executable, "-c", "print('bad flag --nope'); raise SystemExit(2)"], log)
    client = EtcdClient([f"http://127.0.0.1:{free_port()}"], timeout=0.5)
    began = time.monotonic()
    with pytest.raises(ControlStateError) as err:
        etcd.wait_healthy(client, 30, log, pid)
    assert "exited" in err.value.message and "bad flag --nope" in err.value.message
    assert time.monotonic() - began < 10
    etcd.stop_server(pid)


def test_unreadable_tls_files_name_the_file_not_its_content(tmp_path):
    cert, key = tmp_path / "c.crt", tmp_path / "c.key"
    cert.write_text(keys.new_ca("x")[0])
    key.write_text(keys.new_csr("x", "10.0.0.1")[0])  # another key than the certificate's
    with pytest.raises(StateError) as err:
        EtcdClient(["https://127.0.0.1:2379"], cert=str(cert), key=str(key))
    assert str(key) in err.value.message and "PRIVATE KEY" not in str(err.value)


# --------------------------------------------------------------------------- failover, against scripted members


class Scripted(BaseHTTPRequestHandler):
    """A member that answers as `server.mode` says: noleader, timedout, invalid, hang, or a watch that breaks."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append((self.path, self.headers.get("Grpc-Metadata-Hasleader")))
        mode = self.server.mode
        if mode == "noleader":
            self._json(503, {"error": "etcdserver: no leader", "message": "etcdserver: no leader", "code": 14})
        elif mode == "timedout":
            msg = "etcdserver: request timed out"
            self._json(503, {"error": msg, "message": msg, "code": 14})
        elif mode == "invalid":
            msg = "etcdserver: too many operations in txn request"
            self._json(400, {"error": msg, "message": msg, "code": 3})
        elif mode == "hang":
            time.sleep(3)
        elif mode in ("watch-breaks", "watch-error"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            msgs = [{"result": {"header": {"revision": "7"}, "created": True}}]
            if mode == "watch-error":
                msgs.append({"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader"}})
            for m in msgs:
                data = json.dumps(m).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.3)
            self.close_connection = True


@pytest.fixture
def scripted():
    servers = []

    def make(mode: str) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
        srv.daemon_threads = True
        srv.mode, srv.requests = mode, []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    make.servers = servers
    yield make
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_a_member_without_a_leader_is_skipped_even_for_writes(real, scripted):
    stub = scripted("noleader")
    client = real.make_client([stub, real.url])
    r = client.put(b"/failover/noleader", b"1")
    assert client.endpoint == real.url and client.get(b"/failover/noleader").mod_revision == r
    assert scripted.servers[0].requests[0] == ("/v3/kv/put", "true"), "the client asks for a member with a leader"


def test_a_write_without_an_answer_has_an_unknown_outcome(real, scripted):
    for mode in ("hang", "timedout"):
        stub, key = scripted(mode), f"/failover/{mode}".encode()
        client = real.make_client([stub, real.url], timeout=1.0)
        assert client.get(key) is None, "a read goes on to the next member"
        assert client.endpoint == real.url
        client = real.make_client([stub, real.url], timeout=1.0)
        with pytest.raises(OutcomeUnknown) as err:
            client.put(key, b"1")
        assert stub in err.value.message and "may or may not" in err.value.message
        assert real.client.get(key) is None, "the write was not sent on to the next member"
        client.put(key, b"1")  # the next call starts with the next member
        assert client.endpoint == real.url


def test_an_etcd_refusal_raises_at_once(real, scripted):
    stub = scripted("invalid")
    client = real.make_client([stub, real.url])
    with pytest.raises(ControlStateError, match="too many operations") as err:
        client.txn([], [etcd.Put(b"/x", b"1")])
    assert stub in err.value.message and real.url not in err.value.message
    assert "bug" in err.value.fix


@pytest.mark.parametrize("mode", ["watch-breaks", "watch-error"])
def test_a_broken_watch_stream_raises(scripted, mode):
    client = EtcdClient([scripted(mode)])
    stop = threading.Event()
    with pytest.raises(ControlStateError, match="watch stream"):
        for _ in client.watch(b"/x/", 1, stop):
            pass


def test_a_silent_watch_stream_counts_as_broken_with_an_idle_timeout(real):
    stop = threading.Event()
    began = time.monotonic()
    with pytest.raises(ControlStateError, match="silent"):
        for _ in real.client.watch(b"/silent/", 0, stop, idle_timeout=1.5):
            pass
    assert time.monotonic() - began < 5


# --------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    "prefix, end",
    [(b"a", b"b"), (b"/m/", b"/m0"), (b"a\xff", b"b"), (b"\xff\xff", b"\0"), (b"", b"\0"), (b"a\x00", b"a\x01")],
)
def test_prefix_end(prefix, end):
    assert prefix_end(prefix) == end


def test_a_compare_checks_its_target_op_and_value():
    Compare(b"k", "VALUE", "EQUAL", b"v")
    Compare(b"k", "MOD", "LESS", 3)
    for bad in (("MODE", "EQUAL", 1), ("MOD", "EQUALS", 1), ("VALUE", "EQUAL", 1), ("MOD", "EQUAL", b"1")):
        with pytest.raises(ValueError):
            Compare(b"k", *bad)


def test_control_state_errors_cross_the_wire_as_control_state_errors():
    from meshrun.errors import from_wire, to_wire

    for err in (ControlStateError("no majority", FIX), etcd.Compacted(7), OutcomeUnknown("no answer", FIX)):
        wire = to_wire(err)
        assert wire["kind"] == "ControlStateError", wire
        back = from_wire(wire)
        assert type(back) is ControlStateError and (back.message, back.fix) == (err.message, err.fix)
