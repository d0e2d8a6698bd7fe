"""etcd: a v3 client over its gRPC-JSON gateway (`POST /v3/...`, standard library only), and the etcd server
process (start, wait until it serves, stop).

The gateway speaks JSON: keys and values are base64, 64-bit integers come back as strings, and fields equal to
their zero value are left out (`"succeeded": false`, `"deleted": "0"`, a PUT event's `"type"`). Every request
carries the gRPC metadata `hasleader: true` (`Grpc-Metadata-Hasleader`), so a member cut off from its leader
answers "etcdserver: no leader" at once instead of holding the request for etcd's request timeout (7 s with
meshrun's settings), and a watch on such a member is cancelled: the client moves on to another member.

`EtcdClient` fails over between members. A request that certainly was not applied (no connection, no leader)
goes to the next member; a read that timed out too; a write that timed out after it was sent raises
`OutcomeUnknown` instead, since etcd may still apply it (callers re-read and decide). meshrun.system.control.fakeetcd is
the same interface in memory, held to the same contract (tests/etcd_contract.py).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from meshrun.errors import ControlStateError, HostError, StateError, UsageError
from meshrun.system.machine import procs

FIX = "check `meshrun status` on the coordinators: etcd needs a majority of its members"
TARGETS = ("VERSION", "CREATE", "MOD", "VALUE", "LEASE")
OPS = ("EQUAL", "NOT_EQUAL", "GREATER", "LESS")
_COMPARE_FIELD = {"VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision", "LEASE": "lease"}

# gRPC status codes the gateway passes through (`"code"` in an error answer).
UNKNOWN, INVALID_ARGUMENT, NOT_FOUND, OUT_OF_RANGE, UNAVAILABLE = 2, 3, 5, 11, 14
# Unavailable answers that say etcd did not take the request in: safe to send to another member, writes too.
# (Its other Unavailable answer, "etcdserver: request timed out", may still be applied.)
_NOT_TAKEN = ("no leader", "not capable", "server stopped", "unhealthy cluster")
# The gateway's own deadline ran out (HTTP 500, code 2): like a timeout, the request may have been applied.
_GATEWAY_DEADLINE = "context deadline exceeded"
IDLE_REUSE_S = 30.0  # a kept-alive connection idle longer is reopened: etcd's HTTP server drops idle ones
STREAM_POLL_S = 1.0  # how often a watch looks at its `stop` event
LOG_TAIL_BYTES = 8192


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class KV:
    """One key as etcd keeps it: revisions are the store's revisions of its creation and last change, `version`
    counts its changes since it was created, `lease` is the lease it lives with (0: none)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True)
class Compare:
    """A transaction's condition: the key's `target` (VERSION, CREATE, MOD, VALUE or LEASE) compared by `op`
    (EQUAL, NOT_EQUAL, GREATER, LESS) with `value` (bytes for VALUE, an int otherwise). A missing key has
    version, revisions and lease 0, and fails every VALUE comparison."""

    key: bytes
    target: str
    op: str
    value: int | bytes

    def __post_init__(self) -> None:
        if self.target not in TARGETS or self.op not in OPS:
            raise ValueError(f"a Compare needs a target in {TARGETS} and an op in {OPS}, not {self.target}/{self.op}")
        if (self.target == "VALUE") != isinstance(self.value, bytes):
            raise ValueError(f"a {self.target} Compare needs {'bytes' if self.target == 'VALUE' else 'an int'}")


@dataclass(frozen=True)
class Put:
    """A transaction's write of `value` at `key` (with `lease`, or none)."""

    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    """A transaction's delete of `key` (every key under it with `prefix`)."""

    key: bytes
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    """A transaction's read of `key` (every key under it with `prefix`, sorted by key)."""

    key: bytes
    prefix: bool = False


@dataclass(frozen=True)
class TxnResult:
    """What a transaction did: `succeeded` when every compare held (the success ops ran, else the failure
    ops); the store's revision after it; one response per op that ran: list[KV] for a Get, the number deleted
    for a Delete, None for a Put."""

    succeeded: bool
    revision: int
    responses: list = field(default_factory=list)


@dataclass(frozen=True)
class Event:
    """A change a watch saw: "PUT" (the key as written) or "DELETE" (key and mod_revision set, value b"")."""

    type: str
    kv: KV


@dataclass(frozen=True)
class EtcdMember:
    """A member of the etcd cluster; a member added but not started yet has no name and no client URLs."""

    id: int
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]
    is_learner: bool = False


