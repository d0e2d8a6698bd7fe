"""torchrun's rendezvous backend `meshrun`: c10d rendezvous at the coordinators, with every store on the overlay.

Registered for torchrun through the `torchrun.handlers` entry point (pyproject.toml), so a node's
torchrun runs ``--rdzv-backend meshrun``. It is torch's own c10d dynamic rendezvous
(`DynamicRendezvousHandler`) with one change, in two parts: the store the rank-0 node's torchrun agent
serves for its workers (`_create_tcp_store_server`, which torch binds to the wildcard) listens on this
node's overlay address and WireGuard device only ($MESHRUN_INTERFACE, set by meshrun's launch plan), and
it is made anew for every rendezvous round, so workers restarted after a membership change never read
the previous round's addresses. Workers reach it as before, at the address torchrun announces
(`--local-addr`, the overlay IP).

Where the rendezvous itself lives depends on ``--rdzv-conf``:

- without ``coordinators``: in the TCPStore the job's supervisor hosts on its coordinator
  (``--rdzv-endpoint IP:PORT``, ``is_host=0``), through torch's c10d backend.
- with ``coordinators=IP:PORT+IP:PORT+...`` (the coordinators' overlay API ports, '+' between them because
  torchrun splits ``--rdzv-conf`` at commas): at the coordinators' rendezvous API
  (meshrun.mesh.coordinator.rendezvous, ``POST /v1/rdzv/<job id>``), whose state every coordinator shares,
  so the job outlives the coordinator that started it. The job id is torchrun's ``--rdzv-id``. A request
  goes to the coordinator that answered last; one that cannot be reached within ``call_timeout`` seconds
  (3), or answers 429, 502, 503 or 504, passes it to the next, round after round with a short pause, for
  ``failover_timeout`` seconds (60) in all; any other error answer is final. ``read_timeout`` (60) is how
  long the store's get and wait wait for a key by default. The coordinators hold each job to a write budget
  (meshrun.mesh.coordinator.rendezvous.Budget) and torch's every heartbeat rewrites the whole state (~72
  bytes a node), so a job of more than 260 nodes sends its heartbeats less often than torch's 5 s by default
  (`keep_alive_interval`: 70 s for 1000 nodes); ``keep_alive_interval`` in ``--rdzv-conf`` overrides it.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta, timezone

from meshrun.core.jobspec import JOB_ID_RE
from meshrun.core.model import STORE_PORTS
from meshrun.errors import CoordinatorError, MeshrunError, UsageError
from meshrun.jobs.share import STATE_ENV, Regroup, read_regroup
from meshrun.mesh import member
from meshrun.mesh.coordinator.rendezvous import MAX_VALUE, PATH_PREFIX, WRITE_PER_S
from meshrun.system.files.statedir import StateDir
from meshrun.system.sockets import transport

log = logging.getLogger("meshrun.jobs.rdzv_backend")

BACKEND = "meshrun"
CALL_TIMEOUT = 3  # seconds one attempt at one coordinator may take
FAILOVER_TIMEOUT = 60  # seconds a request keeps trying the coordinators
READ_TIMEOUT = 60  # seconds the store's get and wait wait for a key (torch's c10d backend's default)
RETRY_STATUSES = frozenset({429, 502, 503, 504})  # that coordinator cannot answer now; another may
PAUSE_FIRST, PAUSE_MAX = 0.2, 2.0  # between rounds over every coordinator
POLL_FIRST, POLL_MAX = 0.05, 0.5  # between looks for a key someone else has yet to set
BATCH = 256  # keys per request (the server takes up to 1024; long keys must still fit a request body)
KEEP_ALIVE = 5  # torch's heartbeat interval (seconds), kept for jobs small enough
STATE_PER_NODE, STATE_BASE = 72, 1024  # bytes of torch's pickled rendezvous state: per node, and besides


def keep_alive_interval(max_nodes: int) -> int:
    """Seconds between one node's heartbeats in a job of up to `max_nodes` whose rendezvous is at the
    coordinators: torch's 5 s, or longer where the heartbeats of every node together (each rewrites the whole
    state) would write more than half the job's budget at a coordinator (`WRITE_PER_S`)."""
    nodes = max(1, max_nodes)
    per_round = nodes * (STATE_PER_NODE * nodes + STATE_BASE)
    return max(KEEP_ALIVE, math.ceil(per_round / (WRITE_PER_S / 2)))


