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
  `meshrun train` print), and declares a node lost when its agent stops answering for LOST_AFTER_S;
- stops the job when meshrun.core.jobs.Outcome says so (a fixed-size job's first failure or lost
  node; an elastic job below MIN), starts a share on a node that becomes ready while an elastic
  job runs below MAX, and records the verdict in job.json;
- cancels every share on SIGTERM (`meshrun cancel`, Ctrl-C in `meshrun train`).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshrun.core import codeset, launch, preflight
from meshrun.core.jobs import EXIT_CANCELLED, JobRecord, JobSpec, Outcome, ShareEnd
from meshrun.core.model import Member, Network
from meshrun.errors import LaunchError, MeshrunError, UsageError
from meshrun.jobs import share as shares
from meshrun.jobs import workdir
from meshrun.mesh import member
from meshrun.mesh.coordinator import admin
from meshrun.system import archive, firewall, host, jobfiles, procs, rdzv, transport
from meshrun.system.firewall import JobGuard
from meshrun.system.archive import Packed
from meshrun.system.projects import ProjectDir
from meshrun.system.store import StateDir, remove_tree

log = logging.getLogger("meshrun.jobs.supervisor")

LOST_AFTER_S = 15.0      # a share whose agent has not answered for this long is lost
OUTPUT_WAIT_S = 4.0      # long-poll for output
# After a fixed-size job's first failure the other nodes are stopped this many seconds later: their
# torchrun would otherwise sit in its exit barrier (300 s) waiting for the dead node; the grace
# lets simultaneous failures report their own cause.
FAIL_GRACE_S = 3.0
# An elastic (MIN:MAX) job starts with MIN..MAX ready nodes after this long, instead of waiting
# for a node that may be down.
ELASTIC_GRACE_S = 10.0
SCALE_UP_EVERY_S = 5.0
STORE_PORTS = 100        # how many ports from rdzv_port up a job's store may take
EVENTS = "_meshrun"      # the supervisor's own lines, among the nodes' logs


class RemoteShare:
    """A node's share, driven through its job API (every request MAC'd with the node's job key)."""

    def __init__(self, network: Network, m: Member, key: bytes) -> None:
        self.name, self.overlay_ip = m.name, m.overlay_ip
        self.network, self.key = network, key

    def _call(self, method: str, path: str, body: object = None, raw: bytes | None = None,
              timeout: float = 15) -> dict:
        return transport.call(self.overlay_ip, self.network.api_port, method, path, body, raw=raw, key=self.key,
                              timeout=timeout)

    def health(self) -> dict:
        return self._call("GET", "/v1/health", timeout=3)

    def ship(self, job_id: str, project: str, blob: bytes) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/code?project={project}", raw=blob, timeout=120)

    def preflight(self, job_id: str, python: str | None, cwd: str | None, project: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/preflight", {"python": python, "cwd": cwd, "project": project},
                          timeout=90)

    def start(self, job_id: str, argv: list[str], env: dict[str, str], cwd: str | None, project: str,
              allow: list[str]) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/start", {"argv": argv, "env": env, "cwd": cwd, "project": project,
                                                        "allow": allow}, timeout=60)

    def allow(self, job_id: str, ips: list[str]) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/allow", {"ips": ips}, timeout=15)

    def output(self, job_id: str, offset: int) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/output", {"offset": offset, "wait": OUTPUT_WAIT_S},
                          timeout=OUTPUT_WAIT_S + 6)

    def cancel(self, job_id: str) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/cancel", {}, timeout=40)

    def pull(self, job_id: str, path: str, max_bytes: int) -> bytes:
        return transport.call_binary(self.overlay_ip, self.network.api_port, "POST", f"/v1/jobs/{job_id}/pull",
                                     {"path": path, "max_bytes": max_bytes}, key=self.key, timeout=300,
                                     max_bytes=max_bytes + (1 << 20))

    def prune(self, job_id: str) -> None:
        self._call("POST", f"/v1/jobs/{job_id}/prune", {}, timeout=60)

    def remove_project(self, project: str) -> bool:
        return bool(self._call("POST", f"/v1/projects/{project}/remove", {}, timeout=60).get("removed"))