class Compacted(ControlStateError):
    """The revision a watch (or a paged read) starts from was compacted away: read the current state again and
    watch from its revision. `revision` is the compaction's revision for a watch (the oldest etcd still has),
    the revision asked for otherwise."""

    def __init__(self, revision: int, where: str = "etcd") -> None:
        super().__init__(
            f"{where} no longer has the revisions before {revision} (compacted)",
            "read the keys again and watch from the revision that read returns",
        )
        self.revision = revision


class OutcomeUnknown(ControlStateError):
    """A write was sent but no answer came back: etcd may or may not apply it. Read the keys to find out."""


# --------------------------------------------------------------------------- JSON helpers


def prefix_end(prefix: bytes) -> bytes:
    """etcd's `range_end` for every key that starts with `prefix` (b"\\0", every key, for an empty prefix)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(data: object) -> bytes:
    return base64.b64decode(str(data or ""))


def _int(data: object) -> int:
    return int(data or 0)


def _range(key: bytes, prefix: bool) -> dict:
    if prefix:
        return {"key": _b64(key or b"\0"), "range_end": _b64(prefix_end(key))}
    _need_key(key)
    return {"key": _b64(key)}


def _need_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not key:
        raise ValueError("an etcd key is non-empty bytes")


def _kv(d: dict) -> KV:
    return KV(
        key=_unb64(d.get("key")),
        value=_unb64(d.get("value")),
        create_revision=_int(d.get("create_revision")),
        mod_revision=_int(d.get("mod_revision")),
        version=_int(d.get("version")),
        lease=_int(d.get("lease")),
    )


def _member(d: dict) -> EtcdMember:
    return EtcdMember(
        id=_int(d.get("ID")),
        name=str(d.get("name", "")),
        peer_urls=tuple(d.get("peerURLs") or ()),
        client_urls=tuple(d.get("clientURLs") or ()),
        is_learner=bool(d.get("isLearner", False)),
    )


def _revision(answer: dict) -> int:
    return _int((answer.get("header") or {}).get("revision"))


def _op(op: Put | Delete | Get) -> dict:
    if isinstance(op, Put):
        _need_key(op.key)
        return {"request_put": {"key": _b64(op.key), "value": _b64(op.value), "lease": str(op.lease)}}
    if isinstance(op, Delete):
        return {"request_delete_range": _range(op.key, op.prefix)}
    if isinstance(op, Get):
        return {"request_range": _range(op.key, op.prefix)}
    raise ValueError(f"a transaction op is a Put, Delete or Get, not {type(op).__name__}")


def _compare(c: Compare) -> dict:
    _need_key(c.key)
    out = {"key": _b64(c.key), "target": c.target, "result": c.op}
    if c.target == "VALUE":
        out["value"] = _b64(c.value)
    else:
        out[_COMPARE_FIELD[c.target]] = str(c.value)
    return out


def _response(op: Put | Delete | Get, r: dict):
    if isinstance(op, Get):
        return [_kv(kv) for kv in (r.get("response_range") or {}).get("kvs") or ()]
    if isinstance(op, Delete):
        return _int((r.get("response_delete_range") or {}).get("deleted"))
    return None


def _error_of(status: int, body: bytes) -> tuple[int, str]:
    """(gRPC code, message) of a gateway error answer, in either of its shapes: unary calls answer
    {"error": MSG, "message": MSG, "code": N}, streams {"error": {"grpc_code": N, "message": MSG, ...}}."""
    try:
        d = json.loads(body.split(b"\n", 1)[0] or b"{}")
    except ValueError:
        d = {}
    err = d.get("error") if isinstance(d, dict) else None
    if isinstance(err, dict):
        return _int(err.get("grpc_code")), str(err.get("message", ""))
    if isinstance(d, dict) and (err is not None or "code" in d):
        return _int(d.get("code")), str(d.get("message") or err or "")
    return (UNAVAILABLE if status == 503 else UNKNOWN), f"HTTP {status}"


# --------------------------------------------------------------------------- the client


class _Skip(Exception):
    """Internal: this member cannot serve the request now; `taken` when it may have applied it anyway."""

    def __init__(self, reason: str, taken: bool) -> None:
        super().__init__(reason)
        self.reason, self.taken = reason, taken


class _Refused(Exception):
    """Internal: etcd answered with an error of its own (not one that means "try another member")."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class _Endpoint:
    url: str
    https: bool
    host: str
    port: int