SYNC_POLL_PER_NODE_S, SYNC_POLL_MIN_S = 0.01, 0.1  # see sync_poll_s


def sync_poll_s(max_nodes: int) -> float:
    """Seconds between a waiting node's looks at the rendezvous state in a job of up to `max_nodes`: torch's
    1 s from 100 nodes on, down to SYNC_POLL_MIN_S for small jobs. Every wait of a re-forming group (leave the
    last round, join, wait for the others) costs at least one of these, and each is a second of every
    survivor's standstill after a loss; the looks are reads, about max_nodes / poll a second (at most 100 below
    100 nodes), where torch's own rate takes over."""
    return min(1.0, max(SYNC_POLL_MIN_S, SYNC_POLL_PER_NODE_S * max(1, max_nodes)))


def poll_faster(dr, poll_s: float) -> bool:
    """Make torch's rendezvous executor (module `dr`, torch's dynamic_rendezvous) wait `poll_s` where it waits
    its fixed second for other nodes' changes (its SYNC action: `_delay(seconds=1)`); its other, random delays
    stay. False (nothing changed) where this torch has no such module-level `_delay`."""
    original = getattr(dr, "_meshrun_original_delay", None) or getattr(dr, "_delay", None)
    if original is None:
        return False

    def delay(seconds) -> None:
        original(poll_s if seconds == 1 else seconds)

    dr._meshrun_original_delay = original
    dr._delay = delay
    return True


def handler_factory():
    """The `torchrun.handlers` entry point: torch calls it and registers what it returns."""
    return create_handler


def create_handler(params):
    """torch.distributed.elastic's dynamic rendezvous handler, with an overlay-bound agent store.

    `params` is torchrun's RendezvousParameters; with ``coordinators`` in its configuration the rendezvous
    is kept at the coordinators (see the module's docstring), else in the TCPStore at ``--rdzv-endpoint``.
    """
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    class OverlayRendezvousHandler(dr.DynamicRendezvousHandler):
        def get_backend(self) -> str:
            return BACKEND

        def _create_tcp_store_server(self, master_addr, master_port):
            return agent_store(master_addr, master_port)

        def next_rendezvous(self):
            # torch keeps the first round's agent store for every later round (pytorch/pytorch#135712):
            # after a restart the workers read the previous attempt's addresses from it, and when the
            # rank-0 node was the one lost, every survivor still points at it. A store per round, its
            # address published under that round's prefix, avoids both; the old one closes with it.
            self._shared_tcp_store_server = None
            self._bootstrap_store_info = None
            return super().next_rendezvous()

    if params.get("coordinators"):
        backend, store = coordinators_backend(params)
    else:
        backend, store = c10d_rendezvous_backend.create_backend(params)
    # What dynamic_rendezvous.create_handler does, building our subclass instead.
    timeout = dr.RendezvousTimeout(
        dr._get_timeout(params, "join"),
        dr._get_timeout(params, "last_call"),
        dr._get_timeout(params, "close"),
        dr._get_timeout(params, "heartbeat"),
    )
    handler = OverlayRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int(
            "keep_alive_interval", keep_alive_interval(params.max_nodes) if params.get("coordinators") else KEEP_ALIVE
        ),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )
    job_dir = os.environ.get("MESHRUN_JOB_DIR")
    if job_dir:
        follow_regroups(handler, functools.partial(read_regroup, job_dir))
    poll_faster(dr, sync_poll_s(params.max_nodes))
    return handler


