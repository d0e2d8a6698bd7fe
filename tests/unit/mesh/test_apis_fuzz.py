"""Property-based fuzzing of meshrun's two HTTP APIs (bounded budget, no namespaces, no root).

- The coordinator's enrolment API (`EnrolmentAPI.handle`) and overlay API (`OverlayAPI.handle`) of a real
  CoordinatorService over a real SQLite state directory, on an in-memory FakeDevice, so no
  interface is touched. Requests go both straight to the handlers (as the server dispatches
  them) and over real HTTP on 127.0.0.1 through meshrun's JSONServer.
- The agent's job API (`JobAPI.handle`) with a launcher that records and runs nothing: fuzzed
  argv must never be executed.

Properties: every answer is one of the statuses an API may give (never 500), the server keeps
answering, and the coordinator database stays consistent (unique addresses inside the CIDR,
token use counts within their limits, integrity check ok).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.client
import io
import ipaddress
import json
import re
import socket
import tarfile
import time
import types
from pathlib import Path

import pytest
from fakemesh import signed_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import json_strategy

from meshrun.core import auth, keys
from meshrun.core.model import Network
from meshrun.core.token import new_token
from meshrun.errors import MeshrunError
from meshrun.jobs import nodeapi as jobs
from meshrun.mesh.coordinator.daemon import CoordinatorService
from meshrun.mesh.coordinator.enrolment import RateLimiter
from meshrun.system.control.coordinatordb import CoordinatorDB
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.fakedevice import FakeDevice
from meshrun.system.kernel.fakefirewall import FakeFirewall
from meshrun.system.sockets.transport import JSONServer, Request, Response

BUDGET = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
ALLOWED = {200, 400, 401, 403, 404, 409, 410, 413, 429}
CIDR = "10.213.0.0/16"
COORD_IP = "10.213.0.1"

json_values = json_strategy(max_text=30, max_list=4, max_key=10, max_dict=5, max_leaves=15)


def dispatch(handler, req: Request) -> Response:
    """What meshrun.system.sockets.transport's request handler does with a handler's outcome."""
    try:
        return handler(req)
    except MeshrunError as exc:
        return Response.error(400, exc)
    except Exception as exc:  # the server would answer 500: a bug
        raise AssertionError(f"{req.method} {req.path} body={req.body!r} raised {exc!r} (HTTP 500)") from exc


# --------------------------------------------------------------------------- coordinator fixture


@dataclasses.dataclass
class Coord:
    svc: CoordinatorService
    state: StateDir
    token_id: str
    secret_b64: str
    limited_id: str
    limited_b64: str
    member_ip: str
    removed_ip: str
    member_key: bytes  # the member's overlay key: what its agent signs its syncs with

    def signed(self, method: str, path: str, body: object) -> Request:
        """The member's request as its agent sends it: the body's bytes, their MAC under its overlay key."""
        return signed_request(method, path, self.member_ip, body, self.member_key)


def _make_state(path: Path) -> tuple[StateDir, dict]:
    state = StateDir(path)
    state.create()
    priv = keys.generate_private_key()
    cert, tls_key = keys.generate_tls_identity("meshrun-fuzz")
    net = Network(
        name="fuzz",
        cidr=CIDR,
        interface="meshrun0",
        listen_port=51820,
        mtu=1420,
        coordinator_ip=COORD_IP,
        coordinator_public_key=keys.public_key(priv),
        endpoints=("127.0.0.1:51820",),
        fingerprint=keys.cert_fingerprint(cert),
        api_port=51821,
    )
    state.write("private.key", priv + "\n", secret=True)
    state.write("tls.key", tls_key, secret=True)
    state.write("tls.crt", cert)
    db = CoordinatorDB.create(state / "coordinator.db")
    db.set_meta(network=json.dumps(net.to_dict()))
    db.add_coordinator("coordinator", net.coordinator_public_key, net.coordinator_ip)
    toks = {}
    for label, uses in (("open", None), ("limited", 2)):
        tok = new_token(net.name, net.endpoints, net.fingerprint, net.coordinator_public_key)
        db.add_token(tok.token_id, tok.secret, 3600, uses)
        toks[label] = tok
    db.close()
    state.write_json(
        "member.json",
        {
            "role": "coordinator",
            "name": "coordinator",
            "network": net.to_dict(),
            "overlay_ip": COORD_IP,
            "backend": "wireguard-go",
            "wg_pid": None,
        },
    )
    return state, toks


def _b64(secret: bytes) -> str:
    return base64.urlsafe_b64encode(secret).decode().rstrip("=")


@pytest.fixture
def coord(tmp_path) -> Coord:
    state, toks = _make_state(tmp_path / "coord")
    svc = CoordinatorService(state, device=FakeDevice(present=True))  # no interface, no root
    svc.overlay.max_wait = 0.01  # long-polls must not stall the fuzzer
    svc.enrolment.limiter = RateLimiter(burst=10**9)
    svc.overlay.limiter = RateLimiter(burst=10**9)
    open_tok = toks["open"]
    # One live member and one removed member to call the overlay API as.
    member_private = keys.generate_private_key()
    m, _ = svc.db.enrol(open_tok.token_id, open_tok.secret, "member", keys.public_key(member_private), [], CIDR)
    r, _ = svc.db.enrol(
        open_tok.token_id, open_tok.secret, "gone", keys.public_key(keys.generate_private_key()), [], CIDR
    )
    svc.db.remove_member("gone")
    svc.tick()  # what the loop does after joins and removals: publish
    yield Coord(
        svc,
        state,
        open_tok.token_id,
        _b64(open_tok.secret),
        toks["limited"].token_id,
        _b64(toks["limited"].secret),
        m.overlay_ip,
        r.overlay_ip,
        svc.overlay_keys(m.public_key),
    )
    svc.db.close()


def check_db(c: Coord) -> None:
    db = c.svc.db
    assert db.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = db.conn.execute("SELECT name, public_key, overlay_ip, removed_at, is_coordinator FROM members").fetchall()
    ips = [r[2] for r in rows]
    assert len(ips) == len(set(ips)), "an overlay address was handed out twice"
    net = ipaddress.ip_network(CIDR)
    assert all(ipaddress.ip_address(ip) in net for ip in ips)
    active = [r for r in rows if r[3] is None]
    assert len({r[0] for r in active}) == len(active), "two active members share a name"
    assert len({r[1] for r in rows}) == len(rows), "two members share a key"
    assert sum(r[4] for r in active) == 1 and db.member_by_ip(COORD_IP).is_coordinator
    assert all(keys.is_public_key(r[1]) for r in rows)
    for t in db.tokens():
        assert t.max_uses is None or t.uses <= t.max_uses
    used = dict(
        db.conn.execute(
            "SELECT token_id, COUNT(*) FROM members WHERE token_id IS NOT NULL GROUP BY token_id"
        ).fetchall()
    )
    for t in db.tokens():
        assert t.uses <= used.get(t.id, 0), "a token counted a use without a member"


# --------------------------------------------------------------------------- strategies

names = st.one_of(st.from_regex(r"\A[a-z0-9][a-z0-9-]{0,8}\Z"), st.text(max_size=40), json_values)
pubkeys = st.one_of(
    st.builds(lambda: keys.public_key(keys.generate_private_key())),
    st.just("j0DFrbaPJWJK5bIU6nZ6bslNgp09e14a0bpvPiE4KF8="),
    st.text(max_size=50),
    json_values,
)
endpoints = st.one_of(st.just("198.51.100.7:51820"), st.just("[2001:db8::1]:51820"), st.text(max_size=30), json_values)


def proof(priv: str, c: Coord, name: str, token_id: str, pub: str | None = None) -> dict:
    """What a joining node sends to show it holds `priv` (with `pub`: a forgery for another key)."""
    coord_pub = c.svc.network.coordinator_public_key
    return auth.enrol_proof(
        keys.shared_secret(priv, coord_pub), "fuzz", name, pub or keys.public_key(priv), token_id, time.time()
    )


@st.composite
def join_bodies(draw, c: Coord):
    which = draw(st.sampled_from(["open", "limited", "unknown", "fuzz"]))
    tid, sec = {
        "open": (c.token_id, c.secret_b64),
        "limited": (c.limited_id, c.limited_b64),
        "unknown": ("zzzzzzzzzz", c.secret_b64),
        "fuzz": (draw(json_values), draw(json_values)),
    }[which]
    if draw(st.booleans()) and which != "fuzz":
        sec = draw(st.sampled_from([sec[:-1], sec + "A", "", "!!!", "é" * 3, sec.upper()]))
    name = draw(names)
    priv = keys.generate_private_key() if draw(st.integers(0, 3)) else None
    pub = keys.public_key(priv) if priv else draw(pubkeys)
    body = {
        "token_id": tid,
        "secret": sec,
        "name": name,
        "public_key": pub,
        "network": draw(st.sampled_from(["fuzz", "other", "", "FUZZ"]) | json_values),
        "candidates": draw(st.lists(endpoints, max_size=4) | json_values),
    }
    if priv and isinstance(name, str) and isinstance(tid, str):
        body["possession"] = draw(
            st.sampled_from([proof(priv, c, name, tid), proof(keys.generate_private_key(), c, name, tid, pub), None])
            | json_values
        )
    for k in draw(st.lists(st.sampled_from(sorted(body)), max_size=2)):
        body.pop(k, None)
    return draw(st.one_of(st.just(body), json_values)) if draw(st.integers(0, 9)) == 0 else body


paths = st.one_of(
    st.sampled_from(
        [
            "/v1/join",
            "/v1/hello",
            "/v1/sync",
            "/v1/members",
            "/",
            "/v1/join/",
            "/v1/sync?x=1",
            "//v1/sync",
            "/v1/../v1/sync",
        ]
    ),
    st.text(max_size=40),
)
methods = st.sampled_from(["GET", "POST", "DELETE", "PUT", "HEAD", "get", ""])


# --------------------------------------------------------------------------- coordinator: handler level


@BUDGET
@given(data=st.data())
def test_enrolment_api_handler(coord, data):
    body = data.draw(join_bodies(coord))
    req = Request(
        data.draw(st.sampled_from(["POST", "POST", "POST", "GET"]) | methods),
        data.draw(st.sampled_from(["/v1/join"] * 4) | paths),
        data.draw(st.sampled_from(["203.0.113.5", "203.0.113.6", "::1"])),
        body,
    )
    resp = dispatch(coord.svc.enrolment.handle, req)
    assert resp.status in ALLOWED
    if resp.status == 200 and req.path == "/v1/join":
        me = resp.body["member"]
        assert ipaddress.ip_address(me["overlay_ip"]) in ipaddress.ip_network(CIDR)
        text = json.dumps(resp.body)
        assert coord.secret_b64 not in text and coord.limited_b64 not in text
    else:
        assert set(resp.body or {}) <= {"error", "fix", "kind", "network"}
    check_db(coord)


sync_bodies = (
    st.fixed_dictionaries(
        {},
        optional={
            "version": st.integers(-5, 10**30) | json_values,
            "wait": st.floats(allow_nan=True) | json_values,
            "candidates": st.lists(endpoints, max_size=3) | json_values,
            "peers": json_values,
        },
    )
    | json_values
)


@BUDGET
@given(data=st.data())
def test_overlay_api_handler(coord, data):
    caller = data.draw(
        st.sampled_from(
            [coord.member_ip, coord.member_ip, coord.removed_ip, "10.213.9.9", COORD_IP, "203.0.113.5", "not an ip"]
        )
    )
    method = data.draw(st.sampled_from(["POST", "GET"]) | methods)
    path = data.draw(st.sampled_from(["/v1/sync", "/v1/members"]) | paths)
    body = data.draw(sync_bodies)
    # The member's requests signed as its agent signs them (the parser behind the signature is what is fuzzed),
    # or not at all (refused before the body is read).
    if caller == coord.member_ip and data.draw(st.booleans()):
        req = coord.signed(method, path, body)
    else:
        req = Request(method, path, caller, body)
    resp = dispatch(coord.svc.overlay.handle, req)
    assert resp.status in ALLOWED
    if caller == coord.removed_ip:
        assert resp.status == 410
    elif caller not in (coord.member_ip, COORD_IP):
        assert resp.status == 403
    check_db(coord)


def test_overlay_api_refuses_non_members(coord):
    for ip in ("10.213.77.77", "203.0.113.5", "127.0.0.1"):
        assert coord.svc.overlay.handle(Request("POST", "/v1/sync", ip, {})).status == 403
    assert coord.svc.overlay.handle(Request("POST", "/v1/sync", coord.removed_ip, {})).status == 410
    unsigned = coord.svc.overlay.handle(Request("POST", "/v1/sync", coord.member_ip, {"version": -1}))
    assert unsigned.status == 403  # a member's address alone: any user on that machine has it
    ok = coord.svc.overlay.handle(coord.signed("POST", "/v1/sync", {"version": -1}))
    assert ok.status == 200 and {m["overlay_ip"] for m in ok.body["members"]} == {COORD_IP, coord.member_ip}


def test_enrolment_port_does_not_serve_overlay_routes(coord):
    for method, path in (("POST", "/v1/sync"), ("GET", "/v1/members")):
        assert coord.svc.enrolment.handle(Request(method, path, coord.member_ip, {})).status == 404


def test_used_up_token_refused_and_counted_once(coord):
    def join(name):
        priv = keys.generate_private_key()
        return dispatch(
            coord.svc.enrolment.handle,
            Request(
                "POST",
                "/v1/join",
                "203.0.113.9",
                {
                    "token_id": coord.limited_id,
                    "secret": coord.limited_b64,
                    "name": name,
                    "network": "fuzz",
                    "public_key": keys.public_key(priv),
                    "possession": proof(priv, coord, name, coord.limited_id),
                },
            ),
        )

    assert [join(n).status for n in ("l1", "l2", "l3")] == [200, 200, 400]
    assert "used up" in join("l4").body["error"]
    check_db(coord)


# --------------------------------------------------------------------------- coordinator: HTTP level


@contextlib.contextmanager
def serve(handler, max_body: int = 256 * 1024):
    srv = JSONServer(("127.0.0.1", 0), handler, max_body=max_body)
    t = srv.start("fuzz")
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def raw_request(port: int, data: bytes) -> int | None:
    """Send raw bytes; the HTTP status of the answer, or None if the server closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    if not buf:
        return None
    if not buf.startswith(b"HTTP/"):
        # http.server answers a request line it cannot parse HTTP/0.9-style: a bare error page.
        m = re.search(rb"Error code: (\d+)", buf)
        assert m, buf[:200]
        return int(m.group(1))
    return int(buf.split(b"\r\n", 1)[0].split()[1])