def _parse_endpoint(url: str) -> _Endpoint:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise UsageError(f"{url!r} is not an etcd endpoint (https://IP:PORT)", "pass a member's client URL")
    return _Endpoint(url.rstrip("/"), parts.scheme == "https", parts.hostname, port)


def _stamp(paths: Sequence[str | None]) -> tuple:
    """What identifies the TLS files' current contents cheaply: (inode, size, mtime) of each (None: missing)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        out.append(None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class EtcdClient:
    """An etcd v3 client over the gRPC-JSON gateway of `endpoints` (client URLs, e.g. "https://10.7.0.2:2379").

    `ca`, `cert` and `key` are file paths: the CA that signed the members' certificates, and this client's
    certificate and key (etcd requires one). Requests go to the member that answered last (`endpoint`, one of
    `endpoints`) and
    fail over in order to the others on connection errors, timeouts and "no leader / unavailable" answers;
    any other answer of etcd's raises ControlStateError at once. Thread-safe: each thread keeps one
    connection per member.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        timeout: float = 5.0,
    ) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise UsageError("an etcd client needs a list of endpoints", "pass the members' client URLs")
        self._endpoints = [_parse_endpoint(u) for u in endpoints]
        self.endpoints = [e.url for e in self._endpoints]
        self._by_url = {e.url: e for e in self._endpoints}
        self.timeout = timeout
        self._ssl: ssl.SSLContext | None = None
        self._tls_files = (ca, cert, key)
        self._tls_stamp = _stamp(self._tls_files)
        if any(e.https for e in self._endpoints):
            self._ssl = self._load_tls()
        self._preferred = 0
        self.endpoint = self._endpoints[0].url
        self._local = threading.local()
        self._lock = threading.Lock()
        # Weak: a thread's connections go with the thread (its threading.local); close() reaches the rest.
        self._open: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()

    # ----------------------------------------------------------------- plumbing

    def _load_tls(self) -> ssl.SSLContext:
        ca, cert, key = self._tls_files
        try:
            ctx = ssl.create_default_context(cafile=ca)
            if cert:
                ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:  # the message names the file, never its content
            raise StateError(
                f"cannot load etcd's TLS files (CA {ca}, certificate {cert}, key {key}): {type(exc).__name__}",
                "check that the files exist, are PEM, and that the key is the certificate's",
            ) from None
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    def _context(self) -> ssl.SSLContext | None:
        """The TLS context for a new connection, loaded again when a TLS file changed on disk since: a renewed
        certificate, or the CA bundle of a rotation (meshrun.mesh.coordinator.ha.TlsKeeper). Connections open
        already keep theirs. A file caught half-replaced keeps the last good context, and is tried again."""
        if self._ssl is None:
            return None
        stamp = _stamp(self._tls_files)
        if stamp != self._tls_stamp:
            with self._lock:
                if stamp != self._tls_stamp:
                    with contextlib.suppress(StateError):
                        self._ssl = self._load_tls()
                        self._tls_stamp = stamp
        return self._ssl

    def _connection(self, ep: _Endpoint) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to `ep` and whether it was used before (False: fresh)."""
        conns = self._local.__dict__.setdefault("conns", {})
        held = conns.get(ep.url)
        if held is not None:
            conn, last = held
            if conn.sock is not None and time.monotonic() - last < IDLE_REUSE_S:
                return conn, True
            self._drop(ep)
        if ep.https:
            conn = http.client.HTTPSConnection(ep.host, ep.port, timeout=self.timeout, context=self._context())
        else:
            conn = http.client.HTTPConnection(ep.host, ep.port, timeout=self.timeout)
        conns[ep.url] = (conn, time.monotonic())
        with self._lock:
            self._open.add(conn)
        return conn, False

    def _drop(self, ep: _Endpoint) -> None:
        held = self._local.__dict__.get("conns", {}).pop(ep.url, None)
        if held is not None:
            held[0].close()
            with self._lock:
                self._open.discard(held[0])

    def _once(self, ep: _Endpoint, path: str, payload: bytes, leader: bool) -> dict:
        """One request to one member: its JSON answer, or _Skip / _Refused."""
        headers = {"Content-Type": "application/json"}
        if leader:
            headers["Grpc-Metadata-Hasleader"] = "true"
        for attempt in (0, 1):
            conn, reused = self._connection(ep)
            if conn.sock is None:
                try:
                    conn.connect()
                except (OSError, ssl.SSLError) as exc:  # nothing was sent
                    self._drop(ep)
                    raise _Skip(_reason(exc), taken=False) from None
            try:
                conn.request("POST", path, body=payload, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._drop(ep)
                if reused and attempt == 0:
                    continue  # the member closed a kept-alive connection before reading the request: resend
                raise _Skip(_reason(exc), taken=True) from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop(ep)
                raise _Skip(_reason(exc), taken=True) from None
            self._local.conns[ep.url] = (conn, time.monotonic())
            if resp.will_close:
                self._drop(ep)
            if resp.status == 200:
                try:
                    answer = json.loads(body.split(b"\n", 1)[0] or b"{}")  # a stream's first message, or the answer
                except ValueError:
                    raise _Skip("an answer that is not JSON", taken=True) from None
                if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
                    code, message = _error_of(resp.status, body)
                else:
                    return answer.get("result", answer) if isinstance(answer, dict) else {}
            else:
                code, message = _error_of(resp.status, body)
            if code == UNAVAILABLE or resp.status == 503:
                raise _Skip(message, taken=not any(s in message for s in _NOT_TAKEN))
            if code == UNKNOWN and _GATEWAY_DEADLINE in message:
                raise _Skip(message, taken=True)
            raise _Refused(code, message)
        raise AssertionError("unreachable")  # pragma: no cover

    def _order(self, endpoint: str | None) -> list[_Endpoint]:
        if endpoint is not None:
            return [self._by_url.get(endpoint.rstrip("/")) or _parse_endpoint(endpoint)]
        p = self._preferred
        return self._endpoints[p:] + self._endpoints[:p]

    def _call(
        self,
        path: str,
        body: dict,
        what: str,
        write: bool,
        endpoint: str | None = None,
        leader: bool = True,
        ok_codes: tuple[int, ...] = (),
    ) -> dict | None:
        """POST `body` to `path` on the first member that serves it; None for an error in `ok_codes`."""
        payload = json.dumps(body).encode()
        tried: list[str] = []
        for ep in self._order(endpoint):
            try:
                answer = self._once(ep, path, payload, leader)
            except _Skip as skip:
                tried.append(f"{ep.url} ({skip.reason})")
                if skip.taken and write:
                    self._prefer_after(ep)
                    raise OutcomeUnknown(
                        f"etcd at {ep.url} did not answer the {what} ({skip.reason}): it may or may not be applied",
                        "read the keys again before deciding; " + FIX,
                    ) from None
                continue
            except _Refused as ref:
                if ref.code in ok_codes:
                    return None
                if ref.code == OUT_OF_RANGE and "compacted" in ref.message:
                    raise Compacted(_int(body.get("revision")), f"etcd at {ep.url}") from None
                raise ControlStateError(
                    f"etcd at {ep.url} refused the {what}: {ref.message} (code {ref.code})", _fix_for(ref)
                ) from None
            self._prefer(ep)
            return answer
        raise ControlStateError(f"no etcd member could serve the {what}: tried {', '.join(tried)}", _fix_tried(tried))

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """The members to use from now on (the coordinators came or went); the one answering now stays first
        if it is still among them."""
        if isinstance(endpoints, str) or not endpoints:
            raise UsageError("an etcd client needs a list of endpoints", "pass the members' client URLs")
        eps = [_parse_endpoint(u) for u in endpoints]
        with self._lock:
            current = self.endpoint
            self._endpoints = eps
            self.endpoints = [e.url for e in eps]
            self._by_url = {e.url: e for e in eps}
            self._preferred = self.endpoints.index(current) if current in self.endpoints else 0
            self.endpoint = self.endpoints[self._preferred]

    def _prefer(self, ep: _Endpoint) -> None:
        if ep.url in self._by_url:
            self._preferred = self._endpoints.index(ep)
            self.endpoint = ep.url

    def _prefer_after(self, ep: _Endpoint) -> None:
        if ep.url in self._by_url:
            self._preferred = (self._endpoints.index(ep) + 1) % len(self._endpoints)

    # ----------------------------------------------------------------- keys

    def get(self, key: bytes) -> KV | None:
        """The key, or None when it does not exist."""
        answer = self._call("/v3/kv/range", _range(key, False), "read", write=False)
        kvs = answer.get("kvs") or ()
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes, page: int = 1000) -> tuple[list[KV], int]:
        """(every key under `prefix` sorted by key, the revision they were read at): read `page` keys a request,
        every page at the first page's revision, so the result is one consistent snapshot.

        Compacted if that revision is compacted away before the last page (thousands of writes meanwhile).
        """
        if page < 1:
            raise ValueError("a page holds at least one key")
        body = _range(prefix, True) | {"limit": str(page)}
        out: list[KV] = []
        revision = 0
        while True:
            answer = self._call("/v3/kv/range", body, "read", write=False)
            revision = revision or _revision(answer)
            kvs = [_kv(kv) for kv in answer.get("kvs") or ()]
            out.extend(kvs)
            if not answer.get("more") or not kvs:
                return out, revision
            body = body | {"key": _b64(kvs[-1].key + b"\0"), "revision": str(revision)}

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write `value` at `key` (with `lease`, or none); returns the store's revision after the write."""
        _need_key(key)
        body = {"key": _b64(key), "value": _b64(value), "lease": str(lease)}
        return _revision(self._call("/v3/kv/put", body, "write", write=True))

    def delete(self, key: bytes, prefix: bool = False) -> int:
        """Delete `key` (every key under it with `prefix`); returns how many keys were deleted."""
        return _int(self._call("/v3/kv/deleterange", _range(key, prefix), "delete", write=True).get("deleted"))

    def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete | Get], failure=()) -> TxnResult:
        """Run `success` if every `compare` holds, else `failure`, as one atomic step (one revision for all its
        writes). A txn with no write is a read: it is retried on another member after a timeout."""
        ops_ok, ops_ko = list(success), list(failure)
        body = {
            "compare": [_compare(c) for c in compare],
            "success": [_op(o) for o in ops_ok],
            "failure": [_op(o) for o in ops_ko],
        }
        writes = any(not isinstance(o, Get) for o in ops_ok + ops_ko)
        answer = self._call("/v3/kv/txn", body, "transaction", write=writes)
        ok = bool(answer.get("succeeded"))
        ran = ops_ok if ok else ops_ko
        responses = [_response(op, r) for op, r in zip(ran, answer.get("responses") or ())]
        return TxnResult(succeeded=ok, revision=_revision(answer), responses=responses)

    def revision(self) -> int:
        """The store's current revision (a linearizable read of one key that need not exist)."""
        return _revision(self._call("/v3/kv/range", {"key": _b64(b"\0")}, "read", write=False))

    def compact(self, revision: int) -> None:
        """Drop the history before `revision` (watches from an older revision then raise Compacted).

        ControlStateError when `revision` is compacted already or is in the future."""
        self._call("/v3/kv/compaction", {"revision": str(revision), "physical": True}, "compaction", write=False)

    # ----------------------------------------------------------------- leases

    def lease_grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds (etcd raises a shorter one to its minimum); returns its ID."""
        # Not a write for failover: a grant retried elsewhere at worst leaves an unused lease to expire.
        return _int(self._call("/v3/lease/grant", {"TTL": ttl}, "lease grant", write=False).get("ID"))

    def lease_keepalive(self, lease: int) -> int:
        """Renew `lease`; returns the seconds it has left (0 when it is gone: expired or revoked)."""
        return _int(self._call("/v3/lease/keepalive", {"ID": str(lease)}, "lease keep-alive", write=False).get("TTL"))

    def lease_revoke(self, lease: int) -> None:
        """Revoke `lease`, deleting its keys; nothing happens when it is gone already."""
        self._call("/v3/lease/revoke", {"ID": str(lease)}, "lease revoke", write=False, ok_codes=(NOT_FOUND,))

    # ----------------------------------------------------------------- watch

    def watch(
        self, prefix: bytes, start_revision: int, stop: threading.Event, idle_timeout: float | None = None
    ) -> Iterator[list[Event]]:
        """Yield each batch of changes under `prefix` from `start_revision` on (0: from now), in revision order;
        return once `stop` is set (looked at every second). A generator: the watch is created at the first
        `next()`, so pass an explicit revision rather than 0 when writes may come before that.

        Compacted when `start_revision` is compacted away; ControlStateError when the stream breaks (the member
        went away or lost its leader): watch again from the revision after the last event seen. With
        `idle_timeout`, a stream silent that long counts as broken; servers started with meshrun's flags
        (meshrun.core.etcdconf) send progress every 5 s, so 30 s finds a dead path without false alarms.
        """
        create = _range(prefix, True) | {"start_revision": str(start_revision), "progress_notify": True}
        stream, events = self._open_watch({"create_request": create})
        where = f"etcd at {stream.endpoint.url}"
        try:
            if events:
                yield events
            last = time.monotonic()
            while not stop.is_set():
                try:
                    line = stream.line()
                except (OSError, ValueError) as exc:
                    raise ControlStateError(f"the watch stream from {where} broke ({_reason(exc)})", FIX) from None
                if line is None:
                    if idle_timeout is not None and time.monotonic() - last > idle_timeout:
                        raise ControlStateError(f"the watch stream from {where} was silent {idle_timeout:.0f} s", FIX)
                    continue
                last = time.monotonic()
                events = _watch_message(line, where)
                if events:
                    yield events
        finally:
            stream.close()

    def _open_watch(self, body: dict) -> tuple[_Stream, list[Event]]:
        """A stream whose watch etcd created, from the first member that serves it, and any events its first
        message carried."""
        payload = json.dumps(body).encode()
        tried: list[str] = []
        for ep in self._order(None):
            stream = None
            try:
                stream = _Stream(ep, self._context(), self.timeout)
                stream.send(payload)
                status, first = stream.start()
            except (OSError, ValueError) as exc:
                if stream is not None:
                    stream.close()
                tried.append(f"{ep.url} ({_reason(exc)})")
                continue
            code, message = _error_of(status, first) if status != 200 or b'"error"' in first else (0, "")
            if code == 0:
                try:
                    # The first message says the watch was created (or why not: a compacted start revision).
                    events = _watch_message(first, f"etcd at {ep.url}")
                except BaseException:
                    stream.close()
                    raise
                self._prefer(ep)
                return stream, events
            stream.close()
            if code == UNAVAILABLE or status == 503:
                tried.append(f"{ep.url} ({message})")
                continue
            raise ControlStateError(f"etcd at {ep.url} refused the watch: {message} (code {code})", FIX)
        raise ControlStateError(f"no etcd member could serve the watch: tried {', '.join(tried)}", _fix_tried(tried))

    # ----------------------------------------------------------------- cluster

    def status(self, endpoint: str | None = None) -> dict:
        """{"member_id", "leader" (0: none known), "raft_term", "version", "db_size", "errors"} as the member at
        `endpoint` (default: `endpoint`, the one that answered last) sees them; asks that member only."""
        answer = self._call(
            "/v3/maintenance/status", {}, "status", write=False, endpoint=endpoint or self.endpoint, leader=False
        )
        return {
            "member_id": _int((answer.get("header") or {}).get("member_id")),
            "leader": _int(answer.get("leader")),
            "raft_term": _int(answer.get("raftTerm")),
            "version": str(answer.get("version", "")),
            "db_size": _int(answer.get("dbSize")),
            "errors": [str(e) for e in answer.get("errors") or ()],
        }

    def members(self) -> list[EtcdMember]:
        """The cluster's members, as a member with a leader knows them."""
        answer = self._call("/v3/cluster/member/list", {}, "member list", write=False)
        return [_member(m) for m in answer.get("members") or ()]

    def member_add(self, peer_urls: Sequence[str], learner: bool = False) -> EtcdMember:
        """Add a member that will answer at `peer_urls` (a `learner` does not vote until promoted); start it
        afterwards with cluster state "existing". etcd refuses a voting member the cluster could not reach a
        majority with while it is down."""
        body = {"peerURLs": list(peer_urls), "isLearner": learner}
        return _member(self._call("/v3/cluster/member/add", body, "member add", write=True).get("member") or {})

    def member_promote(self, member_id: int) -> None:
        """Give the learner `member_id` its vote. ControlStateError while it has not caught up with the leader
        (etcd refuses; try again shortly) or when there is no such member; nothing happens when it votes already
        (so a promotion whose answer was lost can be sent again)."""
        try:
            self._call("/v3/cluster/member/promote", {"ID": str(member_id)}, "member promote", write=True)
        except ControlStateError as exc:
            if "can only promote a learner member" in exc.message and "in sync" not in exc.message:
                return  # etcd's answer for a member that votes already
            raise

    def member_remove(self, member_id: int) -> None:
        """Remove the member `member_id` from the cluster (ControlStateError when there is no such member)."""
        self._call("/v3/cluster/member/remove", {"ID": str(member_id)}, "member remove", write=True)

    def close(self) -> None:
        """Close every kept-alive connection (a later call opens new ones)."""
        with self._lock:
            conns, self._open = list(self._open), weakref.WeakSet()
        for conn in conns:
            conn.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def _fix_tried(tried: list[str]) -> str:
    if tried and all("(TLS: " in t for t in tried):  # every member reached, none trusted us (or we it)
        return (
            "check the etcd TLS files: the CA must be the one that signed the members' certificates, and etcd "
            "takes only client certificates that CA signed"
        )
    return FIX