def follow_regroups(handler, regroup: Callable[[], Regroup]) -> bool:
    """Make `handler` act on the supervisor's regroups (meshrun.jobs.share.Regroup) each time it syncs.

    Two waits of torch's are cut. torch drops a node whose heartbeats stopped only after
    keep_alive_interval x keep_alive_max_attempt (15 s at its defaults), and a finished round starts again
    only once every participant of it left: a node at a lost address whose last heartbeat is older than the
    loss is dead to the state holder's sanitizing at once, which removes it as torch would have (a node back
    at that address is a new torchrun with newer heartbeats, and stays). And an elastic round that reached
    MIN waits out its last call (ELASTIC_LAST_CALL_S) for more nodes: once every node of the re-formed group
    (`members`) has joined, no other is coming, so its deadline is moved to now and the next join step
    completes it (torch's own MARK_RENDEZVOUS_COMPLETE, written back with the state).

    Uses torch's private state holder (`_state_holder._sanitize`, `_state`, `_settings`); where those are
    not there (another torch), nothing changes and False is returned: torch's own timeouts still apply."""
    holder = getattr(handler, "_state_holder", None)
    sanitize = getattr(holder, "_sanitize", None)
    if sanitize is None or not hasattr(holder, "_state"):
        log.warning("this torch's rendezvous has no state holder to sanitize: lost nodes leave it by timeout")
        return False

    def sanitize_with_regroup() -> None:
        note = regroup()
        state = holder._state
        beats = getattr(state, "last_heartbeats", None)
        if note.lost and isinstance(beats, dict):
            for node, beat in list(beats.items()):
                at = note.lost.get(getattr(node, "addr", None))
                if at is None:
                    continue
                if (beat if beat.tzinfo else beat.replace(tzinfo=timezone.utc)).timestamp() < at:
                    beats[node] = beat - timedelta(days=365)  # long expired: sanitize removes it
        sanitize()
        expected = note.expected(time.time())
        deadline = getattr(state, "deadline", None)
        if expected and deadline is not None and not state.complete:
            joined = {getattr(node, "addr", None) for node in state.participants}
            if expected <= joined and len(state.participants) >= holder._settings.min_nodes:
                state.deadline = min(deadline, datetime.now(timezone.utc) - timedelta(microseconds=1))

    holder._sanitize = sanitize_with_regroup
    return True


def agent_store(addr: str, port: int | None):
    """torchrun's agent store (the workers' MASTER_ADDR:MASTER_PORT) on the node's overlay address and device.

    At `port` when torch names one; else at the first free port of the network's stores' range (above its
    rdzv_port, from the member's state), where the job guard refuses a connection of no job's process made over
    loopback: nft's loopback lookup misses a socket bound to the overlay device (core/firewall). Anywhere else
    (an ephemeral port) when there is no state or the range is full."""
    from meshrun.system.sockets.tcpstore import serve_store, serve_store_in

    device = os.environ.get("MESHRUN_INTERFACE")
    if not port:
        state = os.environ.get(STATE_ENV)
        ports: range = range(0)
        if state:
            try:
                rdzv_port = member.load(StateDir(state))[1].rdzv_port
                ports = range(rdzv_port + 1, rdzv_port + STORE_PORTS)
            except MeshrunError:
                pass
        store = serve_store_in(addr, ports, device, multi_tenant=True)
        if store is not None:
            return store
    return serve_store(addr, port or 0, device, multi_tenant=True)


def coordinators_backend(params):
    """(RendezvousBackend, Store) at the coordinators that torchrun's ``--rdzv-conf`` names."""
    state = os.environ.get(STATE_ENV)
    client = Coordinators(
        parse_coordinators(params.get("coordinators", "")),
        params.run_id,
        call_timeout=_positive(params, "call_timeout", CALL_TIMEOUT),
        failover_timeout=_positive(params, "failover_timeout", FAILOVER_TIMEOUT),
        # Signed with the member's key (root reads it): the coordinators refuse a rendezvous write that is not.
        key_for=member.OverlayKeys(StateDir(state)).by_ip if state else None,
    )
    read_timeout = timedelta(seconds=_positive(params, "read_timeout", READ_TIMEOUT))
    return coordinator_backend(client), coordinator_store(client, read_timeout)


