"""A job's replicated record, when several coordinators share the network's state in etcd.

Every coordinator runs a supervisor for every live job (meshrun.jobs.supervisor): the one that owns the job
drives it, the others follow its shares' output into their own copy of its logs, and one of them takes it
over when the owner is gone. What they share lives here, under JOBS/<job id>/:

  spec       the JobSpec as submitted (created once: a job id is unique across coordinators)
  record     the JobRecord (state, nodes, verdict), written by the owner
  owner      the owning supervisor's fence ("<coordinator>/<nonce>"), held with its lease: it vanishes
             OWNER_TTL_S after the owner's machine does, and the first standby to create it again owns the job.
             It is created with the spec: the submitting coordinator's job control keeps it alive until the
             job's supervisor has adopted it, so no standby takes a job whose supervisor is still starting
  events/N   the owner's own lines (what `meshrun train` and `meshrun logs` show besides the nodes' output)
  code/N     the code as shipped, in slices (an elastic job ships the same to a node that joins later)
  allowed    the overlay addresses of the job's nodes: who may use its rendezvous (meshrun.mesh.coordinator.rendezvous)
  cancel     present once `meshrun cancel` asked (on any coordinator)
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time

from meshrun.core.etcdconf import QUOTA_BYTES
from meshrun.core.jobspec import JobRecord
from meshrun.errors import ControlStateError, UsageError
from meshrun.system.control.etcd import Compare, Put
from meshrun.system.control.etcdstate import PREFIX

log = logging.getLogger("meshrun.system.control.etcdjobs")

JOBS = PREFIX + b"jobs/"
INDEX = PREFIX + b"joblist/"  # one small key per job: listing the jobs never reads their code
OWNER_TTL_S = 5
CODE_SLICE = 512 * 1024  # etcd takes requests up to 1.5 MiB (base64 in JSON makes 4/3 of it)
CODE_LIMIT = 32 * 1024 * 1024  # larger code is not replicated: a job that took over cannot ship it to a new node
MAX_EVENTS = 10_000


def job_ids(client) -> list[str]:
    """Every job the store knows, by id."""
    kvs, _ = client.get_prefix(INDEX)
    return sorted(kv.key[len(INDEX) :].decode() for kv in kvs)


def job_allowed(client, job_id: str) -> list[str] | None:
    """The overlay addresses that may use the job's rendezvous; None when there is no such running job."""
    kv = client.get(JOBS + job_id.encode() + b"/allowed")
    rec = client.get(JOBS + job_id.encode() + b"/record")
    if kv is None or rec is None or JobRecord.from_dict(json.loads(rec.value)).final:
        return None
    return [str(ip) for ip in json.loads(kv.value)]