def _fix_for(ref: _Refused) -> str:
    if "space exceeded" in ref.message:
        return "etcd's database is full: compact and defragment it (`etcdctl defrag`), then disarm the alarm"
    if ref.code == INVALID_ARGUMENT:
        return "meshrun sent etcd a request it cannot take: report this as a bug"
    return FIX


def _watch_message(line: bytes, where: str) -> list[Event]:
    """The events in one watch stream message; raises for a cancelled watch or an error in the stream."""
    try:
        msg = json.loads(line)
    except ValueError:
        raise ControlStateError(f"the watch stream from {where} sent something that is not JSON", FIX) from None
    if not isinstance(msg, dict):
        return []
    if "error" in msg:
        code, message = _error_of(200, line)
        raise ControlStateError(f"the watch stream from {where} ended: {message} (code {code})", FIX)
    r = msg.get("result") or {}
    if r.get("compact_revision"):
        raise Compacted(_int(r["compact_revision"]), where)
    if r.get("canceled"):
        reason = r.get("cancel_reason") or "cancelled by the server"
        raise ControlStateError(f"the watch stream from {where} ended: {reason}", FIX)
    return [
        Event("DELETE" if e.get("type") == "DELETE" else "PUT", _kv(e.get("kv") or {})) for e in r.get("events") or ()
    ]