class LocalShare:
    """The coordinator's own share (`--with-coordinator`, `init --train`): the same share process, run here."""

    def __init__(self, state: StateDir, job_id: str, name: str, overlay_ip: str, interface: str = "meshrun0") -> None:
        self.name, self.overlay_ip = name, overlay_ip
        self.state = state
        self.interface = interface
        self.dir = StateDir(state / "jobs" / job_id / "share")

    def health(self) -> dict:
        return {"name": self.name, "gpus": host.visible_gpus(), "python": sys.executable}

    def ship(self, job_id: str, project: str, blob: bytes) -> None:
        self.dir.create()
        workdir.receive_code(self.state, job_id, project, blob, self.name)

    def preflight(self, job_id: str, python: str | None, cwd: str | None, project: str) -> dict:
        self.dir.create()
        return workdir.preflight(self.state, self.dir, python or sys.executable, project, cwd)

    def start(self, job_id: str, argv: list[str], env: dict[str, str], cwd: str | None, project: str,
              allow: list[str]) -> None:
        self.dir.create()
        shares.start_share(self.dir, self.name, argv, env, str(workdir.workdir(self.state, project, cwd)), self.state,
                           project, {"interface": self.interface, "allow": allow})

    def allow(self, job_id: str, ips: list[str]) -> None:
        firewall.allow(job_id, self.name, ips)

    def output(self, job_id: str, offset: int) -> dict:
        return shares.share_output(self.dir, offset, OUTPUT_WAIT_S)

    def cancel(self, job_id: str) -> None:
        shares.cancel_share(self.dir)

    def pull(self, job_id: str, path: str, max_bytes: int) -> bytes:
        spec = self.dir.read_json("share.json")
        return workdir.pull(Path(str(spec.get("cwd") or "")), path, max_bytes)[0]

    def prune(self, job_id: str) -> None:
        if shares.share_running(self.dir):
            raise LaunchError(f"job {job_id} still runs on {self.name}", "cancel it first")
        remove_tree(self.dir.path)

    def remove_project(self, project: str) -> bool:
        return ProjectDir(self.state, project).remove()


