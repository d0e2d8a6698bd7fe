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
cannot parse, the job's store full: `OverBudget`), 403 AuthError (the caller is not one of the job's nodes),
404 StateError (no such running job), 429 `WriteRateExceeded` (the job wrote too much too fast: the agent
waits and retries), 503 any other meshrun error (the shared store cannot be read or written now, e.g. the etcd
client's ControlStateError, or a compare-and-swap lost for CAS_SECONDS: the agent tries another coordinator).

Budgets. The store is the coordinators' own control state: a job that could write without bound would fill
etcd's quota (its history keeps every overwritten value until a compaction) and stop every control write,
joins, removals and takeovers included. So each job gets, at each coordinator (`Budget`): at most JOB_KEYS
keys and JOB_BYTES live bytes (keys and values, read back from the store every USAGE_TTL_S and counted
here in between), and at most WRITE_BURST bytes written at once, refilled at WRITE_PER_S (every write,
overwrite and delete costs its key and value plus WRITE_OVERHEAD, what etcd keeps per revision besides).
What the budgets bound, and why it is enough for etcd, is argued at `Budget`.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from meshrun.core.jobspec import JOB_ID_RE
from meshrun.errors import AuthError, CoordinatorError, MeshrunError, StateError, UsageError
from meshrun.system.sockets.transport import MAX_JSON, Request, Response

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

MiB = 1024 * 1024
JOB_KEYS = 65536  # keys one job's rendezvous may hold
JOB_BYTES = 16 * MiB  # bytes (keys and values) one job's rendezvous may hold
WRITE_PER_S = 2 * MiB  # bytes a second one job may write at one coordinator, in the long run
WRITE_BURST = 32 * MiB  # ... and at once
WRITE_OVERHEAD = 128  # bytes etcd keeps per revision besides the key and value (revision, versions, lease)
USAGE_TTL_S = 10.0  # a job's keys and bytes are read back from the store this often (while it writes)


@dataclass(frozen=True)
class Budget:
    """What one job's rendezvous may keep in the shared store and write to it, at one coordinator.

    Why these bound etcd (meshrun.core.etcdconf: QUOTA_BYTES 1 GiB, which counts live data and the history
    not yet compacted). Live data: N jobs hold at most N * JOB_BYTES (16 MiB each). History: every
    coordinator's store client (meshrun.system.control.etcdjobs.EtcdKV) compacts etcd whenever it has written
    COMPACT_EVERY bytes of rendezvous (QUOTA_BYTES / 64, 16 MiB), back to where it was at its previous
    compaction, so at most 2 * COMPACT_EVERY of any one coordinator's rendezvous writes is ever uncompacted,
    however many jobs write: 7 coordinators leave at most 224 MiB, and with 8 flooding jobs holding their
    16 MiB each, under 360 MiB, well within half the quota. etcd's own compaction (every 5 minutes, keeping
    10000 revisions) cannot bound that alone: 10000 revisions of the largest value are 1.8 GB. The write rate
    bounds the rest: how hard a job can make etcd work and how often it compacts (at most every 8 s per
    flooding job at a coordinator), and with the key and byte caps how much of etcd's memory a job takes.

    torch's own rendezvous fits: for 1000 nodes its state is ~70 KiB and a round of its agent store ~6 keys
    and ~1.5 KiB a node (1.5 MiB in all, each round under a prefix of its own): JOB_BYTES holds ten rounds.
    The joins of 1000 nodes rewrite the state 1000 times (~35 MiB in all, within WRITE_BURST and a few seconds
    of WRITE_PER_S); its heartbeats, one whole state per node per interval, keep to half of WRITE_PER_S with
    the interval meshrun.jobs.rdzv_backend picks for the job's size (70 s for 1000 nodes, 5 s up to 260).
    """

    keys: int = JOB_KEYS
    live_bytes: int = JOB_BYTES
    per_s: float = WRITE_PER_S
    burst: int = WRITE_BURST


class OverBudget(UsageError):
    """A job's rendezvous holds as many keys or bytes as its `Budget` allows: answered 400 (waiting does not help)."""


class WriteRateExceeded(UsageError):
    """A job's rendezvous wrote more than its `Budget` allows for now: answered 429 (the agent waits and retries)."""


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

    def usage(self, prefix: str) -> tuple[int, int]:
        """(keys, bytes of keys and values) of every key that starts with `prefix`."""
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

    def usage(self, prefix: str) -> tuple[int, int]:
        with self._lock:
            sizes = [len(k.encode()) + len(v[0]) for k, v in self._data.items() if k.startswith(prefix)]
            return len(sizes), sum(sizes)


def http_status(err: MeshrunError) -> int:
    """The HTTP status `RendezvousService.handle`'s error is answered with."""
    if isinstance(err, AuthError):
        return 403
    if isinstance(err, StateError):
        return 404
    if isinstance(err, WriteRateExceeded):
        return 429
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
    Every job is held to `budget` (see `Budget`), its write rate on `clock`.
    """

    def __init__(
        self,
        kv: RendezvousKV,
        members_of: Callable[[str], Collection[str] | None],
        budget: Budget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self.members_of = members_of
        self.budget = budget or Budget()
        self.clock = clock
        self._usage: dict[str, _Usage] = {}
        self._usage_lock = threading.Lock()
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
        with self._usage_lock:
            self._usage.pop(job_id, None)

    # ------------------------------------------------------------------ the budget

    def _admit(self, job_id: str, writes: Sequence[tuple[str, int | None, int | None]]) -> None:
        """Charge job `job_id` for `writes`, each (store key, size of the value it replaces or None, size of the
        new value or None for a delete), before they are made; OverBudget or WriteRateExceeded (nothing
        charged) when they would take the job over its budget."""
        cost = sum(len(k.encode()) + (new or 0) + WRITE_OVERHEAD for k, _, new in writes)
        more_keys = sum((new is not None) - (old is not None) for _, old, new in writes)
        more_bytes = sum(
            (len(k.encode()) + new if new is not None else 0) - (len(k.encode()) + old if old is not None else 0)
            for k, old, new in writes
        )
        b = self.budget
        now = self.clock()
        with self._usage_lock:
            use = self._usage.get(job_id)
            if use is None:
                use = self._usage[job_id] = _Usage(0, 0, float("-inf"), float(b.burst), now)
                if len(self._usage) > 4096:  # jobs that ended without `forget` here: drop the idle ones
                    self._usage = {j: u for j, u in self._usage.items() if now - u.last < 600 or j == job_id}
        if now - use.read_at >= USAGE_TTL_S:
            # Read back what the job holds: other coordinators write to it too, and deletes and ended rounds
            # free room. Outside the lock (a store read); two refreshes at once only read twice.
            keys, size = self.kv.usage(job_prefix(job_id))
            with self._usage_lock:
                use.keys, use.bytes, use.read_at = keys, size, now
        with self._usage_lock:
            tokens = min(float(b.burst), use.tokens + (now - use.last) * b.per_s)
            use.tokens, use.last = tokens, now
            if more_keys > 0 and use.keys + more_keys > b.keys:
                self._refused(job_id, use, now, "keys", f"{b.keys} keys")
                raise OverBudget(
                    f"job {job_id}'s rendezvous holds {use.keys} keys, its limit is {b.keys}",
                    f"a legitimate job writes far fewer: cancel it (`meshrun cancel {job_id}`); its keys go with it",
                )
            if more_bytes > 0 and use.bytes + more_bytes > b.live_bytes:
                self._refused(job_id, use, now, "bytes", f"{_mib(b.live_bytes)} of keys and values")
                raise OverBudget(
                    f"job {job_id}'s rendezvous holds {_mib(use.bytes)}, its limit is {_mib(b.live_bytes)}",
                    f"a legitimate job writes far less: cancel it (`meshrun cancel {job_id}`); its keys go with it",
                )
            if cost > tokens:
                self._refused(job_id, use, now, "write rate", f"{_mib(b.burst)} at once, {_mib(b.per_s)}/s")
                raise WriteRateExceeded(
                    f"job {job_id}'s rendezvous wrote over {_mib(b.burst)} at once or {_mib(b.per_s)}/s at this "
                    "coordinator, its limit",
                    "wait and retry (the agent does); a legitimate job's heartbeats are spaced to stay within it "
                    "(meshrun.jobs.rdzv_backend.keep_alive_interval)",
                )
            use.tokens -= cost
            use.keys += more_keys
            use.bytes += more_bytes

    def _refused(self, job_id: str, use: _Usage, now: float, what: str, limit: str) -> None:
        """Count a refusal, and say so in the log at most once a minute per job (a flood must not fill it)."""
        use.refused += 1
        if now - use.logged >= 60:
            use.logged = now
            log.warning(
                "job %s's rendezvous is over its %s budget (%s): refused %d writes", job_id, what, limit, use.refused
            )

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
        written = False
        if version >= 0:
            key = self._state_key(job_id)
            cur = self.kv.get(key)
            if (cur[1] if cur is not None else 0) == version:  # else it cannot be written: nothing to charge
                self._admit(job_id, [(key, len(cur[0]) if cur is not None else None, len(state))])
                written = self.kv.put_if(key, state, version)
        # After a write the state read back may already be a later one (another node's, made on top of
        # ours): still a consistent state and token, which is all torch needs of the answer.
        return {**self._state_answer(job_id), "ok": bool(written)}

    # ------------------------------------------------------------------ the c10d store

    def _key(self, job_id: str, key: str) -> str:
        return job_prefix(job_id) + "store/" + key

    def _put(self, key: str, value: bytes, cur: tuple[bytes, int] | None) -> None:
        """Write unconditionally (the store offers compare-and-swap only), `cur` the key as last read."""
        deadline = time.monotonic() + CAS_SECONDS
        while True:
            if self.kv.put_if(key, value, cur[1] if cur is not None else 0):
                return
            _contended(deadline, key)
            cur = self.kv.get(key)

    def _set(self, job_id: str, body: dict) -> dict:
        key, value = self._key(job_id, _store_key(body.get("key"))), _blob(body, "value")
        cur = self.kv.get(key)
        self._admit(job_id, [(key, _size(cur), len(value))])
        self._put(key, value, cur)
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
        charged = False
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
            if not charged:  # once, with the counted add's own key: a lost compare-and-swap writes nothing
                writes = [(key, _size(cur), 20)] + ([(done_key, None, 20)] if done_key is not None else [])
                self._admit(job_id, writes)
                charged = True
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
        charged = False
        while True:
            cur = self.kv.get(key)
            if cur is not None and cur[0] != expected:
                return {"value": _b64(cur[0])}
            if cur is None and expected:
                return {"value": _b64(expected)}
            if not charged:
                self._admit(job_id, [(key, _size(cur), len(desired))])
                charged = True
            if self.kv.put_if(key, desired, cur[1] if cur is not None else 0):
                return {"value": _b64(desired)}
            _contended(deadline, key)

    def _check(self, job_id: str, body: dict) -> dict:
        keys = _store_keys(body.get("keys"))
        return {"ok": all(self.kv.get(self._key(job_id, k)) is not None for k in keys)}

    def _delete_key(self, job_id: str, body: dict) -> dict:
        key = self._key(job_id, _store_key(body.get("key")))
        cur = self.kv.get(key)
        if cur is None:
            return {"deleted": False}
        self._admit(job_id, [(key, len(cur[0]), None)])  # a delete is a revision too
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
        full = [self._key(job_id, k) for k in keys]
        curs = [self.kv.get(k) for k in full]
        self._admit(job_id, [(k, _size(c), len(v)) for k, c, v in zip(full, curs, values)])  # all or none
        for k, v, c in zip(full, values, curs):
            self._put(k, v, c)
        return {}

    def _num_keys(self, job_id: str, body: dict) -> dict:
        return {"count": len(self.kv.keys(self._key(job_id, "")))}


@dataclass
class _Usage:
    """One job's budget as a coordinator counts it: keys and bytes held (read back at `read_at`, counted
    since), write tokens left at `last`, and refusals (logged at `logged`)."""

    keys: int
    bytes: int
    read_at: float
    tokens: float
    last: float
    refused: int = 0
    logged: float = float("-inf")


def _size(cur: tuple[bytes, int] | None) -> int | None:
    return len(cur[0]) if cur is not None else None


def _mib(n: float) -> str:
    return f"{n / MiB:g} MiB"


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