def _positive(params, key: str, default: int) -> int:
    value = params.get_as_int(key, default)
    if value is None or value <= 0:
        raise UsageError(f"--rdzv-conf {key}={value} is not a positive number of seconds", f"e.g. {key}={default}")
    return value


def parse_coordinators(text: str) -> list[tuple[str, int]]:
    """``IP:PORT+IP:PORT+...`` (an IPv6 address in brackets) as [(host, port)], in order; UsageError if garbled."""
    out = []
    for item in text.split("+"):
        host, sep, port = item.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise UsageError(
                f"--rdzv-conf coordinators={text!r} is not IP:PORT+IP:PORT+...",
                "name each coordinator's overlay IP and API port, e.g. coordinators=10.77.0.1:51821+10.77.0.5:51821",
            )
        out.append((host, int(port)))
    return out


class Coordinators:
    """One job's rendezvous requests to the coordinators (`POST /v1/rdzv/<job_id>`), failing over between them.

    `request(body)` returns the first answer: it starts at the coordinator that answered last and moves on
    when one cannot be reached in `call_timeout` seconds or answers a status in RETRY_STATUSES, pausing
    between rounds, for `failover_timeout` seconds in all; then CoordinatorError (its `status` None). Any
    other error answer is raised at once, as the class the coordinator named (with its `status`).
    Thread-safe: torch's heartbeat timer and the agent call it at once.
    """

    def __init__(
        self,
        addrs: Sequence[tuple[str, int]],
        job_id: str,
        *,
        call_timeout: float = CALL_TIMEOUT,
        failover_timeout: float = FAILOVER_TIMEOUT,
        call: Callable[..., dict] = transport.call,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        key_for: Callable[[str], bytes | None] | None = None,
    ) -> None:
        if not addrs:
            raise UsageError("no coordinator to rendezvous at", "pass --rdzv-conf coordinators=IP:PORT+...")
        if not JOB_ID_RE.match(job_id or ""):
            raise UsageError(
                f"--rdzv-id {job_id!r} is not a meshrun job id", "use the job's id (1-64 of A-Z a-z 0-9 _ . -)"
            )
        self.addrs = list(addrs)
        self.job_id = job_id
        self.path = PATH_PREFIX + job_id
        self.call_timeout, self.failover_timeout = call_timeout, failover_timeout
        self._call, self._sleep, self._clock = call, sleep, clock
        self._key_for = key_for  # a coordinator's overlay key by its address (meshrun.mesh.member.OverlayKeys.by_ip)
        self._current = 0  # index of the coordinator that answered last
        self._lock = threading.Lock()

    def request(self, body: dict) -> dict:
        """The answer to one rendezvous operation (see meshrun.mesh.coordinator.rendezvous)."""
        deadline = self._clock() + self.failover_timeout
        pause = PAUSE_FIRST
        while True:
            with self._lock:
                first = self._current
            last: MeshrunError | None = None
            for step in range(len(self.addrs)):
                index = (first + step) % len(self.addrs)
                host, port = self.addrs[index]
                try:
                    signed = {"key": self._key_for(host)} if self._key_for is not None else {}
                    answer = self._call(host, port, "POST", self.path, body, timeout=self.call_timeout, **signed)
                except MeshrunError as err:
                    if err.status is not None and err.status not in RETRY_STATUSES:
                        raise
                    last = err
                    continue
                with self._lock:
                    if self._current != index:
                        log.warning("job %s's rendezvous: now at coordinator %s:%d (%s)", self.job_id, host, port, last)
                    self._current = index
                return answer
            left = deadline - self._clock()
            if left <= 0:
                raise CoordinatorError(
                    f"no coordinator answered job {self.job_id}'s rendezvous for {self.failover_timeout:g} s "
                    f"(last: {last})",
                    "check that the coordinators run (`meshrun status` on one) and that this node reaches them",
                )
            self._sleep(min(pause, left))
            pause = min(pause * 2, PAUSE_MAX)