class Supervisor:
    """One job, from waiting for its nodes to its verdict."""

    def __init__(self, state: StateDir, job_id: str) -> None:
        self.state = state
        self.dir = StateDir(state / "jobs" / job_id)
        self.spec = JobSpec.from_dict(self.dir.read_json("spec.json"))
        self.job_id = job_id
        db, self.network = admin.open_db(state, readonly=True)
        self.members = db.members()
        db.close()
        self.rec, _ = member.load(state)
        self.record = JobRecord(job_id, created=self.dir.read_json("job.json").get("created", time.time())
                                if (self.dir / "job.json").exists() else time.time())
        self.logs = StateDir(self.dir / "logs")
        self.logs.create()
        self.events = jobfiles.BoundedLog(self.logs / f"{EVENTS}.log")
        self.lock = threading.Lock()
        self.shares: dict[str, RemoteShare | LocalShare] = {}
        self.followers: list[threading.Thread] = []
        self.outcome: Outcome | None = None
        self.aborting = False
        self.cancel_event = threading.Event()
        self.store = None
        self.store_port = 0
        self.project = self.spec.project or self.spec.job_id
        self.guard: JobGuard | None = None     # the job's store answers only the job's nodes
        self.allowed: list[str] = []           # the overlay addresses of the job's nodes
        self.packed: Packed | None = None        # the code as shipped (elastic additions get the same)

    # ------------------------------------------------------------------ bookkeeping
    def say(self, text: str) -> None:
        """A line of the supervisor's own, shown by `meshrun train`/`logs` and kept in the daemon log."""
        log.info("job %s: %s", self.job_id, text)
        self.events.write(f"{int(time.time() * 1000)} meshrun: {text}")

    def save(self) -> None:
        self.dir.write_json("job.json", self.record.to_dict())

    def candidates(self) -> list[RemoteShare | LocalShare]:
        return candidates(self.state, self.spec, self.network, self.members, self.rec)

    # ------------------------------------------------------------------ the run
    def run(self) -> None:
        try:
            self._run()
        finally:
            if self.guard is not None:
                self.guard.remove()

    def _run(self) -> None:
        self.save()
        procs.notify_ready()
        try:
            self._launch()
        except Exception as exc:  # noqa: BLE001 -- whatever stops the launch must end the job, not orphan it
            if not isinstance(exc, MeshrunError):
                log.exception("the launch of %s failed", self.job_id)
                exc = MeshrunError(f"internal error ({type(exc).__name__}: {exc})",
                                   f"please report it with {self.dir / 'supervisor.out'}")
            with self.lock:
                started = list(self.shares.values())
            for s in started:         # a share that did start must not run on alone
                _quietly(s.cancel, self.job_id)
            if self.cancel_event.is_set():
                state, code, message = "cancelled", EXIT_CANCELLED, f"job {self.job_id} cancelled"
            else:
                state, code, message = "failed", exc.exit_code or 1, f"job {self.job_id} could not start: {exc}"
            self.record.state, self.record.exit_code, self.record.message = state, code, message
            self.record.ended = time.time()
            self.say(message)
            self.save()
            return
        self._supervise()

    def _host_store(self):
        # rdzv_port itself is the coordinator's store for `meshrun train --local` shares.
        for port in range(self.network.rdzv_port + 1, self.network.rdzv_port + STORE_PORTS):
            try:
                return rdzv.serve_store(self.network.coordinator_ip, port, self.network.interface), port
            except (OSError, RuntimeError):
                continue
        raise LaunchError(f"no free port for the rendezvous store on {self.network.coordinator_ip}:"
                          f"{self.network.rdzv_port + 1}-{self.network.rdzv_port + STORE_PORTS - 1}",
                          "wait for other jobs to end")

    def _launch(self) -> None:
        cands = self.candidates()
        if not cands:
            raise LaunchError("no node has joined this network yet", "run `meshrun join TOKEN` on the GPU machines")
        lo, hi = self.spec.bounds(len(cands))
        want = min(hi, len(cands))
        ready = self._wait_for(cands, want, lo if lo < want else None)
        by_name = {s.name: s for s, _ in ready}
        if not self.spec.no_sync:
            self.packed = pack(self.spec, self.state)
            self.say(f"shipping {len(self.packed.manifest)} file(s), {codeset.human_bytes(self.packed.bytes)} "
                     f"to project {self.project!r} on every node")
            self._each([s for s, _ in ready], lambda s: s.ship(self.job_id, self.project, self.packed.blob))
        if not self.spec.skip_preflight:
            self._preflight(ready)
        # Every port of the job, its store here included, answers only the job's nodes: the guard is there
        # before anything listens. The store comes after the pre-flight: hosting it imports torch, a refusal
        # should not wait for that.
        self.allowed = sorted({s.overlay_ip for s, _ in ready})
        self.guard = JobGuard(self.job_id, f"{self.rec['name']}/store", self.network.interface).create(self.allowed)
        self.guard.join()
        self.store, self.store_port = self._host_store()
        plans = plan(self.spec, self.network, [(s.name, s.overlay_ip, h) for s, h in ready], self.store_port)
        self.outcome = Outcome(self.spec.elastic, lo if self.spec.nnodes else len(plans))
        self._each(plans, lambda p: self._start(by_name[p.node], p))
        self.record.state, self.record.started = "running", time.time()
        self.record.nodes = [p.node for p in plans]
        self.record.ranks = sum(nproc(p) for p in plans)
        self.save()
        self.say(f"job {self.job_id} on {len(plans)} node(s): {', '.join(p.node for p in plans)}")

    def _preflight(self, ready: list[tuple]) -> None:
        """Compare the nodes' environments (meshrun.core.preflight); LaunchError with the table if they
        cannot run this job together, the table as a warning if they can but differ."""
        t0 = time.monotonic()
        reports, here = check_environments(self.spec, [s for s, _ in ready], {s.name: h for s, h in ready},
                                           self.job_id, self.project)
        # The reference is exactly what was shipped, or the coordinator's own --no-sync copy read at the
        # same moment as the nodes' (never a second read of a directory that may be changing).
        reference = self.packed.manifest if self.packed is not None else here
        findings = preflight.compare(reports, codeset.digest(reference) if reference is not None else None,
                                     self.spec.nproc_per_node is None, reference_files=reference)
        took = f"{time.monotonic() - t0:.2f} s"
        if not findings:
            self.say(f"pre-flight: {len(reports)} node(s) agree (torch {reports[0].torch}, {reports[0].build}) in {took}")
            return
        for line in preflight.table(reports, findings):
            self.say(line)
        verdict = "refused" if preflight.blocking(findings) else f"{len(findings)} warning(s), the job goes on"
        self.say(f"pre-flight: {len(reports)} node(s) checked in {took}: {verdict}")
        if preflight.blocking(findings):
            raise LaunchError("pre-flight refused the job: " + "; ".join(
                f"{', '.join(f.nodes)}: {f.what}" for f in findings if f.level == preflight.BLOCK),
                "fix what the table above says, or pass --skip-preflight if you know better")

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
            if len(ready) >= want or (enough is not None and len(ready) >= enough
                                      and waited >= min(ELASTIC_GRACE_S, self.spec.wait_timeout)):
                return ready[:want]
            if self.cancel_event.is_set():
                raise LaunchError("cancelled while waiting for the nodes", "")
            if waited >= self.spec.wait_timeout:
                raise LaunchError(f"only {len(ready)} of {want} nodes were ready after {self.spec.wait_timeout:.0f} s; "
                                  f"not answering: {', '.join(missing) or 'none'}",
                                  "check `meshrun status` on the coordinator and that those agents run "
                                  "(`meshrun join`/`meshrun up` on them), or lower --nnodes")
            time.sleep(1)

    def _start(self, s, p: launch.NodeLaunch) -> None:
        s.start(self.job_id, list(p.argv), p.env, self.spec.cwd if self.spec.no_sync else None, self.project,
                list(self.allowed))
        with self.lock:
            self.shares[s.name] = s
            self.outcome.shares[s.name] = None
        t = threading.Thread(target=self._follow, args=(s,), name=f"follow-{s.name}", daemon=True)
        self.followers.append(t)
        t.start()

    def _each(self, items, fn) -> None:
        with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
            list(pool.map(fn, items))     # the first error (in order) is raised, after all finished

    # ------------------------------------------------------------------ following the shares
    def _follow(self, s) -> None:
        mirror = jobfiles.BoundedLog(self.logs / f"{s.name}.log")
        offset, last_ok = 0, time.monotonic()
        try:
            while True:
                try:
                    ans = s.output(self.job_id, offset)
                except MeshrunError as exc:
                    if time.monotonic() - last_ok >= LOST_AFTER_S:
                        with self.lock:
                            self.outcome.lost[s.name] = time.time()
                        self.say(f"lost {s.name}: no answer from its agent for {LOST_AFTER_S:.0f} s ({exc.message})")
                        return
                    time.sleep(1)
                    continue
                last_ok = time.monotonic()
                now_ms = int(time.time() * 1000)
                for line in ans.get("lines", []):
                    mirror.write(f"{now_ms} {line}")
                offset = int(ans.get("offset", offset))
                if ans.get("done"):
                    with self.lock:
                        self.outcome.shares[s.name] = ShareEnd.from_dict(ans.get("status") or {})
                    return
        finally:
            mirror.close()

    def _supervise(self) -> None:
        next_scale = time.monotonic() + SCALE_UP_EVERY_S
        while True:
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

    def _abort(self, reason: str) -> None:
        """Stop every running share: at once when cancelled or below MIN, after FAIL_GRACE_S on a failure."""
        self.aborting = True
        grace = 0.0 if reason == "cancelled" or self.outcome.below_min else FAIL_GRACE_S
        self.say(("cancelling the job on every node" if reason == "cancelled" else
                  f"{reason}; stopping the other nodes" + (f" in {grace:.0f} s" if grace else "")))

        def stop() -> None:
            time.sleep(grace)
            with self.lock:
                running = [self.shares[n] for n in self.outcome.running()]
            for s in running:
                threading.Thread(target=_quietly, args=(s.cancel, self.job_id), daemon=True).start()
        threading.Thread(target=stop, daemon=True).start()

    def cancel(self) -> None:
        """SIGTERM: cancel the job everywhere (the loop notices and stops the shares)."""
        self.cancel_event.set()

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
            (p,) = plan(self.spec, self.network, [(s.name, s.overlay_ip, h)], self.store_port, local=True)
            try:
                if self.packed is not None:     # the code the job started with, not what the directory holds now
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
        with self.lock:
            running = [self.shares[n] for n in self.outcome.running()]
        for s in running:
            _quietly(s.allow, self.job_id, [ip])