class JobReplica:
    """One job's keys (see the module docstring), seen by coordinator `who`'s supervisor."""

    def __init__(self, client, job_id: str, who: str) -> None:
        self.client = client
        self.job_id = job_id
        self.base = JOBS + job_id.encode() + b"/"
        self.fence = f"{who}/{secrets.token_hex(6)}".encode()
        self.lease = 0
        self.owning = False
        self.renewed = 0.0
        self.stop = threading.Event()
        self.keeper: threading.Thread | None = None
        self.events_seq = 0

    def _k(self, name: str) -> bytes:
        return self.base + name.encode()

    # submission and the record -------------------------------------------------
    def create(self, spec: dict, record: JobRecord) -> None:
        """The job's spec and first record, owned by this replica from the first revision (no standby can take a
        job whose supervisor is still starting); UsageError when another coordinator has a job of this id.

        The caller keeps the ownership alive (`keep`) until the job's supervisor has taken it (`handover`,
        then `adopt` there), and lets go with `detach` (ownership stays) or `release` (it ends)."""
        lease = self.client.lease_grant(OWNER_TTL_S)
        res = self.client.txn(
            [Compare(self._k("spec"), "CREATE", "EQUAL", 0)],
            [
                Put(self._k("spec"), json.dumps(spec).encode()),
                Put(self._k("record"), _dump(record)),
                Put(INDEX + self.job_id.encode(), b"1"),
                Put(self._k("owner"), self.fence, lease),
            ],
        )
        if not res.succeeded:
            self.client.lease_revoke(lease)
            raise UsageError(f"job {self.job_id!r} exists already", "pick another --job-id")
        self.lease, self.owning, self.renewed = lease, True, time.monotonic()

    def handover(self) -> dict:
        """What another process needs to own the job in this replica's place (`adopt`)."""
        return {"fence": self.fence.decode(), "lease": self.lease}

    def adopt(self, handover: dict) -> bool:
        """Own the job with the fence and lease another process created it with (`handover`), kept alive from
        here on; whether that ownership still holds."""
        fence = str(handover.get("fence", "")).encode()
        kv = self.client.get(self._k("owner"))
        if kv is None or kv.value != fence:
            return False
        self.fence, self.lease = fence, int(handover.get("lease", 0))
        self.owning, self.renewed = True, time.monotonic()
        self.keep()
        return True

    def detach(self) -> None:
        """Stop keeping the ownership alive here without giving it up (the process that adopted it keeps it)."""
        self.stop.set()
        if self.keeper is not None:
            self.keeper.join(timeout=5)
        self.lease, self.owning = 0, False

    def spec(self) -> dict | None:
        kv = self.client.get(self._k("spec"))
        return json.loads(kv.value) if kv is not None else None

    def record(self) -> JobRecord | None:
        kv = self.client.get(self._k("record"))
        return JobRecord.from_dict(json.loads(kv.value)) if kv is not None else None

    def save(self, record: JobRecord) -> None:
        """The record, written only while this supervisor owns the job (compared with its fence)."""
        res = self.client.txn(
            [Compare(self._k("owner"), "VALUE", "EQUAL", self.fence)], [Put(self._k("record"), _dump(record))]
        )
        if not res.succeeded:
            self.owning = False
            raise ControlStateError(
                f"job {self.job_id}: this supervisor no longer owns it; its record was not written",
                "nothing to do: the coordinator that took it over writes it",
            )

    # ownership -------------------------------------------------------------------
    def own(self) -> bool:
        """Take the job if nobody owns it (a new lease, kept alive by a thread); whether this one owns it."""
        if self.owning:
            return True
        if self.client.get(self._k("owner")) is not None:
            return False
        self.lease = self.client.lease_grant(OWNER_TTL_S)
        res = self.client.txn(
            [Compare(self._k("owner"), "CREATE", "EQUAL", 0)], [Put(self._k("owner"), self.fence, self.lease)]
        )
        if not res.succeeded:  # another standby was quicker: this lease holds nothing
            self.client.lease_revoke(self.lease)
            self.lease = 0
            return False
        self.owning, self.renewed = True, time.monotonic()
        self.keep()
        return True

    def keep(self) -> None:
        """Keep this replica's ownership lease alive, in a thread, until `release` or `detach`."""
        if self.keeper is None:
            self.keeper = threading.Thread(target=self._keep, name="job-lease", daemon=True)
            self.keeper.start()

    def _keep(self) -> None:
        while not self.stop.wait(1.0):
            try:
                if self.client.lease_keepalive(self.lease) > 0:
                    self.renewed = time.monotonic()
                    continue
                log.warning("job %s: the ownership lease ran out", self.job_id)
            except ControlStateError as exc:
                if time.monotonic() - self.renewed < OWNER_TTL_S - 1:
                    continue
                log.warning("job %s: cannot keep ownership (%s)", self.job_id, exc)
            self.owning = False
            self.lease = 0
            return

    def owner(self) -> str | None:
        """The owning coordinator's name; None while nobody owns the job."""
        kv = self.client.get(self._k("owner"))
        return kv.value.decode().split("/", 1)[0] if kv is not None else None

    def release(self) -> None:
        """Give the job up (its end, or a clean stop of this coordinator: another takes it at once)."""
        self.stop.set()
        if self.lease:
            try:
                self.client.lease_revoke(self.lease)
            except ControlStateError as exc:
                log.warning("job %s: could not give up ownership (%s)", self.job_id, exc)
        self.lease, self.owning = 0, False

    # the owner's lines -------------------------------------------------------------
    def event(self, line: str) -> None:
        self.events_seq += 1
        key = self._k(f"events/{int(time.time() * 1000):013d}-{self.events_seq:08d}-{secrets.token_hex(3)}")
        self.client.put(key, line.encode())

    def events(self, after: bytes = b"") -> list[tuple[bytes, str]]:
        """The owner's lines after key `after`, in order: [(key, line)]."""
        kvs, _ = self.client.get_prefix(self._k("events/"))
        return [(kv.key, kv.value.decode()) for kv in kvs if kv.key > after][:MAX_EVENTS]

    # the code ------------------------------------------------------------------------
    def put_code(self, blob: bytes) -> bool:
        """The shipped code, in slices; False (nothing written) when it is over CODE_LIMIT."""
        if len(blob) > CODE_LIMIT:
            return False
        self.client.delete(self._k("code/"), prefix=True)
        ops = [
            Put(self._k(f"code/{i // CODE_SLICE:06d}"), blob[i : i + CODE_SLICE])
            for i in range(0, len(blob), CODE_SLICE)
        ]
        for i in range(0, len(ops), 2):  # two slices a request at most
            self.client.txn([], ops[i : i + 2])
        return True

    def drop_code(self) -> None:
        """The job ended: its code is not shipped again (the record and the owner's lines stay)."""
        self.client.delete(self._k("code/"), prefix=True)

    def code(self) -> bytes | None:
        kvs, _ = self.client.get_prefix(self._k("code/"))
        return b"".join(kv.value for kv in kvs) if kvs else None

    # who may rendezvous, cancelling ----------------------------------------------------
    def allow(self, ips: list[str]) -> None:
        self.client.put(self._k("allowed"), json.dumps(sorted(set(ips))).encode())

    def request_cancel(self) -> None:
        self.client.put(self._k("cancel"), b"1")

    def cancel_requested(self) -> bool:
        return self.client.get(self._k("cancel")) is not None


