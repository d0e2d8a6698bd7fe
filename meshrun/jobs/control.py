"""Job control on the coordinator: submit, list, follow, cancel; and the daemon's side of it.

`meshrun train` submits a job to the coordinator daemon through its admin socket
(<state>/admin.sock: a Unix socket in the 0700 state directory, root only, checked by the peer's
uid); the daemon writes the job's directory and starts its supervisor (meshrun.jobs.supervisor)
in a session of its own, so the job outlives the terminal and the daemon. Everything else works
on the job's files and its supervisor's lock, so it also works while the daemon is down:
`meshrun jobs` reads job.json, `meshrun logs` replays and follows logs/<node>.log, `meshrun cancel`
signals the supervisor that holds the job's lock.

With several coordinators (meshrun.mesh.coordinator.ha) a job is also recorded in etcd
(meshrun.system.control.etcdjobs) when it is submitted, and every coordinator's job control starts a standby
supervisor for every live job it does not run yet (`_watch`), so each keeps its own copy of the job's
logs and any can take it over. `meshrun cancel` then asks through the store (the owner acts on it).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from meshrun.core.jobspec import EXIT_LOST, JobRecord, JobSpec, JobState, check_job_id
from meshrun.core.model import Network
from meshrun.core.termtext import LINE_RE, line_matches
from meshrun.errors import MeshrunError, StateError, UsageError
from meshrun.jobs.supervisor import EVENTS, OWNER_HANDOVER
from meshrun.mesh.coordinator import ha
from meshrun.system.control import etcdjobs
from meshrun.system.control.etcdjobs import JobReplica
from meshrun.system.files import joblogs
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine import procs
from meshrun.system.sockets import transport

log = logging.getLogger("meshrun.jobs.control")

ADMIN_SOCKET = "admin.sock"
WATCH_EVERY_S = 2.0
# Lines in logs/<node>.log: "<arrival time in ms> <line>"
MIRROR_RE = re.compile(r"^(\d+) (.*)$", re.S)


def _dir(state: StateDir, job_id: str) -> StateDir:
    return joblogs.job_dir(state, check_job_id(job_id))


def _lock(state: StateDir, job_id: str) -> procs.DaemonLock:
    return procs.DaemonLock(_dir(state, job_id) / "supervisor.lock")


def record(state: StateDir, job_id: str) -> JobRecord:
    """The job's record (StateError naming the job if there is none)."""
    d = _dir(state, job_id)
    if not (d / "job.json").exists():
        raise StateError(f"there is no job {job_id!r} on this coordinator", "see the jobs with `meshrun jobs`")
    rec = JobRecord.from_dict(d.read_json("job.json"))
    if not rec.final and not _lock(state, job_id).held():
        # Its supervisor is gone (the coordinator machine rebooted, or it crashed): nobody will finish it.
        rec = replace(
            rec,
            state=JobState.LOST,
            exit_code=EXIT_LOST,
            message=f"job {job_id}'s supervisor on the coordinator stopped before the job ended",
        )
    return rec


def list_jobs(state: StateDir) -> list[JobRecord]:
    return [record(state, j) for j in joblogs.job_ids(state) if (joblogs.job_dir(state, j) / "job.json").exists()]


# --------------------------------------------------------------------------- the daemon's side