def http_request(
    port: int, method: str, path: str, body: bytes, ctype: str = "application/json", key: bytes | None = None
) -> int:
    """The status of one request to 127.0.0.1:`port`, signed with `key` if given (as meshrun's transport does)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": ctype}
    if key is not None:
        headers["Authorization"] = auth.sign(key, method, path, body, time.time())
    try:
        conn.request(method, path, body=body, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def _json_bytes(value) -> bytes:
    # allow_nan: Python's json.loads on the server accepts NaN/Infinity, so clients can send them.
    return json.dumps(value, allow_nan=True).encode()


@pytest.fixture
def servers(coord):
    """The enrolment handler and the overlay handler (called as a member) on loopback HTTP."""
    as_member = lambda req: coord.svc.overlay.handle(dataclasses.replace(req, client_ip=coord.member_ip))  # noqa: E731
    with serve(coord.svc.enrolment.handle) as public, serve(as_member) as overlay:
        yield {"public": public, "overlay": overlay}


@settings(BUDGET, max_examples=150)
@given(data=st.data())
def test_both_coordinator_apis_over_http(coord, servers, data):
    which = data.draw(st.sampled_from(["public", "overlay"]))
    port = servers[which]
    kind = data.draw(st.sampled_from(["json", "json", "bytes", "raw"]))
    if kind == "raw":
        raw = data.draw(
            st.one_of(
                st.binary(max_size=300),
                st.builds(
                    lambda m, p, h, b: m + b" " + p + b" HTTP/1.1\r\n" + h + b"\r\n\r\n" + b,
                    st.sampled_from([b"POST", b"GET", b"X"]),
                    st.sampled_from([b"/v1/join", b"/v1/sync", b"/"]),
                    st.sampled_from(
                        [
                            b"Content-Length: 5",
                            b"Content-Length: -1",
                            b"Content-Length: 99999999",
                            b"Content-Length: \xb2",
                            b"Content-Type: application/json",
                            b"Content-Length: 1e3",
                            b"",
                        ]
                    ),
                    st.binary(max_size=50),
                ),
            )
        )
        status = raw_request(port, raw)
        assert status is None or status in ALLOWED | {501, 505}, status  # 501/505: http.server's own
    else:
        method = data.draw(st.sampled_from(["POST", "GET", "DELETE"]))
        path = data.draw(st.sampled_from(["/v1/join", "/v1/sync", "/v1/members", "/v1/hello"]))
        if kind == "json":
            body = _json_bytes(data.draw(join_bodies(coord) if which == "public" else sync_bodies))
        else:
            body = data.draw(st.binary(max_size=200))
        status = http_request(port, method, path, body)
        assert status in ALLOWED, f"{method} {path} {body[:200]!r} -> {status}"
    # The server still answers after whatever it was sent.
    assert http_request(port, "GET", "/v1/hello", b"") in (200, 403, 404)
    check_db(coord)


@pytest.mark.parametrize(
    "body",
    [
        b'{"version": Infinity}',
        b'{"version": NaN}',
        b'{"wait": NaN}',
        b'{"wait": Infinity}',
        b'{"version": 1e400}',
        b'{"version": "1e3"}',
    ],
)
def test_sync_non_finite_numbers_are_a_400_not_a_500(coord, body):
    """Python's json accepts NaN/Infinity: a member's sync must not crash the handler with them."""
    as_member = lambda req: coord.svc.overlay.handle(dataclasses.replace(req, client_ip=coord.member_ip))  # noqa: E731
    with serve(as_member) as port:
        assert http_request(port, "POST", "/v1/sync", body, key=coord.member_key) in {200, 400}


# --------------------------------------------------------------------------- agent job API

JOB_KEY = bytes(range(32))


class FakeStart:
    """Stands in for meshrun.jobs.share.start_share: records the request, never runs anything."""

    def __init__(self):
        self.started: list = []

    def __call__(self, job_dir, node, argv, env, cwd, state=None, project=None, guard=None):
        self.started.append((Path(job_dir.path), list(argv), dict(env), cwd))
        return 4242


@pytest.fixture
def job_server(tmp_path):
    state = tmp_path / "node-state"
    state.mkdir()
    network = types.SimpleNamespace(coordinator_ip=COORD_IP, api_port=51821, interface="meshrun0")
    api = jobs.JobAPI(StateDir(state), network, "dc2-a", JOB_KEY, start=FakeStart(), guards=FakeFirewall())
    api.state_path = state
    return api


def signed(method: str, path: str, caller: str, body=None, raw: bytes = b"", key: bytes = JOB_KEY) -> Request:
    """A request as `meshrun train` sends it: the body's bytes under a MAC of `key`."""
    data = raw if raw else (json.dumps(body).encode() if body is not None else b"")
    return Request(method, path, caller, body, data, {"Authorization": auth.sign(key, method, path, data, time.time())})