def _dump(record: JobRecord) -> bytes:
    return json.dumps(record.to_dict()).encode()


RDZV_ROOT = PREFIX  # the rendezvous service's keys ("rdzv/<job>/...") live under it
# etcd is compacted after this many bytes of rendezvous writes through one client (see `EtcdKV`): with up to 7
# coordinators at most 14 times this (224 MiB) of their rendezvous writes is uncompacted at any time.
COMPACT_EVERY = QUOTA_BYTES // 64
WRITE_OVERHEAD = 128  # bytes etcd keeps per revision besides the key and value


class EtcdKV:
    """meshrun.mesh.coordinator.rendezvous.RendezvousKV over etcd: a key's version is its mod revision, and
    `put_if` a transaction comparing it (0: the key must not exist).

    etcd keeps every overwritten value until it is compacted, and its own compactor keeps 10000 revisions
    whatever their size: rendezvous writes alone could fill its quota between compactions. So this client
    counts the bytes it writes, and after every `compact_every` of them compacts etcd back to the revision
    at which it last did so: of its writes, at most 2 * `compact_every` (and one write) stay uncompacted.
    A watcher that falls further behind reads the state anew (meshrun.system.control.etcd.Compacted), as it does
    after etcd's own compaction.
    """

    def __init__(self, client, root: bytes = RDZV_ROOT, compact_every: int = COMPACT_EVERY) -> None:
        self.client, self.root = client, root
        self.compact_every = compact_every
        self._written = 0  # bytes written since the last compaction (or the start)
        self._mark = 0  # the revision of the last compaction's trigger: the next compacts to it
        self._last = 0  # the latest revision of a write of ours
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bytes, int] | None:
        kv = self.client.get(self.root + key.encode())
        return (kv.value, kv.mod_revision) if kv is not None else None

    def put_if(self, key: str, value: bytes, version: int) -> bool:
        k = self.root + key.encode()
        cmp = Compare(k, "CREATE", "EQUAL", 0) if version == 0 else Compare(k, "MOD", "EQUAL", version)
        res = self.client.txn([cmp], [Put(k, value)])
        if res.succeeded:
            self._wrote(len(k) + len(value), res.revision)
        return res.succeeded

    def delete(self, key: str) -> None:
        k = self.root + key.encode()
        if self.client.delete(k):
            self._wrote(len(k), 0)

    def keys(self, prefix: str) -> list[str]:
        kvs, _ = self.client.get_prefix(self.root + prefix.encode())
        return [kv.key[len(self.root) :].decode() for kv in kvs]

    def usage(self, prefix: str) -> tuple[int, int]:
        kvs, _ = self.client.get_prefix(self.root + prefix.encode())
        return len(kvs), sum(len(kv.key) + len(kv.value) for kv in kvs)

    def _wrote(self, size: int, revision: int) -> None:
        """Count a write (at `revision`, 0 if unknown); compact when `compact_every` bytes have been written."""
        with self._lock:
            self._written += size + WRITE_OVERHEAD
            self._last = max(self._last, revision)
            if self._written < self.compact_every or not self._last:
                return
            mark, self._mark, self._written = self._mark, self._last, 0
        if not mark:
            return  # the first trigger: nothing of ours to compact yet
        try:
            self.client.compact(mark)
            log.info("compacted etcd to revision %d after %d bytes of rendezvous writes", mark, self.compact_every)
        except ControlStateError as exc:
            # Compacted already past it (etcd's compactor, another coordinator), or etcd unreachable: the
            # next trigger compacts to a later revision.
            log.debug("could not compact etcd to revision %d: %s", mark, exc)


def forget_rendezvous(client, job_id: str) -> None:
    """Delete a job's rendezvous keys (its end: nothing reads them again)."""
    client.delete(RDZV_ROOT + f"rdzv/{job_id}/".encode(), prefix=True)
