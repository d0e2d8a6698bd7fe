"""The coordinator's side of one job: ``python -m meshrun.jobs.supervisor STATE_DIR JOB_ID``.

The coordinator daemon starts one supervisor per job (meshrun.jobs.control), in its own session:
the job belongs to the mesh, not to the terminal that asked for it, and not to the daemon either
(restarting the daemon leaves it running). The supervisor

- hosts the job's c10d rendezvous store on the coordinator's overlay address (bound to the
  WireGuard device; the first free port above the network's rdzv_port), so the store outlives
  every training process and no worker needs to be its host;
- waits for the nodes' agents, plans every node's torchrun (meshrun.core.launch), ships the code,
  starts the shares (meshrun.jobs.share, on each node through its job API, every request MAC'd
  with that node's job key; the coordinator's own share, if it trains, in a local process);
- follows every share's output by offset into logs/<node>.log (what `meshrun logs` and
  `meshrun train` print), and declares a node lost when its machine stops answering a TCP handshake
  for a few seconds (meshrun.core.liveness) or its agent stops answering for LOST_AFTER_S;
- stops the job when meshrun.core.outcome.Outcome says so (a fixed-size job's first failure or lost
  node; an elastic job below MIN), starts a share on a node that becomes ready while an elastic
  job runs below MAX, and records the verdict in job.json;
- cancels every share on SIGTERM (`meshrun cancel`, Ctrl-C in `meshrun train`).

With several coordinators (meshrun.mesh.coordinator.ha) the job is replicated (meshrun.system.control.etcdjobs) and
every coordinator runs a supervisor for it: the one it was submitted to owns it, the others stand by
(`--standby`, started by each coordinator's job control). There is no store here then: the nodes' torchrun
rendezvous at any coordinator, in etcd (meshrun.jobs.rdzv_backend). A standby follows every share's output
into its own logs/ and copies the owner's lines, so `meshrun logs` shows the whole job on any coordinator;
when the owner's lease runs out (its machine is gone) the first standby to claim the job drives it from
where it is: the shares kept running on their nodes, their output waited there. SIGTERM then only stops
this supervisor (another takes over); `meshrun cancel` cancels through the store.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from meshrun.core import codeset, launch, liveness, preflight, presets, progress, topology
from meshrun.core.jobspec import EXIT_CANCELLED, JobRecord, JobSpec, JobState, ShareEnd
from meshrun.core.model import STORE_PORTS
from meshrun.core.outcome import Outcome
from meshrun.errors import LaunchError, MeshrunError
from meshrun.jobs.handles import LocalShare, RemoteShare
from meshrun.jobs.planning import ask_health, candidates, check_environments, nproc, pack, placements, plan
from meshrun.mesh import member
from meshrun.mesh.coordinator import admin, ha
from meshrun.system.control import etcdjobs
from meshrun.system.control.etcdjobs import JobReplica
from meshrun.system.files import joblogs
from meshrun.system.files.archive import Packed
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.firewall import JobGuard, job_gate
from meshrun.system.machine import procs
from meshrun.system.sockets import tcpstore

log = logging.getLogger("meshrun.jobs.supervisor")

# A share whose agent has not answered for this long is lost, though its machine answers (a hung agent);
# a machine that answers nothing is called gone sooner (meshrun.core.liveness.GONE_AFTER_S).
LOST_AFTER_S = 15.0
WATCH_THREADS = 64  # probes in flight at once (two a node while it is silent): a larger job's wait a little
# After a fixed-size job's first failure the other nodes are stopped this many seconds later: their
# torchrun would otherwise sit in its exit barrier (300 s) waiting for the dead node; the grace
# lets simultaneous failures report their own cause.
FAIL_GRACE_S = 3.0
# An elastic (MIN:MAX) job starts with MIN..MAX ready nodes after this long, instead of waiting
# for a node that may be down.
ELASTIC_GRACE_S = 10.0
SCALE_UP_EVERY_S = 5.0
OUTPUT_DRAIN_S = 15.0  # a standby copies what the shares printed last for at most this long after the end
EVENTS = "_meshrun"  # the supervisor's own lines, among the nodes' logs
OWNER_HANDOVER = "owner.json"  # a replicated job's ownership, from job control's `start` to its supervisor
# How often following the output saves the record (progress, last output): `meshrun jobs` is this fresh, and a
# replicated job's record is written to etcd no more often.
PROGRESS_SAVE_S = 5.0


class Supervisor:
    """One job, from waiting for its nodes to its verdict (or, `standby`, a copy of it on another coordinator)."""

    def __init__(self, state: StateDir, job_id: str, standby: bool = False) -> None:
        self.state = state
        self.dir = joblogs.job_dir(state, job_id)
        self.spec = JobSpec.from_dict(self.dir.read_json("spec.json"))
        self.job_id = job_id
        self.standby = standby
        self.rec, _ = member.load(state)
        # With several coordinators the job is replicated: ownership, record, lines and rendezvous in etcd.
        self.replica = (
            JobReplica(ha.client_for(state), job_id, str(self.rec["name"])) if ha.replicated(self.rec) else None
        )
        if self.replica is not None and not standby and (self.dir / OWNER_HANDOVER).exists():
            # Submitted here: the job was created owned, and job control kept it so until now.
            if not self.replica.adopt(self.dir.read_json(OWNER_HANDOVER)):
                log.warning("job %s: its ownership ran out before its supervisor started", job_id)
            self.dir.remove(OWNER_HANDOVER)
        db, self.network = admin.open_db(state, readonly=True)
        self.members = db.members()
        self.pairs = db.pairs()  # which members proved a private path: sites (meshrun.core.topology)
        db.close()
        self.record = JobRecord(
            job_id,
            workers=self.spec.workers,
            created=self.dir.read_json("job.json").get("created", time.time())
            if (self.dir / "job.json").exists()
            else time.time(),
        )
        self.logs = StateDir(self.dir / "logs")
        self.logs.create()
        self.events = joblogs.BoundedLog(self.logs / f"{EVENTS}.log")
        self.lock = threading.Lock()
        self.shares: dict[str, RemoteShare | LocalShare] = {}
        self.followers: list[threading.Thread] = []
        self.outcome: Outcome | None = None
        self.aborting = False
        self.cancel_event = threading.Event()
        self.store = None
        self.store_port = 0
        self.project = self.spec.project or self.spec.job_id
        self.guard: JobGuard | None = None  # the job's store answers only the job's nodes
        self.allowed: list[str] = []  # the overlay addresses of the job's nodes
        self.packed: Packed | None = None  # the code as shipped (elastic additions get the same)
        self.sites: dict | None = None  # every candidate's site within the job, numbered once at the start
        self.leaving = threading.Event()  # a replicated job's supervisor stops (SIGTERM), the job goes on
        self.progress = progress.Progress()  # how far rank 0 is (its report lines, a tqdm bar)
        self.progress_saved = 0.0

    # ------------------------------------------------------------------ bookkeeping
    @property
    def owning(self) -> bool:
        return self.replica is None or self.replica.owning

    def say(self, text: str) -> None:
        """A line of the supervisor's own, shown by `meshrun train`/`logs` and kept in the daemon log (a standby's
        go to its daemon log only: the owner's lines reach its logs through the store)."""
        log.info("job %s: %s", self.job_id, text)
        if not self.owning:
            return
        line = f"{int(time.time() * 1000)} meshrun: {text}"
        self.events.write(line)
        if self.replica is not None:
            try:
                self.replica.event(line)
            except MeshrunError as exc:
                log.warning("job %s: line not replicated: %s", self.job_id, exc)

    def save(self) -> None:
        self.dir.write_json("job.json", self.record.to_dict())
        if self.replica is not None and self.owning:
            try:
                self.replica.save(self.record)
            except MeshrunError as exc:
                log.warning("job %s: record not replicated: %s", self.job_id, exc)

    def candidates(self) -> list[RemoteShare | LocalShare]:
        if self.replica is not None and (self.spec.with_coordinator or self.rec.get("train")):
            raise LaunchError(
                "with several coordinators a job runs on nodes only (a coordinator's own share would end with it)",
                "leave out --with-coordinator, or run `meshrun coordinator remove` until one coordinator is left",
            )
        return candidates(self.state, self.spec, self.network, self.members, self.rec)

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        try:
            if self.replica is not None and (self.standby or not self.replica.own()):
                procs.notify_ready()
                self._standby()
            else:
                self._run()
        finally:
            if self.guard is not None:
                self.guard.remove()
            if self.replica is not None:
                if self.replica.owning and self.record.final:
                    _quietly(etcdjobs.forget_rendezvous, self.replica.client, self.job_id)
                    _quietly(self.replica.drop_code)
                self.replica.release()

    def _run(self) -> None:
        self.save()
        procs.notify_ready()
        try:
            self._launch()
        except Exception as exc:  # noqa: BLE001 -- whatever stops the launch must end the job, not orphan it
            if not isinstance(exc, MeshrunError):
                log.exception("the launch of %s failed", self.job_id)
                exc = LaunchError(
                    f"internal error ({type(exc).__name__}: {exc})",
                    f"please report it with {self.dir / 'supervisor.out'}",
                )
            with self.lock:
                started = list(self.shares.values())
            for s in started:  # a share that did start must not run on alone
                _quietly(s.cancel, self.job_id)
            if self.cancel_event.is_set():
                state, code, message = JobState.CANCELLED, EXIT_CANCELLED, f"job {self.job_id} cancelled"
            else:
                state, code, message = JobState.FAILED, exc.exit_code or 1, f"job {self.job_id} could not start: {exc}"
            self.record.state, self.record.exit_code, self.record.message = state, code, message
            self.record.ended = time.time()
            self.say(message)
            self.save()
            return
        self._supervise()

    def _host_store(self):
        if self.replica is not None:  # the nodes rendezvous at the coordinators, in etcd: nothing to host here
            return None, self.network.api_port
        # rdzv_port itself is the coordinator's store for `meshrun train --local` shares.
        ports = range(self.network.rdzv_port + 1, self.network.rdzv_port + STORE_PORTS)
        store = tcpstore.serve_store_in(self.network.coordinator_ip, ports, self.network.interface)
        if store is not None:
            return store, store.port
        raise LaunchError(
            f"no free port for the rendezvous store on {self.network.coordinator_ip}:"
            f"{self.network.rdzv_port + 1}-{self.network.rdzv_port + STORE_PORTS - 1}",
            "wait for other jobs to end",
        )

    def _launch(self) -> None:
        cands = self.candidates()
        if not cands:
            raise LaunchError("no node has joined this network yet", "run `meshrun join TOKEN` on the GPU machines")
        if self.replica is None:  # the store below imports torch: started now, it overlaps the wait and shipping
            tcpstore.import_torch_early()
        lo, hi = self.spec.bounds(len(cands))
        want = min(hi, len(cands))
        ready = self._wait_for(cands, want, lo if lo < want else None)
        by_name = {s.name: s for s, _ in ready}
        if not self.spec.no_sync:
            self.packed = pack(self.spec, self.state)
            self.say(
                f"shipping {len(self.packed.manifest)} file(s), {codeset.human_bytes(self.packed.bytes)} "
                f"to project {self.project!r} on every node"
            )
            self._each([s for s, _ in ready], lambda s: s.ship(self.job_id, self.project, self.packed.blob))
            if self.replica is not None and not self.replica.put_code(self.packed.blob):
                self.say("the code is too large to replicate: a coordinator that takes this job over cannot ship it")
        if not self.spec.skip_preflight:
            self._preflight(ready)
        # Every port of the job, its store here included, answers only the job's nodes: the guard is there
        # before anything listens. The store comes after the pre-flight: hosting it imports torch, a refusal
        # should not wait for that.
        self.allowed = sorted({s.overlay_ip for s, _ in ready})
        if self.replica is not None:
            self.replica.allow(self.allowed)  # who may use the job's rendezvous at the coordinators
        else:
            node = f"{self.rec['name']}/store"
            gate = job_gate(self.job_id, self.network)
            self.guard = JobGuard(self.job_id, node, self.network.interface, gate).create(self.allowed)
            self.guard.join()
        self.store, self.store_port = self._host_store()
        self.sites = placements(self.candidates(), topology.assign(self.members, self.pairs))
        plans = plan(
            self.spec,
            self.network,
            [(s.name, s.overlay_ip, h) for s, h in ready],
            self.store_port,
            sites=self.sites,
            coordinators=self._coordinators(),
        )
        self.outcome = Outcome(self.spec.elastic, lo if self.spec.nnodes else len(plans))
        self._each(plans, lambda p: self._start(by_name[p.node], p))
        if self.spec.preset:
            self.say(presets.Choice.from_dict(self.spec.preset).line())
        self.record.state, self.record.started = JobState.RUNNING, time.time()
        self.record.nodes = [p.node for p in plans]
        self.record.ranks = sum(nproc(p) for p in plans)
        self.save()
        names = ", ".join(p.node for p in plans)
        self.say(f"job {self.job_id} on {len(plans)} node(s): {names} ({self.spec.workers} workers)")

    def _preflight(self, ready: list[tuple]) -> None:
        """Compare the nodes' environments (meshrun.core.preflight); LaunchError with the table if they
        cannot run this job together, the table as a warning if they can but differ."""
        t0 = time.monotonic()
        reports, here = check_environments(
            self.spec, [s for s, _ in ready], {s.name: h for s, h in ready}, self.job_id, self.project
        )
        # The reference is exactly what was shipped, or the coordinator's own --no-sync copy read at the
        # same moment as the nodes' (never a second read of a directory that may be changing).
        reference = self.packed.manifest if self.packed is not None else here
        findings = preflight.compare(
            reports,
            codeset.digest(reference) if reference is not None else None,
            self.spec.nproc_per_node is None,
            reference_files=reference,
            mixed_accelerators=self.spec.mixed_accelerators,
        )
        took = f"{time.monotonic() - t0:.2f} s"
        if not findings:
            self.say(
                f"pre-flight: {len(reports)} node(s) agree (torch {reports[0].torch}, {reports[0].build}) in {took}"
            )
            return
        for line in preflight.table(reports, findings):
            self.say(line)
        verdict = "refused" if preflight.blocking(findings) else f"{len(findings)} warning(s), the job goes on"
        self.say(f"pre-flight: {len(reports)} node(s) checked in {took}: {verdict}")
        if preflight.blocking(findings):
            raise LaunchError(
                "pre-flight refused the job: "
                + "; ".join(f"{', '.join(f.nodes)}: {f.what}" for f in findings if f.level == preflight.BLOCK),
                "fix what the table above says, or pass --skip-preflight if you know better",
            )

    def _wait_for(self, cands, want: int, enough: int | None) -> list[tuple]:
        """Poll the agents until `want` answer (or `enough`, after ELASTIC_GRACE_S, for elastic jobs)."""
        t0 = time.monotonic()
        last = ""
        while True:
            with ThreadPoolExecutor(max_workers=len(cands)) as pool:
                healths = list(pool.map(ask_health, cands))
            ready = [(s, h) for s, h in zip(cands, healths) if h is not None]
            missing = [s.name for s, h in zip(cands, healths) if h is None]
            msg = f"{len(ready)}/{want} nodes ready" + (f" (waiting for: {', '.join(missing)})" if missing else "")
            if msg != last:
                self.say(msg)
                last = msg
            waited = time.monotonic() - t0
            if len(ready) >= want or (
                enough is not None and len(ready) >= enough and waited >= min(ELASTIC_GRACE_S, self.spec.wait_timeout)
            ):
                return ready[:want]
            if self.cancel_event.is_set():
                raise LaunchError("cancelled while waiting for the nodes", "")
            if waited >= self.spec.wait_timeout:
                raise LaunchError(
                    f"only {len(ready)} of {want} nodes were ready after {self.spec.wait_timeout:.0f} s; "
                    f"not answering: {', '.join(missing) or 'none'}",
                    "check `meshrun status` on the coordinator and that those agents run "
                    "(`meshrun join`/`meshrun up` on them), or lower --nnodes",
                )
            time.sleep(1)

    def _start(self, s, p: launch.NodeLaunch) -> None:
        s.start(
            self.job_id,
            list(p.argv),
            p.env,
            self.spec.cwd if self.spec.no_sync else None,
            self.project,
            list(self.allowed),
        )
        with self.lock:
            self.shares[s.name] = s
            self.outcome.shares[s.name] = None
        t = threading.Thread(target=self._follow, args=(s,), name=f"follow-{s.name}", daemon=True)
        self.followers.append(t)
        t.start()

    def _each(self, items, fn) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
            list(pool.map(fn, items))  # the first error (in order) is raised, after all finished

    # ------------------------------------------------------------------ following the shares
    def _follow(self, s) -> None:
        mirror = joblogs.BoundedLog(self.logs / f"{s.name}.log")
        offset, last_ok = 0, time.monotonic()
        try:
            while True:
                try:
                    ans = s.output(self.job_id, offset)
                except MeshrunError as exc:
                    # Only the owner calls a share lost: a standby's copy of the output must not end for good
                    # because this coordinator was cut off a while (its own interface restarting, say).
                    if self._is_lost(s.name):
                        return  # the watch called its machine gone meanwhile
                    if self.owning and time.monotonic() - last_ok >= LOST_AFTER_S:
                        why = f"no answer from its agent for {LOST_AFTER_S:.0f} s ({exc.message})"
                        self._lose(s.name, time.monotonic() - last_ok, why)
                        return
                    time.sleep(1)
                    continue
                if self._is_lost(s.name):
                    return  # called gone: its output is no longer the job's
                last_ok = time.monotonic()
                now = time.time()
                for line in ans.get("lines", []):
                    if not self._took(s.name, line, now):
                        mirror.write(f"{int(now * 1000)} {line}")
                if ans.get("lines"):
                    self._heard(now)
                offset = int(ans.get("offset", offset))
                if ans.get("done"):
                    with self.lock:
                        self.outcome.shares[s.name] = ShareEnd.from_dict(ans.get("status") or {})
                    return
        finally:
            mirror.close()

    def _took(self, node: str, line: str, at: float) -> bool:
        """Rank 0's lines tell how far the job is (meshrun.core.progress); True for a report line, which the
        record keeps instead of the logs. Only the node's own prefix counts (a line can print any other)."""
        prefix = f"[{node} r0] "
        if not line.startswith(prefix):
            return False
        with self.lock:
            self.record.rank0 = node
            return self.progress.see(line[len(prefix) :], at)

    def _heard(self, now: float) -> None:
        """Lines arrived at `now`: the record's progress and last output, saved every PROGRESS_SAVE_S."""
        with self.lock:
            self.record.last_output = now
            self.record.progress = self.progress.record()
            due = now - self.progress_saved >= PROGRESS_SAVE_S
            if due:
                self.progress_saved = now
        if due and self.owning:
            self.save()

    def _is_lost(self, name: str) -> bool:
        with self.lock:
            return name in self.outcome.lost

    def _lose(self, name: str, silent_for: float, why: str) -> None:
        """Call `name`'s share lost (once, whoever notices first: its follower or the watch) and regroup."""
        with self.lock:
            if name in self.outcome.lost or self.outcome.shares.get(name) is not None:
                return
            self.outcome.lost[name] = time.time()
        self.say(f"lost {name}: {why}")
        self._regroup(name, time.time() - silent_for)

    def _watch(self, stop: threading.Event) -> None:
        """Probe the machine of every running share each PROBE_EVERY_S, the probes overlapping
        (meshrun.core.liveness.Probes); the owner calls one silent for GONE_AFTER_S lost at once, instead of
        after LOST_AFTER_S without output. This machine's own share needs no probe, and must not hide a
        cut-off link (every node silent at once), so it is not counted."""
        probes = liveness.Probes()
        tick = min(liveness.TICK_S, liveness.PROBE_EVERY_S / 4)
        with ThreadPoolExecutor(max_workers=WATCH_THREADS, thread_name_prefix="watch") as pool:
            while not stop.wait(tick):
                with self.lock:
                    running = [self.shares[n] for n in self.outcome.running() if n in self.shares]
                running = {s.name: s for s in running if not isinstance(s, LocalShare)}
                if not self.owning:
                    running = {}  # a standby's view starts afresh when it takes the job over
                now = time.monotonic()
                for name in probes.due(running, now):
                    probes.sent(name, now, pool.submit(_probe, running[name]))
                probes.settle(lambda f: f.result() if f.done() else None)
                for name, silent, misses in probes.gone(running, time.monotonic()):
                    why = f"its machine answered nothing for {silent:.1f} s ({misses} probes)"
                    self._lose(name, silent, why)

    def _supervise(self) -> None:
        stop_watch = threading.Event()
        threading.Thread(target=self._watch, args=(stop_watch,), name="watch", daemon=True).start()
        try:
            self._supervise_until_done()
        finally:
            stop_watch.set()

    def _supervise_until_done(self) -> None:
        next_scale = time.monotonic() + SCALE_UP_EVERY_S
        while True:
            if self.replica is not None and not self.cancel_event.is_set() and self._cancel_asked():
                self.cancel_event.set()
            with self.lock:
                if self.cancel_event.is_set():
                    self.outcome.cancelled = True
                reason = "" if self.aborting else self.outcome.stop_reason()
                active = any(t.is_alive() for t in self.followers)
            if reason:
                self._abort(reason)
            if not active:
                break
            if self.spec.elastic and not self.aborting and time.monotonic() >= next_scale:
                next_scale = time.monotonic() + SCALE_UP_EVERY_S
                self._scale_up()
            time.sleep(0.5)
        state, code, message = self.outcome.verdict(self.job_id)
        self.record.state, self.record.exit_code, self.record.message = state, code, message
        self.record.ended = time.time()
        self.say(message)
        self.save()

    def _regroup(self, lost: str, heard: float) -> None:
        """An elastic job lost `lost` (last heard at `heard`, unix s) and goes on: the others' workers started
        before then are restarted, so the group re-forms without it now. A machine that vanished answers
        nothing, and their collectives would wait for it until torch's timeout (30 minutes for gloo)."""
        with self.lock:
            if not self.spec.elastic or not self.owning or self.aborting or self.outcome.stop_reason():
                return
            running = [self.shares[n] for n in self.outcome.running() if n != lost]
            gone = [self.shares[lost].overlay_ip] if lost in self.shares else []
            self.record.regroups += bool(running)
        if not running:
            return
        self.say(f"re-forming the group without {lost}: restarting the workers on {', '.join(s.name for s in running)}")
        members = [s.overlay_ip for s in running]
        for s in running:
            args = (s.restart, self.job_id, heard, gone, members)
            threading.Thread(target=_quietly, args=args, daemon=True).start()

    def _abort(self, reason: str) -> None:
        """Stop every running share: at once when cancelled or below MIN, after FAIL_GRACE_S on a failure."""
        self.aborting = True
        grace = 0.0 if reason == "cancelled" or self.outcome.below_min else FAIL_GRACE_S
        self.say(
            "cancelling the job on every node"
            if reason == "cancelled"
            else f"{reason}; stopping the other nodes" + (f" in {grace:.0f} s" if grace else "")
        )

        def stop() -> None:
            time.sleep(grace)
            with self.lock:
                running = [self.shares[n] for n in self.outcome.running()]
            for s in running:
                threading.Thread(target=_quietly, args=(s.cancel, self.job_id), daemon=True).start()

        threading.Thread(target=stop, daemon=True).start()

    def cancel(self) -> None:
        """SIGTERM: cancel the job everywhere (the loop notices and stops the shares). A replicated job's
        supervisor only stops (its coordinator is going down): another coordinator takes the job over."""
        if self.replica is not None:
            self.leaving.set()
            return
        self.cancel_event.set()

    # ------------------------------------------------------------------ several coordinators
    def _coordinators(self) -> tuple[str, ...]:
        """Where the nodes rendezvous (every coordinator's overlay API), none for a lone coordinator's store."""
        if self.replica is None:
            return ()
        db, _ = admin.open_db(self.state, readonly=True)
        try:
            return tuple(f"{c.overlay_ip}:{self.network.api_port}" for c in db.coordinators())
        finally:
            db.close()

    def _cancel_asked(self) -> bool:
        try:
            return self.replica.cancel_requested()
        except MeshrunError:
            return False

    def _standby(self) -> None:
        """Another coordinator owns the job: keep a copy of its output and its owner's lines here, and take it
        over when the owner is gone. Returns once the job ended (or this coordinator stops)."""
        log.info("job %s: standing by (its owner is another coordinator)", self.job_id)
        mark = b""
        while not self.leaving.is_set():
            try:
                record = self.replica.record()
                for key, line in self.replica.events(mark):
                    self.events.write(line)
                    mark = key
                owner = self.replica.owner()
            except MeshrunError as exc:
                log.warning("job %s: cannot read its record (%s); trying again", self.job_id, exc)
                self.leaving.wait(1.0)
                continue
            if record is not None:
                if record != self.record:
                    self.record = record
                    self.dir.write_json("job.json", record.to_dict())
                if record.state is not JobState.STARTING:  # its nodes are known once it runs
                    self._follow_nodes(record.nodes)
                if record.final:
                    for t in self.followers:
                        t.join(OUTPUT_DRAIN_S)
                    return
            if owner is None and self.replica.own():
                self._take_over(record)
                return
            self.leaving.wait(1.0)

    def _follow_nodes(self, nodes: list[str]) -> None:
        """Follow the shares of `nodes` not followed yet (a standby; an elastic job grows)."""
        if self.outcome is None:
            lo, _ = self.spec.bounds(len(nodes))
            self.outcome = Outcome(self.spec.elastic, lo if self.spec.nnodes else len(nodes))
        if all(name in self.shares for name in nodes):
            return
        try:
            by_name = {s.name: s for s in self.candidates()}
        except MeshrunError as exc:  # a job this coordinator cannot drive (its own record says why it ended)
            log.warning("job %s: cannot follow its shares: %s", self.job_id, exc)
            return
        for name in nodes:
            if name in self.shares or name not in by_name:
                continue
            s = by_name[name]
            with self.lock:
                self.shares[name] = s
                self.outcome.shares[name] = None
            if s.overlay_ip not in self.allowed:
                self.allowed.append(s.overlay_ip)
            t = threading.Thread(target=self._follow, args=(s,), name=f"follow-{name}", daemon=True)
            self.followers.append(t)
            t.start()

    def _take_over(self, record) -> None:
        """This standby owns the job now: it drives it from where it is."""
        gone = "its coordinator"
        if record is None or record.state is JobState.STARTING:
            self.record.state, self.record.exit_code = JobState.FAILED, 1
            self.record.message = f"job {self.job_id} failed: {gone} was lost before the job started; submit it again"
            self.record.ended = time.time()
            self.say(self.record.message)
            self.save()
            return
        self.say(f"coordinator {self.rec['name']} took the job over ({gone} is gone); the shares kept running")
        self.store_port = self.network.api_port
        blob = self.replica.code()
        if blob is not None:
            self.packed = Packed(blob=blob, manifest={}, bytes=len(blob))
        self.sites = placements(self.candidates(), topology.assign(self.members, self.pairs))
        self._supervise()

    def _scale_up(self) -> None:
        """An elastic job below MAX takes a node that became ready (torchrun re-forms the group)."""
        _, hi = self.spec.bounds(len(self.candidates()))
        with self.lock:
            taken = set(self.outcome.shares) | set(self.outcome.lost)
            room = hi - len(self.outcome.running())
        for s in self.candidates():
            if room <= 0 or s.name in taken:
                continue
            h = ask_health(s)
            if h is None:
                continue
            (p,) = plan(
                self.spec,
                self.network,
                [(s.name, s.overlay_ip, h)],
                self.store_port,
                local=True,
                sites=self.sites,
                coordinators=self._coordinators(),
            )
            try:
                if self.packed is not None:  # the code the job started with, not what the directory holds now
                    s.ship(self.job_id, self.project, self.packed.blob)
                self._admit(s.overlay_ip)
                self._start(s, p)
            except MeshrunError as exc:
                self.say(f"could not add {s.name}: {exc}")
                continue
            room -= 1
            self.record.nodes.append(s.name)
            self.record.ranks += nproc(p)
            self.save()
            self.say(f"{s.name} joined the job (elastic)")

    def _admit(self, ip: str) -> None:
        """A node joins the running job: the store's guard and every running share's admit it first."""
        if ip in self.allowed:
            return
        self.allowed.append(ip)
        if self.guard is not None:
            self.guard.allow([ip])
        if self.replica is not None:
            self.replica.allow(self.allowed)
        with self.lock:
            running = [self.shares[n] for n in self.outcome.running()]
        for s in running:
            _quietly(s.allow, self.job_id, [ip])


def _probe(share) -> tuple[bool, float]:
    """Whether `share`'s machine answered a handshake, and when that was known (monotonic s)."""
    try:
        ok = bool(share.reachable())
    except Exception:  # noqa: BLE001 -- a probe that failed is a probe not answered
        ok = False
    return ok, time.monotonic()


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except MeshrunError as exc:
        log.warning("%s", exc)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    standby = "--standby" in args
    args = [a for a in args if a != "--standby"]
    if len(args) != 2:
        sys.stderr.write("usage: python -m meshrun.jobs.supervisor STATE_DIR JOB_ID [--standby]\n")
        return 2
    state, job_id = StateDir(args[0]), args[1]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        lock = procs.DaemonLock(joblogs.job_dir(state, job_id) / "supervisor.lock").acquire(
            f"job {job_id}'s supervisor"
        )
        sup = Supervisor(state, job_id, standby=standby)
    except MeshrunError as exc:
        procs.notify_error(exc)
        return 1
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: sup.cancel())
    try:
        sup.run()
    except MeshrunError as exc:
        procs.notify_error(exc)
        return 1
    finally:
        sup.events.close()
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
