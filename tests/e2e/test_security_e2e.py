"""End-to-end security: refused joins leave nothing behind, secrets stay secret, removed nodes are cut off,
the overlay API is reachable only through WireGuard.

Real meshrun (init/join/remove, wireguard-go) in NAT'd network namespaces (meshrun.lab.testbed).
"""

from __future__ import annotations

import base64
import json
import re
import stat
import time
from pathlib import Path

import pytest
from support import hang_guard

from meshrun.core.token import JoinToken, parse_token
from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import World
from meshrun.mesh import member
from meshrun.system.files.statedir import StateDir

ERROR_PREFIX = "meshrun: error:"

REMOVAL_S = 5  # a removed member's key is gone from every member (a long-poll answers at once)


def _b64(secret: bytes) -> str:
    return base64.urlsafe_b64encode(secret).decode().rstrip("=")


def _secret_forms(token: str) -> list[str]:
    """Every spelling of a token's secret that could leak: the token itself and the secret."""
    tok = parse_token(token)
    return [token, _b64(tok.secret), base64.b64encode(tok.secret).decode().rstrip("="), tok.secret.hex()]


def _node_processes(world: World, node) -> list[str]:
    """Command lines of the processes in the node's network namespace, the testbed's anchor left out."""
    out = []
    for p in _pids(node.netns):
        if p == node.anchor_pid:
            continue
        try:
            out.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


def _pids(netns: str) -> list[int]:
    import subprocess

    res = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


# --------------------------------------------------------------------------- refused joins


@pytest.fixture(scope="module")
def refusal_world(tmp_path_factory):
    """One world shared by the refused-join cases (building one per case would cost ~10 s each):
    dc1-a is the coordinator, dc2-a a node that joins normally, dc3-a tries the bad tokens."""
    from support import unique_prefix

    prefix = unique_prefix()
    world = World.standard(3, prefix=prefix, workdir=tmp_path_factory.mktemp(prefix)).up()
    try:
        mesh = Mesh(world, "dc1-a")
        mesh.init()
        mesh.tokens = [mesh.token]  # every token made in this world, for the secret checks
        yield world, mesh
    finally:
        world.down()


def _create_token(mesh: Mesh, *args: str) -> str:
    tok = mesh.meshrun("dc1-a", "token", "create", *args).stdout.strip().splitlines()[-1]
    mesh.tokens.append(tok)
    return tok


def _token_id(tok: str) -> str:
    return parse_token(tok).token_id


def _bad_garbage(mesh):
    return "this-is-not-a-token", "not a meshrun join token"