class JobControl:
    """The coordinator daemon's job extension: the admin socket, and a log line per job start and end."""

    def __init__(self, state: StateDir, network: Network) -> None:
        self.state = state
        self.network = network
        self.rec = state.read_json("member.json")
        self.client = None  # the etcd client of the replicated jobs' watch (several coordinators)
        self.settled: set[str] = set()  # replicated jobs known to have ended
        # Jobs this daemon is starting: in etcd already, their supervisor not yet holding its lock. The standby
        # pass must leave them alone, or its standby may take the lock first and the submission fail.
        self.starting: set[str] = set()
        self.starting_lock = threading.Lock()
        self.server = transport.AdminServer(str(state / ADMIN_SOCKET), self.handle)
        self.server.start("admin")
        self.stop = threading.Event()
        self.known: dict[str, JobState] = {r.job_id: r.state for r in list_jobs(state)}
        for job_id, st in self.known.items():
            if st is JobState.LOST:
                log.warning("job %s: its supervisor is gone; it cannot be resumed", job_id)
        threading.Thread(target=self._watch, name="jobs", daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.close()
        if self.client is not None:
            self.client.close()
        # Running jobs are left alone: they belong to their supervisors.

    def handle(self, req: transport.Request) -> transport.Response:
        if req.client_ip != "uid:0":
            log.warning("refused admin request %s %s from %s: not root", req.method, req.path, req.client_ip)
            return transport.Response.error(403, "only root may control jobs")
        if req.method == "POST" and req.path == "/v1/jobs":
            try:
                spec = JobSpec.from_dict(req.body)
            except (ValueError, TypeError) as exc:
                return transport.Response.error(400, UsageError(f"malformed job ({exc})", "use `meshrun train`"))
            with self.starting_lock:
                self.starting.add(spec.job_id)
            try:
                return transport.Response(200, {"job": start(self.state, spec)})
            finally:
                with self.starting_lock:
                    self.starting.discard(spec.job_id)
        return transport.Response.error(404, f"no such endpoint {req.method} {req.path}")

    def _watch(self) -> None:
        while not self.stop.wait(WATCH_EVERY_S):
            if ha.replicated(self.rec):
                try:
                    self._stand_by()
                except MeshrunError as exc:
                    log.warning("cannot follow the replicated jobs: %s", exc)
            try:
                for r in list_jobs(self.state):
                    if self.known.get(r.job_id) != r.state:
                        self.known[r.job_id] = r.state
                        log.info("job %s %s%s", r.job_id, r.state, f": {r.message}" if r.message else "")
            except StateError as exc:
                log.warning("cannot read the jobs: %s", exc)

    def _stand_by(self) -> None:
        """A standby supervisor here for every live replicated job that has none (jobs submitted elsewhere,
        or while this coordinator was down)."""
        if self.client is None:
            self.client = ha.client_for(self.state)
        client = self.client
        for job_id in etcdjobs.job_ids(client):
            if job_id in self.settled:
                continue
            # Submitted here and its supervisor on its way. Checked before the lock: `start` returns only once
            # the supervisor holds it, so a job is always either still starting or locked.
            with self.starting_lock:
                if job_id in self.starting:
                    continue
            d = joblogs.job_dir(self.state, job_id)
            if _lock(self.state, job_id).held():  # a supervisor runs for it here
                continue
            if (d / "job.json").exists() and JobRecord.from_dict(d.read_json("job.json")).final:
                self.settled.add(job_id)
                continue
            replica = JobReplica(client, job_id, str(self.rec["name"]))
            rec = replica.record()
            spec = replica.spec()
            if rec is not None and rec.final:
                self.settled.add(job_id)
            if rec is None or spec is None or rec.final:
                continue
            d.create()
            d.write_json("spec.json", spec)
            d.write_json("job.json", rec.to_dict())
            pid = procs.spawn_daemon(
                [sys.executable, "-m", "meshrun.jobs.supervisor", str(self.state.path), job_id, "--standby"],
                d / "supervisor.out",
                timeout=60,
                what=f"job {job_id}'s standby supervisor",
            )
            log.info("job %s: standby supervisor started (pid %d)", job_id, pid)


def start_job_control(state: StateDir, network: Network, rec: dict) -> JobControl:
    """The coordinator daemon extension (see meshrun.mesh.coordinator.daemon)."""
    return JobControl(state, network)


def start(state: StateDir, spec: JobSpec) -> str:
    """Create the job's directory and start its supervisor; the job id once the supervisor runs."""
    d = _dir(state, spec.job_id)
    if (d / "spec.json").exists():
        raise UsageError(f"job {spec.job_id!r} exists already", "pick another --job-id")
    rec = state.read_json("member.json")
    replica = None
    if ha.replicated(rec):  # first in the store: a job id is unique across coordinators
        replica = JobReplica(ha.client_for(state), spec.job_id, str(rec["name"]))
        try:
            replica.create(spec.to_dict(), JobRecord(spec.job_id, workers=spec.workers))
        except BaseException:
            replica.client.close()
            raise
        # Owned from the start, kept alive here until the supervisor has taken the ownership over: a standby
        # elsewhere must not take a job whose supervisor is still starting (it would call it lost).
        replica.keep()
    try:
        d.create()
        d.write_json("spec.json", spec.to_dict())
        d.write_json("job.json", JobRecord(spec.job_id, workers=spec.workers).to_dict())
        if replica is not None:
            d.write_json(OWNER_HANDOVER, replica.handover(), secret=True)
        pid = procs.spawn_daemon(
            [sys.executable, "-m", "meshrun.jobs.supervisor", str(state.path), spec.job_id],
            d / "supervisor.out",
            timeout=60,
            what=f"job {spec.job_id}'s supervisor",
        )
    except MeshrunError as exc:
        if replica is not None:  # the job ends here, for every coordinator
            failed = JobRecord(spec.job_id, JobState.FAILED, ended=time.time(), exit_code=exc.exit_code or 1)
            failed.message = f"job {spec.job_id} could not start: {exc}"
            with contextlib.suppress(MeshrunError):
                replica.save(failed)
            replica.release()
        raise
    finally:
        if replica is not None:
            replica.detach()  # a no-op after release; else the supervisor keeps the ownership now
            replica.client.close()
    log.info("job %s submitted (supervisor pid %d): %s %s", spec.job_id, pid, spec.script, " ".join(spec.script_args))
    return spec.job_id


# --------------------------------------------------------------------------- the command line's side


def submit(state: StateDir, spec: JobSpec) -> str:
    """Hand the job to the coordinator daemon (it must run); returns the job id."""
    return str(transport.call_admin(str(state / ADMIN_SOCKET), "POST", "/v1/jobs", spec.to_dict())["job"])


def cancel(state: StateDir, job_id: str, wait: bool = True) -> bool:
    """Cancel a running job (its supervisor stops every share); False if it was not running."""
    rec = record(state, job_id)
    lock = _lock(state, job_id)
    pid = lock.holder()
    if rec.final or pid is None:
        return False
    if ha.replicated(state.read_json("member.json")):  # the job's owner (on any coordinator) cancels it
        client = ha.client_for(state)
        try:
            JobReplica(client, job_id, "").request_cancel()
        finally:
            client.close()
        if not wait:
            return True
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not record(state, job_id).final:
            time.sleep(0.5)
        return True
    if wait:
        return lock.stop(timeout=90)
    return procs.signal_pid(pid, 15)


def attributed(node: str, text: str) -> str:
    """A line of logs/<node>.log as it may be shown: one that does not start with `node`'s own prefix
    (a piece of an over-long line, or a node that lies) gets `[node] ` in front, so that no node's output
    can pass for another's."""
    m = LINE_RE.match(text)
    return text if m is not None and m.group("node") == node else f"[{node}] {text}"


def follow(
    state: StateDir,
    job_id: str,
    out: Callable[[str, bool], None],
    node: str | None = None,
    rank: int | None = None,
    keep_going: bool = True,
    stop: threading.Event | None = None,
    tail: int | None = None,
    since: float | None = None,
) -> JobRecord:
    """Print the job's lines from the start, in arrival order (`out(line, is_meshrun_line)`).

    With `keep_going`, follow until the job has ended and everything was printed (or `stop` is
    set); otherwise print what is there and return. `node`/`rank` keep only those lines (the
    supervisor's own lines are always shown). `since` (unix s) keeps the lines that arrived at the
    coordinator from then on; `tail` starts with the last `tail` lines there are now (after the other
    filters), then goes on with every new one. Returns the job's record as it was last read.
    A node's line always starts with that node's prefix (`[node rN] ` or `[node] `), whatever the node
    sent; its text is as stored: a redraw keeps its marker and escapes are left for the printer to
    remove (meshrun.core.termtext, as `meshrun train` and `meshrun logs` do).
    """
    logs = _dir(state, job_id) / "logs"
    offsets: dict[str, int] = {}
    since_ms = None if since is None else int(since * 1000)
    first = True
    while True:
        rec = record(state, job_id)
        batch: list[tuple[int, int, str, str]] = []
        for path in sorted(logs.glob("*.log")) if logs.is_dir() else []:
            # A final job's mirrors are closed: a last line without a newline is read too.
            lines, offsets[path.name] = joblogs.read_from(path, offsets.get(path.name, 0), final=rec.final)
            for i, text in enumerate(lines):
                m = MIRROR_RE.match(text)
                if m and (since_ms is None or int(m.group(1)) >= since_ms):
                    batch.append((int(m.group(1)), i, path.stem, m.group(2)))
        shown: list[tuple[str, bool]] = []
        for _, _, source, text in heapq.merge(*[sorted(b for b in batch if b[2] == s) for s in {b[2] for b in batch}]):
            if source == EVENTS:
                shown.append((text, True))
                continue
            text = attributed(source, text)
            if line_matches(text, node, rank):
                shown.append((text, False))
        if first and tail is not None:
            shown = shown[len(shown) - tail :] if tail else []
        first = False
        for text, ours in shown:
            out(text, ours)
        if not keep_going or (rec.final and not batch) or (stop is not None and stop.is_set()):
            return rec
        time.sleep(0.25)