def coordinator_store(client: Coordinators, timeout: timedelta = timedelta(seconds=READ_TIMEOUT)):
    """A torch.distributed.Store whose keys live at the coordinators, in `client`'s job; get and wait poll.

    torch's agent uses set, get, multi_get, multi_set, add and wait (through a PrefixStore); compare_set,
    check, delete_key and num_keys work too. A key not there by the timeout raises DistStoreError as
    TCPStore does; a coordinator's refusal, or none answering, raises the meshrun error `client` raised.
    """
    return _torch_types()[0](client, timeout)


def coordinator_backend(client: Coordinators):
    """torch's RendezvousBackend for `client`'s job: its state and fencing token at the coordinators.

    Raises RendezvousConnectionError when no coordinator answered, RendezvousError when one refused (the
    meshrun error is its __cause__), RendezvousStateError for an answer that is not base64.
    """
    return _torch_types()[1](client)


@functools.cache
def _torch_types() -> tuple[type, type]:
    # torch is imported here, not with the module: torchrun loads this module (the entry point) while its
    # rendezvous package is still being imported, and an import error there would drop the backend silently.
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    class CoordinatorStore(_StoreOps, Store):
        def __init__(self, client: Coordinators, timeout: timedelta) -> None:
            Store.__init__(self)  # the C++ half, through which a PrefixStore calls us
            self._client = client
            self.set_timeout(timeout)

    class CoordinatorBackend(_BackendOps, RendezvousBackend):
        def __init__(self, client: Coordinators) -> None:
            self._client = client

    return CoordinatorStore, CoordinatorBackend