def _tar(members: list[tuple[str, bytes, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, data.decode()
                tar.addfile(info)
            elif kind == "hard":
                info.type, info.linkname = tarfile.LNKTYPE, data.decode()
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _inside(path: Path, root: Path) -> bool:
    return path.resolve() == root.resolve() or root.resolve() in path.resolve().parents


job_ids = st.one_of(
    st.from_regex(r"\A[A-Za-z0-9_.-]{1,12}\Z"),
    st.sampled_from([".", "..", "...", "a/b", "%2e%2e"]),
    st.text(max_size=20),
)
tar_names = st.sampled_from(
    ["train.py", "pkg/mod.py", "../escape.py", "/etc/evil", "a/../../up.py", "./ok.py", "x" * 200, "dev"]
)


@BUDGET
@given(data=st.data())
def test_job_api_handler(job_server, data):
    caller = data.draw(st.sampled_from([COORD_IP, COORD_IP, COORD_IP, "10.213.0.3", "203.0.113.5"]))
    job_id = data.draw(job_ids)
    action = data.draw(st.sampled_from(["code", "start", "output", "cancel", "allow", "other"]))
    path = data.draw(st.sampled_from([f"/v1/jobs/{job_id}/{action}", "/v1/health"]) | paths)
    method = data.draw(st.sampled_from(["POST", "POST", "GET"]) | methods)
    raw, body = b"", None
    if action == "code":
        raw = data.draw(
            st.one_of(
                st.binary(max_size=200),
                st.builds(
                    _tar,
                    st.lists(
                        st.tuples(
                            tar_names,
                            st.sampled_from([b"print(1)", b"/etc/passwd", b"../../x"]),
                            st.sampled_from(["file", "file", "sym", "hard"]),
                        ),
                        max_size=4,
                    ),
                ),
            )
        )
    else:
        body = data.draw(
            st.one_of(
                json_values,
                st.fixed_dictionaries(
                    {"argv": st.lists(st.text(max_size=10), max_size=3) | json_values},
                    optional={
                        "allow": st.lists(st.sampled_from(["10.213.0.2", "10.213.0.3", "fd00::1", "x"]), max_size=3)
                        | json_values,
                        "ips": st.lists(st.sampled_from(["10.213.0.4", "not an ip"]), max_size=2) | json_values,
                        "env": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3) | json_values,
                        "cwd": st.sampled_from([None, "", "/nonexistent-dir", "/tmp", "a\x00b"]) | json_values,
                        "offset": st.integers(-5, 10**30) | json_values,
                        "wait": st.floats() | json_values,
                    },
                ),
            )
        )
    key = data.draw(st.sampled_from(["right", "right", "right", "wrong", "none"]))
    if key == "none":
        req = Request(
            method, path, caller, body, raw if raw else (json.dumps(body).encode() if body is not None else b"")
        )
    else:
        req = signed(method, path, caller, body, raw, JOB_KEY if key == "right" else bytes(32))
    before = set(job_server.state_path.rglob("*"))
    starts = len(job_server.start.started)
    resp = dispatch(job_server.handle, req)
    assert resp.status in ALLOWED
    if caller != COORD_IP:
        assert resp.status == 403
    elif key != "right":
        assert resp.status == 401
    # Nothing is ever written outside the jobs and projects directories, and nothing without a valid MAC.
    root = job_server.state_path
    after = set(root.rglob("*"))
    for p in after - before:
        assert key == "right" and (_inside(p, root / "jobs") or _inside(p, root / "projects")), (
            f"{p} written outside {root / 'jobs'} and {root / 'projects'}"
        )
    for job_dir, argv, env, cwd in job_server.start.started:
        assert _inside(job_dir, root / "jobs") and job_dir != (root / "jobs").resolve(), job_dir
    if key != "right":
        assert len(job_server.start.started) == starts, "a share started without a valid MAC"


@pytest.mark.parametrize("job_id", [".", ".."])
def test_job_ids_cannot_name_the_jobs_dir_or_its_parent(job_server, job_id):
    """POST /v1/jobs/../code must not unpack (and first rmtree!) <state>/code outside jobs/."""
    blob = _tar([("train.py", b"print(1)", "file")])
    resp = dispatch(job_server.handle, signed("POST", f"/v1/jobs/{job_id}/code", COORD_IP, raw=blob))
    assert resp.status == 400
    root = job_server.state_path
    assert not (root / "code").exists() and not (root / "jobs" / "code").exists()


def test_a_failed_join_gives_its_name_back_only_with_its_key(coord):
    """A node whose join failed after enrolment releases the name at once; nobody else can release it."""
    priv = keys.generate_private_key()
    pub = keys.public_key(priv)
    body = {
        "token_id": coord.token_id,
        "secret": coord.secret_b64,
        "name": "flaky",
        "network": "fuzz",
        "public_key": pub,
        "possession": proof(priv, coord, "flaky", coord.token_id),
    }
    assert dispatch(coord.svc.enrolment.handle, Request("POST", "/v1/join", "203.0.113.9", body)).status == 200

    def abandon(signer: str) -> Response:
        return dispatch(
            coord.svc.enrolment.handle,
            Request(
                "POST",
                "/v1/join/abandon",
                "203.0.113.9",
                {
                    "name": "flaky",
                    "public_key": pub,
                    "token_id": coord.token_id,
                    "possession": proof(signer, coord, "flaky", f"abandon:{coord.token_id}", pub),
                },
            ),
        )

    assert abandon(keys.generate_private_key()).status == 401  # a squatter cannot free it
    assert coord.svc.db.member_by_name("flaky") is not None
    resp = abandon(priv)
    assert resp.status == 200 and resp.body == {"released": True}
    assert coord.svc.db.member_by_name("flaky") is None
    check_db(coord)


def test_only_a_keys_holder_learns_whether_it_was_removed(coord):
    """POST /v1/membership: a coordinator taken out while it was away asks this before it starts its etcd
    member again. Removed for the removed key's holder, not for a member's or a stranger's, 401 for a proof made
    with another key (nobody learns about a key they do not hold)."""
    from meshrun.mesh.coordinator.enrolment import MEMBERSHIP_PATH, MEMBERSHIP_PURPOSE

    def ask(priv: str, signer: str | None = None) -> Response:
        pub = keys.public_key(priv)
        body = {
            "name": "leaver",
            "public_key": pub,
            "possession": proof(signer or priv, coord, "leaver", MEMBERSHIP_PURPOSE, pub),
        }
        return dispatch(coord.svc.enrolment.handle, Request("POST", MEMBERSHIP_PATH, "203.0.113.9", body))

    priv = keys.generate_private_key()
    body = {
        "token_id": coord.token_id,
        "secret": coord.secret_b64,
        "name": "leaver",
        "network": "fuzz",
        "public_key": keys.public_key(priv),
        "possession": proof(priv, coord, "leaver", coord.token_id),
    }
    assert dispatch(coord.svc.enrolment.handle, Request("POST", "/v1/join", "203.0.113.9", body)).status == 200
    assert ask(priv).body == {"removed": False}  # a member
    coord.svc.db.remove_member("leaver")
    assert ask(priv).body == {"removed": True}
    assert ask(keys.generate_private_key()).body == {"removed": False}  # a stranger's own key
    assert ask(priv, signer=keys.generate_private_key()).status == 401  # about a key it does not hold
    check_db(coord)


def test_the_job_server_accepts_connections_from_the_coordinator_only(job_server, monkeypatch):
    """A member's connections to a node's job API are closed as they are accepted (no thread, no byte read):
    however many it holds, the coordinator's requests are served."""

    class LoopbackServer(JSONServer):  # the real server, on loopback instead of the WireGuard device
        def __init__(self, addr, handler, device=None, **kw):
            super().__init__(("127.0.0.1", 0), handler, None, **kw)

    monkeypatch.setattr(jobs, "JSONServer", LoopbackServer)
    job_server.network.coordinator_ip = "127.0.0.2"
    server = jobs.JobServer(job_server, "127.0.0.1")
    port = server.server.server_address[1]
    member = []
    try:
        for _ in range(jobs.MAX_CONNS + 10):  # more than the job API's every slot
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /v1/health HTTP/1.0\r\n")  # and a head that never ends
            member.append(s)
        for s in member:
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(64) == b""  # closed, unanswered
        assert server.server.filtered == jobs.MAX_CONNS + 10 and server.server.active == 0
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
            s.settimeout(5)
            s.connect(("127.0.0.1", port))
            header = auth.sign(JOB_KEY, "GET", "/v1/health", b"", time.time())
            s.sendall(f"GET /v1/health HTTP/1.0\r\nAuthorization: {header}\r\n\r\n".encode())
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 200") and b'"name": "dc2-a"' in reply
    finally:
        for s in member:
            s.close()
        server.close()


def test_a_join_for_another_network_learns_nothing_of_this_one(coord):
    """A well-formed join without a valid token: the answer names what the caller sent, never this network."""
    priv = keys.generate_private_key()
    body = {
        "token_id": "tok0000000",
        "secret": coord.secret_b64,
        "name": "scanner",
        "network": "guess",
        "public_key": keys.public_key(priv),
        "candidates": [],
    }
    resp = dispatch(coord.svc.enrolment.handle, Request("POST", "/v1/join", "203.0.113.9", body))
    assert resp.status == 403 and resp.body["kind"] == "TokenError", resp.body
    assert resp.body["error"] == "this token is for network 'guess', which this coordinator does not run"
    assert resp.body["fix"] == "use a token created on this coordinator (`meshrun token create` there)"
    assert "fuzz" not in json.dumps(resp.body)  # the network's name