def _bad_truncated(mesh):
    tok = _create_token(mesh)
    return tok[: len(tok) * 2 // 3], "garbled"


def _bad_expired(mesh):
    tok = _create_token(mesh, "--ttl", "1s")
    time.sleep(2)
    return tok, "expired"


def _bad_revoked(mesh):
    tok = _create_token(mesh)
    out = mesh.meshrun("dc1-a", "token", "revoke", _token_id(tok)).stdout
    assert _token_id(tok) in out
    return tok, "revoked"


def _bad_used_up(mesh):
    tok = _create_token(mesh, "--uses", "1")
    assert "joined" in mesh.join("dc2-a", token=tok).stdout
    return tok, "used up"


def _bad_fingerprint(mesh):
    t = parse_token(_create_token(mesh))
    other = "0" * 64 if t.fingerprint != "0" * 64 else "1" * 64
    return JoinToken(t.network, t.endpoints, other, t.token_id, t.secret, t.coordinator_key).encode(), "fingerprint"


def _bad_network(mesh):
    t = parse_token(_create_token(mesh))
    return JoinToken(
        "othernet", t.endpoints, t.fingerprint, t.token_id, t.secret, t.coordinator_key
    ).encode(), "othernet"


def _bad_token_id(mesh):
    t = parse_token(_create_token(mesh))
    return JoinToken(
        t.network, t.endpoints, t.fingerprint, "zz00zz00zz", t.secret, t.coordinator_key
    ).encode(), "does not know"


BAD = {
    "garbage": _bad_garbage,
    "truncated": _bad_truncated,
    "expired": _bad_expired,
    "revoked": _bad_revoked,
    "used-up": _bad_used_up,
    "wrong-fingerprint": _bad_fingerprint,
    "unknown-network": _bad_network,
    "unknown-token-id": _bad_token_id,
}


@pytest.mark.parametrize("case", list(BAD))
def test_refused_join_leaves_nothing_behind(refusal_world, case):
    world, mesh = refusal_world
    node = world.node("dc3-a")
    token, reason = BAD[case](mesh)
    t0 = time.monotonic()
    res = mesh.meshrun(node, "join", token, "--name", "dc3-a", check=False, timeout=60)
    took = time.monotonic() - t0
    assert res.returncode != 0, res.stdout
    assert took < hang_guard(5), f"refusal took {took:.1f} s"  # one TLS round trip: at once
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    assert reason in lines[0], lines[0]
    # "MESSAGE; FIX": the fix is part of the one line.
    assert "; " in lines[0] and len(lines[0].split("; ", 1)[1]) > 10, lines[0]
    if token.startswith("mr1.") and case != "truncated":
        for secret in _secret_forms(token):
            assert secret not in res.stdout and secret not in res.stderr
    assert token not in res.stderr and token not in res.stdout
    # Nothing left on the node: no interface, no daemon or wireguard-go, no state.
    assert node.run("ip", "link", "show", "meshrun0", check=False).returncode != 0
    procs = _node_processes(world, node)
    assert not [p for p in procs if "meshrun" in p or "wireguard" in p], procs
    assert not mesh.state_dir(node).exists()


def test_token_list_shows_metadata_never_secrets(refusal_world):
    world, mesh = refusal_world
    _create_token(mesh, "--uses", "3", "--ttl", "2h")
    res = mesh.meshrun("dc1-a", "token", "list", "--json")
    data = json.loads(res.stdout)
    assert data and all({"id", "uses", "expires_at", "status", "max_uses", "uses_left"} <= set(t) for t in data)
    assert {"secret", "secret_hash", "hash"}.isdisjoint({k for t in data for k in t})
    assert {t["id"] for t in data} >= {_token_id(x) for x in mesh.tokens if x.startswith("mr1.")}
    text = mesh.meshrun("dc1-a", "token", "list").stdout
    header = text.splitlines()[0]
    for col in ("ID", "STATUS", "USES", "EXPIRES"):
        assert col in header
    for tok in mesh.tokens:
        t = parse_token(tok)
        assert re.search(rf"^{t.token_id}\s+\S+", text, re.M), text
        for secret in _secret_forms(tok):
            assert secret not in res.stdout and secret not in text
    statuses = {t["id"]: t["status"] for t in data}
    assert "valid" in statuses.values()


def _walk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


SECRET_FILES = re.compile(r"^(private\.key|tls\.key|job\.key|.*\.conf)$")
DB_FILES = re.compile(r"^coordinator\.db(-wal|-shm)?$")


def test_no_secret_in_logs_status_or_errors_and_modes(refusal_world):
    world, mesh = refusal_world
    tok = _create_token(mesh, "--uses", "2")
    joined = []
    for name in ("dc2-a", "dc3-a"):
        if not (mesh.state_dir(world.node(name)) / "member.json").exists():
            mesh.join(name, token=tok)
        joined.append(name)
    # A join that fails after the token was accepted (name taken) must not print the secret either.
    other = world.node("dc3-a").workdir / "other-state"
    bad = world.node("dc3-a").run(
        mesh.python, "-m", "meshrun", "join", tok, "--name", "dc2-a", "--state-dir", str(other), check=False, timeout=60
    )
    assert bad.returncode != 0 and bad.stderr.startswith(ERROR_PREFIX) and not other.exists(), bad.stderr
    members = ["dc1-a", *joined]
    for n in joined:
        mesh.wait_ping(n, mesh.overlay_ip("dc1-a"), timeout=30)
    outputs = {"join error": bad.stdout + bad.stderr}
    for n in members:
        outputs[f"{n} status --json"] = mesh.meshrun(n, "status", "--json").stdout
        outputs[f"{n} status"] = mesh.meshrun(n, "status").stdout
    outputs["token list"] = mesh.meshrun("dc1-a", "token", "list", "--json").stdout
    outputs["token list text"] = mesh.meshrun("dc1-a", "token", "list").stdout

    private_keys = {n: (mesh.state_dir(world.node(n)) / "private.key").read_text().strip() for n in members}
    coord_pub = parse_token(tok).coordinator_key
    for n in joined:  # the job keys, derived on both sides, never stored and never printed
        key = member.job_key(StateDir(mesh.state_dir(world.node(n))), coord_pub)
        private_keys[f"{n} job key"] = base64.b64encode(key).decode()
        assert not (mesh.state_dir(world.node(n)) / "job.key").exists()
    tls_key = (mesh.state_dir(world.node("dc1-a")) / "tls.key").read_text()
    tls_body = "".join(tls_key.strip().splitlines()[1:-1])[:60]
    token_secrets = [s for t in mesh.tokens if t.startswith("mr1.") for s in _secret_forms(t)]

    for what, text in outputs.items():
        for n, key in private_keys.items():
            assert key not in text, f"{n}'s private key in {what}"
        assert tls_body not in text, f"TLS key in {what}"
        for s in token_secrets:
            assert s not in text, f"a token secret in {what}"

    for n in members:
        sd = mesh.state_dir(world.node(n))
        assert stat.S_IMODE(sd.stat().st_mode) == 0o700, f"{sd} is not 0700"
        for f in _walk_files(sd):
            mode = stat.S_IMODE(f.stat().st_mode)
            data = f.read_bytes()
            if SECRET_FILES.match(f.name) or DB_FILES.match(f.name):
                assert mode == 0o600, f"{f} has mode {oct(mode)}, want 0o600"
            if f.name.startswith("daemon."):
                assert mode == 0o600, f"{f} has mode {oct(mode)}"
            for s in token_secrets:  # the coordinator keeps only a hash; nobody writes the secret down
                assert s.encode() not in data, f"a token secret in {f}"
            if SECRET_FILES.match(f.name):
                continue
            for owner, key in private_keys.items():
                assert key.encode() not in data, f"{owner}'s private key in {f}"
            assert tls_body.encode() not in data, f"the TLS key in {f}"
        for sub in (p for p in sd.rglob("*") if p.is_dir()):
            assert not stat.S_IMODE(sub.stat().st_mode) & 0o077, f"{sub} is open to others"


# --------------------------------------------------------------------------- removal and the overlay API

PROBE = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=float(sys.argv[3])).close()
except OSError as exc:
    print("refused", exc)
    sys.exit(1)