def candidates(state: StateDir, spec: JobSpec, network: Network, members: list[Member],
               rec: dict) -> list[RemoteShare | LocalShare]:
    """Every member that may take a share of `spec`, in the order the plan gives them ranks (the
    coordinator first when it trains). UsageError when --nodes names a member that does not exist."""
    nodes = [m for m in members if not m.is_coordinator]
    if spec.nodes:
        unknown = sorted(set(spec.nodes) - {m.name for m in nodes})
        if unknown:
            raise UsageError(f"--nodes names unknown node(s): {', '.join(unknown)}",
                             f"members are: {', '.join(m.name for m in nodes) or 'none'}")
        nodes = [m for m in nodes if m.name in spec.nodes]
    out: list[RemoteShare | LocalShare] = [RemoteShare(network, m, member.job_key(state, m.public_key))
                                           for m in nodes]
    if spec.with_coordinator or rec.get("train"):
        out.insert(0, LocalShare(state, spec.job_id, rec["name"], network.coordinator_ip, network.interface))
    return out


def check_environments(spec: JobSpec, shares, healths: dict[str, dict], job_id: str,
                       project: str) -> tuple[list[preflight.EnvReport], dict[str, str] | None]:
    """Every share's environment report, asked in parallel, with its clock offset from ours; and, for a
    --no-sync job, the coordinator's own copy of the code hashed at the same moment (None otherwise)."""
    def one(s) -> preflight.EnvReport:
        python = spec.python or str(healths.get(s.name, {}).get("python") or "python3")
        t0 = time.time()
        try:
            d = s.preflight(job_id, python, _unsynced_code(spec), project)
        except MeshrunError as exc:
            return preflight.EnvReport(s.name, python=python, error=exc.message)
        t1 = time.time()
        d["clock_offset_s"] = (preflight.clock_offset(t0, t1, float(d["time"]), float(d.get("took", 0.0)))
                               if "time" in d else None)
        return preflight.EnvReport.from_dict(s.name, d)
    with ThreadPoolExecutor(max_workers=max(1, len(shares)) + 1) as pool:
        here = pool.submit(coordinator_copy, spec)
        reports = list(pool.map(one, shares))
        return reports, here.result()