class _StoreOps:
    """torch.distributed.Store's operations over the coordinators' API (mixed into a Store by `_torch_types`).

    torch's PrefixStore (every store dynamic_rendezvous hands out is one) calls a Python store through
    pybind11 by the C++ method names, so delete_key and num_keys are also deleteKey and getNumKeys; the
    others have the same name on both sides. Values arrive as bytes from C++ and as str or bytes from Python.
    """

    _client: Coordinators
    timeout: timedelta  # Store's

    def set(self, key: str, value: bytes | str) -> None:
        self._client.request({"op": "set", "key": key, "value": _b64(value)})

    def get(self, key: str) -> bytes:
        def look() -> bytes | None:
            answer = self._client.request({"op": "get", "key": key})
            return _unb64(answer.get("value")) if answer.get("found") is True else None

        return self._poll(look, [key], self.timeout)

    def multi_get(self, keys: Iterable[str]) -> list[bytes]:
        keys = list(keys)
        got: dict[int, bytes] = {}

        def look() -> list[bytes] | None:
            missing = [i for i in range(len(keys)) if i not in got]
            for part in _parts(missing, BATCH):
                values = self._client.request({"op": "multi_get", "keys": [keys[i] for i in part]}).get("values")
                if not isinstance(values, list) or len(values) != len(part):
                    raise CoordinatorError("a coordinator answered multi_get oddly", "use one meshrun everywhere")
                got.update((i, _unb64(v)) for i, v in zip(part, values) if v is not None)
            return [got[i] for i in range(len(keys))] if len(got) == len(keys) else None

        return self._poll(look, keys, self.timeout)

    def multi_set(self, keys: Iterable[str], values: Iterable[bytes | str]) -> None:
        keys, blobs = list(keys), [_bytes(v) for v in values]
        if len(keys) != len(blobs):
            raise UsageError("multi_set needs as many values as keys", "pass lists of equal length")
        start = 0
        while start < len(keys):
            # As many as fit one request: BATCH keys and MAX_VALUE bytes (a larger value goes alone; refused).
            end, size = start, 0
            while end < len(keys) and end - start < BATCH and (end == start or size + len(blobs[end]) <= MAX_VALUE):
                size += len(blobs[end])
                end += 1
            body = {"op": "multi_set", "keys": keys[start:end], "values": [_b64(b) for b in blobs[start:end]]}
            self._client.request(body)
            start = end

    def add(self, key: str, amount: int) -> int:
        # The id makes a retried add (its answer lost with a coordinator) count once.
        body = {"op": "add", "key": key, "amount": int(amount), "id": uuid.uuid4().hex}
        return int(self._client.request(body)["value"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        body = {"op": "compare_set", "key": key, "expected": _b64(expected), "desired": _b64(desired)}
        return _unb64(self._client.request(body).get("value"))

    def check(self, keys: Iterable[str]) -> bool:
        keys = list(keys)
        return all(
            self._client.request({"op": "check", "keys": part}).get("ok") is True for part in _parts(keys, BATCH)
        )

    def wait(self, keys: Iterable[str], timeout: timedelta | None = None) -> None:
        keys = list(keys)
        self._poll(lambda: True if self.check(keys) else None, keys, self.timeout if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:
        return self._client.request({"op": "delete_key", "key": key}).get("deleted") is True

    def num_keys(self) -> int:
        return int(self._client.request({"op": "num_keys"})["count"])

    deleteKey = delete_key  # the names PrefixStore calls
    getNumKeys = num_keys

    def _poll(self, look: Callable[[], object], keys: list[str], timeout: timedelta):
        """What `look()` returns once it is not None, looking again after a pause (growing to POLL_MAX)
        until `timeout`; then DistStoreError, as TCPStore raises."""
        from torch.distributed import DistStoreError

        deadline = time.monotonic() + timeout.total_seconds()
        pause = POLL_FIRST
        while True:
            found = look()
            if found is not None:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistStoreError(f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: {keys}")
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX)


class _BackendOps:
    """torch's RendezvousBackend over the coordinators' API (mixed into one by `_torch_types`)."""

    _client: Coordinators

    @property
    def name(self) -> str:
        return "meshrun-coordinators"

    def get_state(self) -> tuple[bytes, str] | None:
        return self._pair(self._call({"op": "get_state"}))

    def set_state(self, state: bytes, token: object = None) -> tuple[bytes, str, bool] | None:
        if token is not None and not isinstance(token, str):
            pair = self.get_state()  # not a token of ours: it cannot match (torch's c10d backend does this too)
            return None if pair is None else (*pair, False)
        answer = self._call({"op": "set_state", "state": _b64(state), "token": token})
        pair = self._pair(answer)
        return None if pair is None else (*pair, answer.get("ok") is True)

    def _call(self, body: dict) -> dict:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError

        try:
            return self._client.request(body)
        except MeshrunError as err:
            # torch's heartbeat timer catches RendezvousError only: anything else would end its thread.
            raise (RendezvousConnectionError if err.status is None else RendezvousError)(str(err)) from err

    @staticmethod
    def _pair(answer: dict) -> tuple[bytes, str] | None:
        from torch.distributed.elastic.rendezvous.api import RendezvousStateError

        if answer.get("state") is None:
            return None
        try:
            return _unb64(answer["state"]), str(answer["token"])
        except (KeyError, CoordinatorError) as exc:
            raise RendezvousStateError("a coordinator answered a garbled rendezvous state") from exc


def _parts(items: list, size: int) -> Iterable[list]:
    return (items[i : i + size] for i in range(0, len(items), size))


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _b64(value: bytes | str) -> str:
    return base64.b64encode(_bytes(value)).decode("ascii")


def _unb64(text: object) -> bytes:
    try:
        if not isinstance(text, str):
            raise ValueError(text)
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise CoordinatorError(
            "a coordinator answered a value that is not base64", "use one meshrun everywhere"
        ) from None