print("connected")
"""

CALL = """
import json, sys
from meshrun.system.sockets import transport
from meshrun.errors import MeshrunError
host, port, method, path, fp = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] or None
try:
    print(json.dumps({"status": 200, "body": transport.call(host, port, method, path, {}, fingerprint=fp,
                                                            timeout=5)}))
except MeshrunError as exc:
    print(json.dumps({"status": exc.status, "error": str(exc)}))
"""


def _call(mesh: Mesh, node: str, host: str, port: int, method: str, path: str, fingerprint: str = "") -> dict:
    res = world_node(mesh, node).run(mesh.python, "-c", CALL, host, str(port), method, path, fingerprint, timeout=30)
    return json.loads(res.stdout.strip().splitlines()[-1])


def world_node(mesh: Mesh, name: str):
    return mesh.world.node(name)


def _tcp_ok(mesh: Mesh, node: str, host: str, port: int, timeout: float = 3) -> bool:
    return (
        world_node(mesh, node)
        .run(mesh.python, "-c", PROBE, host, str(port), str(timeout), check=False, timeout=timeout + 20)
        .returncode
        == 0
    )


def _wg_peers(mesh: Mesh, node: str) -> set[str]:
    return set(world_node(mesh, node).run("wg", "show", "meshrun0", "peers").stdout.split())


def test_remove_node_cuts_it_off_and_overlay_api_is_overlay_only(fresh_mesh):
    mesh = fresh_mesh(4, "dc1-a")
    world = mesh.world
    for n in ("dc2-a", "dc3-a"):
        mesh.join(n)
    ips = {n: mesh.overlay_ip(n) for n in ("dc1-a", "dc2-a", "dc3-a")}
    coord_ip = ips["dc1-a"]
    for src, dst in (("dc2-a", "dc3-a"), ("dc3-a", "dc2-a"), ("dc3-a", "dc1-a"), ("dc1-a", "dc3-a")):
        mesh.wait_ping(src, ips[dst], timeout=30)
    network = json.loads((mesh.state_dir(world.node("dc1-a")) / "member.json").read_text())["network"]
    api, port, fp = network["api_port"], network["listen_port"], network["fingerprint"]
    coord_public = world.node("dc1-a").public_ip

    # The overlay API answers a member over the overlay ...
    ok = _call(mesh, "dc2-a", coord_ip, api, "GET", "/v1/members")
    assert ok["status"] == 200 and {m["name"] for m in ok["body"]["members"]} >= {"dc2-a", "dc3-a"}
    # ... but is not reachable from the underlay (socket bound to the overlay IP and the wg device) ...
    assert not _tcp_ok(mesh, "dc2-a", coord_public, api)
    # ... and the public enrolment port (TLS, pinned) serves no overlay route.
    assert _tcp_ok(mesh, "dc2-a", coord_public, port)
    for method, path in (("POST", "/v1/sync"), ("GET", "/v1/members")):
        r = _call(mesh, "dc2-a", coord_public, port, method, path, fp)
        assert r["status"] == 404, r

    key3 = json.loads((mesh.state_dir(world.node("dc3-a")) / "member.json").read_text())["public_key"]
    assert key3 in _wg_peers(mesh, "dc1-a") and key3 in _wg_peers(mesh, "dc2-a")
    out = mesh.meshrun("dc1-a", "remove", "dc3-a").stdout
    assert "removed dc3-a" in out
    t0 = time.monotonic()

    # Within a sync (pushed at once by the long-poll: REMOVAL_S) every member dropped its key; it reaches nobody.
    deadline = t0 + hang_guard(REMOVAL_S)
    while time.monotonic() < deadline and (key3 in _wg_peers(mesh, "dc1-a") or key3 in _wg_peers(mesh, "dc2-a")):
        time.sleep(0.5)
    assert key3 not in _wg_peers(mesh, "dc1-a"), "the coordinator still has the removed node's key"
    assert key3 not in _wg_peers(mesh, "dc2-a"), "dc2-a still has the removed node's key"
    for n in ("dc1-a", "dc2-a"):
        assert not mesh.ping("dc3-a", ips[n], count=2, wait=1), f"the removed node still reaches {n}"
        assert not mesh.ping(n, ips["dc3-a"], count=2, wait=1), f"{n} still reaches the removed node"
    assert time.monotonic() - t0 < hang_guard(REMOVAL_S) + 8  # and the 4 pings above, 2 s each at most
    # A request from the removed node's overlay address gets nowhere.
    assert not _tcp_ok(mesh, "dc3-a", coord_ip, api)
    members = json.loads(mesh.meshrun("dc1-a", "status", "--json").stdout)
    assert "dc3-a" not in {p["name"] for p in members["peers"]}

    # A new node never gets the removed node's address.
    mesh.join("dc4-a")
    ip4 = mesh.overlay_ip("dc4-a")
    assert ip4 not in ips.values()
    mesh.wait_ping("dc4-a", ips["dc2-a"], timeout=30)
    mesh.wait_ping("dc2-a", ip4, timeout=30)

    # The removed node's agent learns it (410 from the overlay API) and takes its interface down.
    node3 = world.node("dc3-a")
    deadline = time.monotonic() + 40
    st = {}
    while time.monotonic() < deadline:
        st = json.loads(mesh.meshrun(node3, "status", "--json").stdout)
        if st.get("removed") and not st.get("interface_up"):
            break
        time.sleep(1)
    log = (mesh.state_dir(node3) / "daemon.log").read_text(errors="replace")
    assert st.get("removed") is True, f"status of the removed node: {st}; its log ends: {log[-1500:]}"
    assert st.get("interface_up") is False
    assert node3.run("ip", "link", "show", "meshrun0", check=False).returncode != 0
    assert "removed" in mesh.meshrun(node3, "status").stdout.lower()
    # Its doctor says that alone, with what works there (not `meshrun up`, which would enrol nothing).
    doc = json.loads(mesh.meshrun(node3, "doctor", "--json", check=False).stdout)
    assert [(c["name"], c["level"]) for c in doc["checks"]] == [("membership", "FAIL")], doc
    assert "meshrun leave --purge" in doc["checks"][0]["fix"] and "meshrun up" not in doc["checks"][0]["fix"], doc