class _Stream:
    """One HTTP/1.1 POST whose chunked answer is read line by line, a read at most STREAM_POLL_S long.

    http.client cannot be read with a short timeout without losing bytes, so the watch owns its socket and
    its buffer: a timeout leaves every byte received where it was.
    """

    def __init__(self, ep: _Endpoint, ctx: ssl.SSLContext | None, timeout: float) -> None:
        self.endpoint = ep
        self.timeout = timeout
        self._sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
        if ep.https:
            try:
                self._sock = ctx.wrap_socket(self._sock, server_hostname=ep.host)
            except BaseException:
                self._sock.close()
                raise
        self._raw = b""  # received, not yet decoded
        self._data = b""  # decoded body, not yet returned
        self._chunked = False
        self._left: int | None = None  # body bytes still to come (Content-Length), None: chunked or to EOF
        self._done = False

    def send(self, payload: bytes) -> None:
        head = (
            f"POST /v3/watch HTTP/1.1\r\nHost: {self.endpoint.host}:{self.endpoint.port}\r\n"
            "Content-Type: application/json\r\nGrpc-Metadata-Hasleader: true\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        self._sock.sendall(head.encode() + payload)

    def _recv(self) -> bool:
        """Read what arrives; False after a quiet STREAM_POLL_S. ValueError at the end of the stream."""
        try:
            chunk = self._sock.recv(65536)
        except TimeoutError:
            return False
        if not chunk:
            raise ValueError("the server closed the stream")
        self._raw += chunk
        return True

    def start(self) -> tuple[int, bytes]:
        """(HTTP status, the first line of the body: the first message), waiting at most `timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        self._sock.settimeout(STREAM_POLL_S)
        while b"\r\n\r\n" not in self._raw:
            if time.monotonic() > deadline:
                raise TimeoutError
            self._recv()
        head, self._raw = self._raw.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            raise ValueError("an answer that is not HTTP") from None
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self._chunked and headers.get("content-length", "").isdigit():
            self._left = int(headers["content-length"])
        while True:
            line = self.line()
            if line is not None:
                return status, line
            if time.monotonic() > deadline:
                raise TimeoutError

    def _decode(self) -> None:
        if not self._chunked:
            take = self._raw if self._left is None else self._raw[: self._left]
            self._data += take
            self._raw = self._raw[len(take) :]
            if self._left is not None:
                self._left -= len(take)
                self._done = self._left == 0
            return
        while True:
            end = self._raw.find(b"\r\n")
            if end < 0:
                return
            size = int(self._raw[:end].split(b";", 1)[0], 16)
            if size == 0:
                self._done = True
                return
            if len(self._raw) < end + 2 + size + 2:
                return
            self._data += self._raw[end + 2 : end + 2 + size]
            self._raw = self._raw[end + 2 + size + 2 :]

    def line(self) -> bytes | None:
        """The next non-empty line of the body, or None when none came within STREAM_POLL_S."""
        while True:
            self._decode()
            while b"\n" in self._data:
                line, self._data = self._data.split(b"\n", 1)
                if line.strip():
                    return line
            if self._done:
                if self._data.strip():
                    line, self._data = self._data, b""
                    return line
                raise ValueError("the server ended the stream")
            try:
                if not self._recv():
                    return None
            except ValueError:
                if self._chunked or self._left:
                    raise
                self._done = True  # a body that runs to the end of the connection

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


# --------------------------------------------------------------------------- the server process

_CHILDREN: dict[int, object] = {}  # pid -> its Popen, so stop_server reaps what start_server started
_CHILDREN_LOCK = threading.Lock()


def start_server(argv: list[str], log_path: Path, cgroup_procs: Path | None = None) -> int:
    """Start etcd (`argv`: the binary, then meshrun.core.etcdconf.server_argv) in its own session, its output
    appended to `log_path` (0600); returns its PID.

    With `cgroup_procs` (a cgroup v2 `cgroup.procs` file) the child moves itself into that cgroup before it
    runs etcd, so every socket etcd opens belongs to the cgroup (nftables matches sockets by the cgroup they
    were created in; moving etcd afterwards would leave its listeners outside). HostError when etcd cannot
    be started or the cgroup cannot be joined.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    cg_fd = None
    try:
        os.fchmod(fd, 0o600)
        preexec = None
        if cgroup_procs is not None:
            try:
                cg_fd = os.open(cgroup_procs, os.O_WRONLY)
            except OSError as exc:
                raise HostError(
                    f"cannot join the cgroup {cgroup_procs}: {_reason(exc)}", "run as root on cgroup v2"
                ) from None
            target = cg_fd

            def preexec() -> None:  # in the child, before exec: only a write, no locks a thread may hold
                os.write(target, str(os.getpid()).encode())

        try:
            proc = procs.popen(
                argv,
                stdin=procs.DEVNULL,
                stdout=fd,
                stderr=procs.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise HostError(
                f"cannot start {argv[0]}: {_reason(exc)}"
                + (f" (joining {cgroup_procs} failed?)" if cgroup_procs is not None else ""),
                "install etcd (Debian: `apt install etcd-server`) and check the cgroup",
            ) from None
    finally:
        os.close(fd)
        if cg_fd is not None:
            os.close(cg_fd)
    with _CHILDREN_LOCK:
        _CHILDREN[proc.pid] = proc
    return proc.pid


def log_tail(log_path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log (read from its last few KiB only)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def wait_healthy(
    client: EtcdClient, timeout: float, log_path: Path | None = None, pid: int | None = None, learner: bool = False
) -> None:
    """Wait until the cluster answers a linearizable read through `client` (so it has a leader and a majority);
    a `learner` (it serves no reads) until its status names a leader.

    ControlStateError after `timeout` seconds, or as soon as `pid` (the server just started) exits, naming the
    last line of `log_path` (one line: the full log is named)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            if learner:
                if client.status().get("leader"):
                    return
                last = "no leader yet"
            else:
                client.revision()
                return
        except ControlStateError as exc:
            last = exc.message
        exited = pid is not None and not procs.alive(pid)
        if exited or time.monotonic() >= deadline:
            what = f"etcd (pid {pid}) exited" if exited else f"etcd did not serve within {timeout:.0f} s"
            tail = (log_tail(log_path, 1) if log_path is not None else "").strip()[:300]
            raise ControlStateError(
                f"{what}: {last}" + (f" (its log ends: {tail})" if tail else ""),
                f"see {log_path}" if log_path is not None else FIX,
            )
        time.sleep(0.2)


def stop_server(pid: int, timeout: float = 10) -> None:
    """Stop the etcd process `pid`: SIGTERM, SIGKILL after `timeout` seconds; only that PID is signalled.

    A PID this process did not start (read back from a file after a restart) is signalled only while it is
    still an etcd: the PID may have been reused since. Nothing happens when it is gone.
    """
    with _CHILDREN_LOCK:
        proc = _CHILDREN.pop(pid, None)
    started = procs.start_time(pid)
    if started is None or (proc is None and not (procs.comm(pid) or "").startswith("etcd")):
        return
    if procs.signal_pid(pid, signal.SIGTERM) and not procs.wait_gone(pid, timeout):
        if procs.start_time(pid) == started:  # the very process we sent SIGTERM to
            procs.signal_pid(pid, signal.SIGKILL)
        procs.wait_gone(pid, 5)
    if proc is not None:
        with contextlib.suppress(procs.TimeoutExpired):
            proc.wait(5)  # reap it: we started it
