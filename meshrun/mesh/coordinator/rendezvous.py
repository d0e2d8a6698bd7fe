"""Jobs' torchrun rendezvous at the coordinators: `POST /v1/rdzv/<job_id>`, its state in a shared key-value store.

With several coordinators a job must outlive the one that started it, so its rendezvous cannot live in a
TCPStore on that machine. Each node's torchrun agent (meshrun.jobs.rdzv_backend with ``coordinators=``)
calls whichever coordinator answers, on the overlay API port; every coordinator serves the same state
because it lives in the `RendezvousKV` they share (etcd), changed only by compare-and-swap. Nodes never
reach etcd themselves. The service keeps nothing of its own between requests.

The caller is the overlay source address (WireGuard authenticated it): only the job's nodes
(`members_of(job_id)`) may use a job's rendezvous, and anyone else is refused before the store is read.

Wire format: a JSON object {"op": OP, ...}; bytes travel as standard base64 strings.

| op | request fields | answer |
|---|---|---|
| get_state | | {"state": b64 or null, "token": str or null} |
| set_state | state: b64, token: str or null | {"state": b64 or null, "token": str or null, "ok": bool} |
| set | key, value: b64 | {} |
| get | key | {"found": true, "value": b64} or {"found": false} (never waits: the client polls) |
| add | key, amount: int, id: str (optional) | {"value": int}, the sum after adding |
| compare_set | key, expected: b64, desired: b64 | {"value": b64} (torch's Store.compare_set) |
| check | keys: [str] | {"ok": bool}: every key exists |
| delete_key | key | {"deleted": bool} |
| multi_get | keys: [str] | {"values": [b64 or null]} (null: missing) |
| multi_set | keys: [str], values: [b64] | {} |
| num_keys | | {"count": int}: the job's store keys |

`set_state` is torch's RendezvousBackend.set_state: with a token, the state is written only if the token is
the stored state's (a token that cannot be one, such as a non-number, just does not match); without one,
only if there is no state yet. Either way the answer is the state stored now and its token, with "ok"
saying whether this write happened. An `add` with an `id` (8-64 of A-Z a-z 0-9 _ -) counts once however
often it is sent: an agent that lost the answer to a coordinator that then died sends it again elsewhere.

Errors (meshrun.errors.to_wire, see `http_status`): 400 UsageError (malformed, over a cap, a value `add`
cannot parse), 403 AuthError (the caller is not one of the job's nodes), 404 StateError (no such running
job), 503 any other meshrun error (the shared store cannot be read or written now, e.g. the etcd client's
ControlStateError, or a compare-and-swap lost for CAS_SECONDS: the agent tries another coordinator).
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import threading
import time
from collections.abc import Callable, Collection
from typing import Protocol

from meshrun.core.jobspec import JOB_ID_RE
from meshrun.errors import AuthError, CoordinatorError, MeshrunError, StateError, UsageError
from meshrun.system.transport import MAX_JSON, Request, Response

log = logging.getLogger("meshrun.mesh.coordinator.rendezvous")

PATH_PREFIX = "/v1/rdzv/"  # + job id
MAX_KEY = 512  # characters of a store key
# The largest value (and the most a multi_set carries in all) whose base64 still fits a request body
# (transport.MAX_JSON) with room for the rest of it. torch's rendezvous state for 1000 nodes is ~70 KiB.
MAX_VALUE = (MAX_JSON - 16 * 1024) * 3 // 4
MAX_BATCH = 1024  # keys in one check, multi_get or multi_set (the client sends larger ones in parts)
MAX_ANSWER = 8 * 1024 * 1024  # bytes of values in one multi_get answer
CAS_SECONDS = 5.0  # a compare-and-swap retried this long under contention, then 503 (the agent retries)
INT64 = 2**63
OP_ID_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}\Z")


class RendezvousKV(Protocol):
    """The key-value store the coordinators share (etcd); what the rendezvous needs of it.

    A key's version is > 0 and changes on every write, and is never reused for that key (etcd's
    mod_revision). When the store cannot be reached, or a write's outcome is unknown, a method raises a
    MeshrunError other than UsageError, AuthError and StateError (the etcd client's ControlStateError): the
    service answers 503 and the agent tries another coordinator.
    """

    def get(self, key: str) -> tuple[bytes, int] | None:
        """(value, version), or None when the key does not exist."""
        ...

    def put_if(self, key: str, value: bytes, version: int) -> bool:
        """Write only if the key's version is `version` (0: only if it does not exist); True if written."""
        ...

    def delete(self, key: str) -> None:
        """Remove the key (nothing if it does not exist)."""
        ...

    def keys(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`."""
        ...


class MemoryKV:
    """A `RendezvousKV` in one process's memory (thread-safe): tests, and a network with one coordinator."""

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, int]] = {}
        self._last = 0  # versions are global, like etcd's revisions: a deleted key's never come back
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bytes, int] | None:
        with self._lock:
            return self._data.get(key)

    def put_if(self, key: str, value: bytes, version: int) -> bool:
        with self._lock:
            cur = self._data.get(key)
            if (cur[1] if cur is not None else 0) != version:
                return False
            self._last += 1
            self._data[key] = (bytes(value), self._last)
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        with self._lock:
            return sorted(k for k in self._data if k.startswith(prefix))


def http_status(err: MeshrunError) -> int:
    """The HTTP status `RendezvousService.handle`'s error is answered with."""
    if isinstance(err, AuthError):
        return 403
    if isinstance(err, StateError):
        return 404
    if isinstance(err, UsageError):
        return 400
    # Anything else is this coordinator's trouble (its store unreachable: the etcd client's
    # ControlStateError, or a CoordinatorError): another coordinator may well answer.
    return 503


def job_prefix(job_id: str) -> str:
    """Where job `job_id`'s rendezvous lives in the store: its state, store keys and counted adds."""
    return f"rdzv/{job_id}/"


class RendezvousService:
    """Every job's rendezvous, answered from the shared store (see the module's wire format).

    `members_of(job_id)` is the set of overlay IPs of that job's nodes, or None when no such job runs.
    `handle` raises meshrun errors (`http_status` maps them); `serve` is the HTTP handler for the overlay API.
    """

    def __init__(self, kv: RendezvousKV, members_of: Callable[[str], Collection[str] | None]) -> None:
        self.kv = kv
        self.members_of = members_of
        self._ops: dict[str, Callable[[str, dict], dict]] = {
            "get_state": self._get_state,
            "set_state": self._set_state,
            "set": self._set,
            "get": self._get,
            "add": self._add,
            "compare_set": self._compare_set,
            "check": self._check,
            "delete_key": self._delete_key,
            "multi_get": self._multi_get,
            "multi_set": self._multi_set,
            "num_keys": self._num_keys,
        }

    def serve(self, req: Request) -> Response:
        """`POST /v1/rdzv/<job_id>` from `req.client_ip`: the answer, or the error as its status."""
        if not req.path.startswith(PATH_PREFIX):
            return Response.error(404, f"no such endpoint {req.method} {req.path}")
        if req.method != "POST":
            return Response.error(405, UsageError(f"{req.path} takes POST, not {req.method}", "use POST"))
        try:
            return Response(200, self.handle(req.client_ip, req.path[len(PATH_PREFIX) :], req.body))
        except MeshrunError as err:
            return Response.error(http_status(err), err)
        except OSError as exc:  # the store's connection, should its client let one through: not this node's fault
            log.warning("rendezvous request for %s failed: %s", req.path, exc)
            return Response.error(
                503, CoordinatorError(f"this coordinator cannot reach its store now ({exc})", "try another coordinator")
            )

    def handle(self, caller_ip: str, job_id: str, body: object) -> dict:
        """One operation on job `job_id`'s rendezvous for the node at `caller_ip`; its answer.

        Raises UsageError (malformed, over a cap), AuthError (the caller is not one of the job's nodes,
        checked before the store is read), StateError (no such running job), and what the store raises.
        """
        if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
            raise UsageError(f"job id {str(job_id)[:80]!r} is not 1-64 of A-Z a-z 0-9 _ . -", "use the job's id")
        members = self.members_of(job_id)
        if members is None:
            raise StateError(f"no job {job_id!r} runs", "check the job id (`meshrun jobs`)")
        if caller_ip not in members:
            log.warning("refused a rendezvous request for job %s from %s: not one of its nodes", job_id, caller_ip)
            raise AuthError(
                f"{caller_ip} is not one of job {job_id!r}'s nodes",
                "only the job's own nodes take part in its rendezvous",
            )
        if not isinstance(body, dict):
            raise UsageError("a rendezvous request must be a JSON object", "use meshrun's rendezvous backend")
        op = self._ops.get(body.get("op")) if isinstance(body.get("op"), str) else None
        if op is None:
            raise UsageError(
                f"unknown rendezvous operation {str(body.get('op'))[:40]!r}", f"use one of {', '.join(self._ops)}"
            )
        return op(job_id, body)

    def forget(self, job_id: str) -> None:
        """Delete everything job `job_id`'s rendezvous stored: call it when the job ends, and before a job
        with a reused id starts (its agents would otherwise find the old, closed rendezvous)."""
        prefix = job_prefix(job_id)
        for key in self.kv.keys(prefix):
            self.kv.delete(key)

    # ------------------------------------------------------------------ the rendezvous state

    def _state_key(self, job_id: str) -> str:
        return job_prefix(job_id) + "state"

    def _state_answer(self, job_id: str) -> dict:
        cur = self.kv.get(self._state_key(job_id))
        if cur is None:
            return {"state": None, "token": None}
        return {"state": _b64(cur[0]), "token": str(cur[1])}

    def _get_state(self, job_id: str, body: dict) -> dict:
        return self._state_answer(job_id)

    def _set_state(self, job_id: str, body: dict) -> dict:
        state = _blob(body, "state")
        token = body.get("token")
        if token is None:
            version = 0
        elif isinstance(token, str):
            # Tokens are the versions this service handed out; anything else matches no stored state.
            version = int(token) if token.isascii() and token.isdigit() and len(token) <= 19 and int(token) > 0 else -1
        else:
            raise UsageError("set_state's token must be a string or null", "send the token get_state answered")
        written = version >= 0 and self.kv.put_if(self._state_key(job_id), state, version)
        # After a write the state read back may already be a later one (another node's, made on top of
        # ours): still a consistent state and token, which is all torch needs of the answer.
        return {**self._state_answer(job_id), "ok": bool(written)}

    # ------------------------------------------------------------------ the c10d store

    def _key(self, job_id: str, key: str) -> str:
        return job_prefix(job_id) + "store/" + key

    def _put(self, key: str, value: bytes) -> None:
        """Write unconditionally (the store offers compare-and-swap only)."""
        deadline = time.monotonic() + CAS_SECONDS
        while True:
            cur = self.kv.get(key)
            if self.kv.put_if(key, value, cur[1] if cur is not None else 0):
                return
            _contended(deadline, key)

    def _set(self, job_id: str, body: dict) -> dict:
        self._put(self._key(job_id, _store_key(body.get("key"))), _blob(body, "value"))
        return {}

    def _get(self, job_id: str, body: dict) -> dict:
        cur = self.kv.get(self._key(job_id, _store_key(body.get("key"))))
        return {"found": False} if cur is None else {"found": True, "value": _b64(cur[0])}

    def _add(self, job_id: str, body: dict) -> dict:
        key = self._key(job_id, _store_key(body.get("key")))
        amount = body.get("amount")
        if not isinstance(amount, int) or isinstance(amount, bool) or not -INT64 <= amount < INT64:
            raise UsageError("add's amount must be a 64-bit integer", "send e.g. {'amount': 1}")
        op_id = body.get("id")
        if op_id is not None and not (isinstance(op_id, str) and OP_ID_RE.match(op_id)):
            raise UsageError("add's id must be 8-64 of A-Z a-z 0-9 _ -", "send a random hex id, or none")
        done_key = job_prefix(job_id) + "adds/" + op_id if op_id else None
        if done_key is not None and (done := self.kv.get(done_key)) is not None:
            return {"value": int(done[0])}  # this add was counted already: its answer was lost
        deadline = time.monotonic() + CAS_SECONDS
        while True:
            cur = self.kv.get(key)
            try:
                new = (int(cur[0]) if cur is not None else 0) + amount
            except ValueError:
                raise UsageError(
                    f"store key {key.split('/store/', 1)[1][:80]!r} does not hold an integer", "add only to counters"
                ) from None
            if not -INT64 <= new < INT64:
                raise UsageError("add would overflow a 64-bit integer", "add to a smaller counter")
            if self.kv.put_if(key, str(new).encode(), cur[1] if cur is not None else 0):
                break
            _contended(deadline, key)
        if done_key is not None:
            self.kv.put_if(done_key, str(new).encode(), 0)
        return {"value": new}

    def _compare_set(self, job_id: str, body: dict) -> dict:
        # torch's Store.compare_set (TCPStore and HashStore alike): a missing key is created only when
        # `expected` is empty, and otherwise the answer is `expected` itself; an existing key is replaced
        # only when it holds `expected`. The answer is the key's value afterwards.
        key = self._key(job_id, _store_key(body.get("key")))
        expected, desired = _blob(body, "expected"), _blob(body, "desired")
        deadline = time.monotonic() + CAS_SECONDS
        while True:
            cur = self.kv.get(key)
            if cur is None:
                if expected:
                    return {"value": _b64(expected)}
                if self.kv.put_if(key, desired, 0):
                    return {"value": _b64(desired)}
            elif cur[0] != expected:
                return {"value": _b64(cur[0])}
            elif self.kv.put_if(key, desired, cur[1]):
                return {"value": _b64(desired)}
            _contended(deadline, key)

    def _check(self, job_id: str, body: dict) -> dict:
        keys = _store_keys(body.get("keys"))
        return {"ok": all(self.kv.get(self._key(job_id, k)) is not None for k in keys)}

    def _delete_key(self, job_id: str, body: dict) -> dict:
        key = self._key(job_id, _store_key(body.get("key")))
        if self.kv.get(key) is None:
            return {"deleted": False}
        self.kv.delete(key)
        return {"deleted": True}

    def _multi_get(self, job_id: str, body: dict) -> dict:
        values: list[str | None] = []
        size = 0
        for k in _store_keys(body.get("keys")):
            cur = self.kv.get(self._key(job_id, k))
            size += len(cur[0]) if cur is not None else 0
            if size > MAX_ANSWER:
                raise UsageError(f"multi_get's values come to over {MAX_ANSWER} bytes", "ask for fewer keys at once")
            values.append(_b64(cur[0]) if cur is not None else None)
        return {"values": values}

    def _multi_set(self, job_id: str, body: dict) -> dict:
        keys = _store_keys(body.get("keys"))
        raw = body.get("values")
        if not isinstance(raw, list) or len(raw) != len(keys):
            raise UsageError("multi_set needs as many values as keys", "send keys and values of equal length")
        values = [_decode(v, "values[]") for v in raw]
        if sum(map(len, values)) > MAX_VALUE:
            raise UsageError(f"multi_set's values come to over {MAX_VALUE} bytes", "send them in smaller batches")
        for k, v in zip(keys, values):
            self._put(self._key(job_id, k), v)
        return {}

    def _num_keys(self, job_id: str, body: dict) -> dict:
        return {"count": len(self.kv.keys(self._key(job_id, "")))}


def _contended(deadline: float, key: str) -> None:
    """After a lost compare-and-swap: pause a moment, or give up once `deadline` has passed."""
    if time.monotonic() > deadline:
        raise CoordinatorError(
            f"{key[:120]!r} changed under every compare-and-swap for {CAS_SECONDS:g} s", "retry (the agent does)"
        )
    time.sleep(0.001)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _decode(text: object, field: str) -> bytes:
    if not isinstance(text, str) or len(text) > (MAX_VALUE + 2) // 3 * 4:
        raise UsageError(f"{field} must be base64 of at most {MAX_VALUE} bytes", "send smaller values")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise UsageError(f"{field} is not base64", "encode bytes as standard base64") from None


def _blob(body: dict, field: str) -> bytes:
    return _decode(body.get(field), field)


def _store_key(key: object) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
        raise UsageError(f"a store key must be a string of 1-{MAX_KEY} characters", "use a shorter key")
    return key


def _store_keys(keys: object) -> list[str]:
    if not isinstance(keys, list) or len(keys) > MAX_BATCH:
        raise UsageError(f"keys must be a list of at most {MAX_BATCH} keys", "send larger sets in parts")
    return [_store_key(k) for k in keys]