def _unsynced_code(spec: JobSpec) -> str | None:
    """The directory each node hashes for a --no-sync job (None: the shipped copy, or nothing to hash).

    A module job without sync (`meshrun bench`) runs what each node's environment has installed,
    which the version rows compare; its cwd may be anything ("/"), so it is not hashed.
    """
    return spec.cwd if spec.no_sync and not spec.module else None


def coordinator_copy(spec: JobSpec) -> dict[str, str] | None:
    """The coordinator's own copy of a --no-sync job's code, hashed now ({file: sha256}); None when the
    job ships its code (the shipped manifest is the reference), has none here, or it is too large to
    hash (the nodes are then compared among themselves)."""
    unsynced = _unsynced_code(spec)
    if not unsynced or not Path(unsynced).is_dir():
        return None
    return archive.hash_files(unsynced, archive.select_files(unsynced).names)


def pack(spec: JobSpec, state: StateDir) -> Packed:
    """The job's code as it ships: the project's files (ignore rules applied, never meshrun's state), read once."""
    return archive.pack(archive.select_files(code_dir(spec), exclude=[state.path]), spec.sync_limit_mb)


def ask_health(s) -> dict | None:
    """The share's health answer (GPUs, interpreter), or None if its agent does not answer."""
    try:
        return s.health()
    except MeshrunError:
        return None


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except MeshrunError as exc:
        log.warning("%s", exc)


def nproc(p: launch.NodeLaunch) -> int:
    return int(p.argv[p.argv.index("--nproc-per-node") + 1])


def code_dir(spec: JobSpec) -> Path:
    """The directory a job ships: its cwd (a module job), else the script's directory."""
    cwd = Path(spec.cwd)
    if spec.module:
        return cwd
    script = cwd / spec.script
    if not script.is_file():
        raise UsageError(f"script {spec.script!r} not found in {cwd}",
                         "run `meshrun train` from the directory of your training code, or use --no-sync")
    return script.parent


def plan(spec: JobSpec, network: Network, ready: list[tuple[str, str, dict]], store_port: int,
         local: bool = False) -> list[launch.NodeLaunch]:
    """Every ready node's torchrun command and environment for `spec` (ready: name, overlay IP, health)."""
    script = spec.script
    if not spec.no_sync and not spec.module:
        script = Path(script).name        # the script's directory is shipped and becomes the job's cwd
    opts = launch.TrainOptions(
        script=script, script_args=tuple(spec.script_args), nnodes=spec.nnodes, nproc_per_node=spec.nproc_per_node,
        max_restarts=spec.max_restarts, job_id=spec.job_id, rdzv_host=network.coordinator_ip, rdzv_port=store_port,
        interface=network.interface, python=spec.python or "python3", rdzv_timeout=spec.rdzv_timeout,
        module=spec.module)
    infos = [launch.NodeInfo(name, ip, int(h.get("gpus", 0) or 0)) for name, ip, h in ready]
    plans = launch.plan(infos, opts, spec.env, local=local)
    if spec.python:
        return plans
    # By default each node uses the interpreter its agent runs under: it has meshrun and torch.
    pythons = {name: str(h.get("python") or "python3") for name, _, h in ready}
    return [launch.NodeLaunch(p.node, (pythons[p.node], *p.argv[1:]), p.env) for p in plans]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        sys.stderr.write("usage: python -m meshrun.jobs.supervisor STATE_DIR JOB_ID\n")
        return 2
    state, job_id = StateDir(args[0]), args[1]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        lock = procs.DaemonLock(state / "jobs" / job_id / "supervisor.lock").acquire(f"job {job_id}'s supervisor")
        sup = Supervisor(state, job_id)
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
