"""A node's job API: the coordinator starts, follows and cancels this node's shares here.

It listens on the node's overlay IP with the socket bound to the WireGuard device, accepts
connections only from the coordinators' overlay addresses (any other is closed as it is accepted), and
answers only requests that carry a valid MAC under the job key this node shares with that coordinator
(meshrun.core.auth: derived from the coordinator's and this node's WireGuard keys, so only root on a
coordinator, holding its private key, can sign), checked before the body is read; a captured request
cannot be replayed. With several coordinators (meshrun.mesh.coordinator.ha) any of them may drive a
job here (the one that took over a job whose first coordinator is gone included): which they are
comes from the member list the agent keeps (peers.json).
Request heads are capped (transport.MAX_HEAD), uploads streamed to disk with a cap; connections are
bounded.

  GET  /v1/health                 name, GPUs, Python, running shares
  POST /v1/jobs/ID/code?project=P the job's code (tar.gz), laid over project P's directory (meshrun.jobs.workdir)
  POST /v1/jobs/ID/preflight      {python, cwd, project}: that interpreter, free disk, the code's hashes, the clock
  POST /v1/jobs/ID/start          {argv, env, cwd, project, allow}: start the share (meshrun.jobs.share); every
                                  port the job opens answers only the overlay addresses in `allow`
  POST /v1/jobs/ID/output         {offset, wait}: output lines from `offset`, then the share's end
  POST /v1/jobs/ID/cancel         stop the share
  POST /v1/jobs/ID/allow          {ips}: more nodes may reach the job's ports (an elastic job grew)
  POST /v1/jobs/ID/restart        {before, lost}: end the workers started before then: torchrun restarts them and
                                  they rendezvous again (an elastic job lost a node)
  POST /v1/jobs/ID/pull           {path, max_bytes}: files from the job's working directory (tar.gz)
  POST /v1/jobs/ID/prune          delete the job's directory here (not while its share runs)
  POST /v1/projects/P/remove      delete project P's directory here (not while a job runs in it)
  POST /v1/coordinator/prepare    `meshrun coordinator add`: make this node's etcd key and TLS identity
  POST /v1/coordinator/reach      {token}: for REACH_WINDOW_S, send the token to whoever connects to this node's
                                  TCP listen port (the add checks the endpoint before anything changes)
  POST /v1/coordinator/promote    {ca, cert, cluster, ...}: start its etcd member; the agent restarts as a coordinator

Shares run in their own processes, so they outlive an agent restart; the API finds them again
through their job directories.
"""

from __future__ import annotations

import io
import ipaddress
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from meshrun.core import auth
from meshrun.core import firewall as guard_rules
from meshrun.core.jobspec import JOB_ID_RE
from meshrun.core.model import Network
from meshrun.errors import AuthError, LaunchError, MeshrunError, NetworkError, UsageError
from meshrun.jobs import workdir
from meshrun.jobs.share import cancel_share, restart_workers, share_output, share_running, start_share
from meshrun.mesh import member
from meshrun.mesh.coordinator import ha
from meshrun.system.files import joblogs
from meshrun.system.files.projects import ProjectDir, check_project
from meshrun.system.files.statedir import StateDir, remove_tree
from meshrun.system.kernel import firewall
from meshrun.system.machine import host, procs
from meshrun.system.sockets.transport import JSONServer, Request, Response

log = logging.getLogger("meshrun.jobs.nodeapi")

MAX_CODE = 200 * 1024 * 1024
MAX_CONNS = 64
MAX_LOST = 1024  # lost nodes one restart request may name
MAX_MEMBERS = 4096  # nodes of the re-formed group one restart request may name
OUTPUT_WAIT_MAX = 10.0
ROUTE = re.compile(
    r"^/v1/jobs/([^/?]+)/(code|preflight|start|output|cancel|allow|restart|pull|prune)"
    r"(?:\?project=([^&/]+))?$"
)
PROJECT_ROUTE = re.compile(r"^/v1/projects/([^/?]+)/remove$")


class Coordinators:
    """Which overlay addresses may drive jobs here, and the job key shared with each: the coordinators in the
    member list the agent keeps (peers.json, read again when it changes), the network's first coordinator
    until there is one."""

    def __init__(self, state: StateDir, network: Network) -> None:
        self.state, self.network = state, network
        self.stamp: tuple[int, int] | None = None
        self.keys: dict[str, str] = {network.coordinator_ip: network.coordinator_public_key}  # IP -> public key
        self.verifiers: dict[str, auth.Verifier] = {}  # public key -> its verifier (it remembers nonces)
        self.lock = threading.Lock()

    def _refresh(self) -> None:
        try:
            st = (self.state / "peers.json").stat()
        except OSError:
            return
        stamp = (st.st_ino, st.st_mtime_ns)  # written atomically (a new file each time): a new inode
        if stamp == self.stamp:
            return
        self.stamp = stamp
        try:
            _, members = member.load_members(self.state)
        except MeshrunError as exc:
            log.warning("cannot read the member list: %s", exc)
            return
        coords = {m.overlay_ip: m.public_key for m in members if m.is_coordinator}
        self.keys = coords or {self.network.coordinator_ip: self.network.coordinator_public_key}

    def allowed(self, ip: str) -> bool:
        with self.lock:
            self._refresh()
            return ip in self.keys

    def verifier(self, ip: str) -> auth.Verifier | None:
        with self.lock:
            self._refresh()
            pub = self.keys.get(ip)
            if pub is None:
                return None
            if pub not in self.verifiers:
                self.verifiers[pub] = auth.Verifier(member.job_key(self.state, pub))
            return self.verifiers[pub]


class JobAPI:
    """The job API's handler for node `name`: shares under `jobs_dir`, requests checked with the job key of the
    coordinator that sends them (`key`: one key, for the network's first coordinator only; or a Coordinators)."""

    def __init__(
        self,
        state: StateDir,
        network: Network,
        name: str,
        key: bytes | Coordinators,
        gpus: int = 0,
        start=start_share,
        guards=firewall,
        promoted=None,
    ) -> None:
        self.network = network
        self.firewall = guards  # meshrun.system.kernel.firewall; tests pass a FakeFirewall
        self.name = name
        self.state = state
        self.jobs_dir = joblogs.jobs_root(state)
        if isinstance(key, Coordinators):
            self.coordinators: Coordinators | None = key
            self.verifier = None
        else:
            self.coordinators = None
            self.verifier = auth.Verifier(key)
        self.promoted = promoted  # called once this node is a coordinator (the agent restarts in that role)
        self.gpus = gpus
        self.start = start  # tests pass a stand-in that runs nothing

    def gate(self, req: Request) -> Response | None:
        """Before the body is read: only the coordinator's overlay address, only with a fresh MAC under
        this node's job key (the body's hash it covers is checked once the body is in)."""
        if self.coordinators is not None:
            verifier = self.coordinators.verifier(req.client_ip)
        else:
            verifier = self.verifier if req.client_ip == self.network.coordinator_ip else None
        if verifier is None:
            log.warning("refused job request %s %s from %s: not a coordinator", req.method, req.path, req.client_ip)
            return Response.error(403, f"{req.client_ip} is not a coordinator")
        try:
            req.expect_sha256 = verifier.head(req.headers.get("Authorization"), req.method, req.path, time.time())
        except AuthError as exc:
            log.warning("refused job request %s %s from %s: %s", req.method, req.path, req.client_ip, exc.message)
            return Response.error(401, exc)
        return None

    def handle(self, req: Request) -> Response:
        if not req.gated:  # called directly (tests), not through JobServer's gate
            refused = self.gate(req)
            if refused is not None:
                return refused
        try:
            auth.Verifier.body(req.expect_sha256, req.sha256())
        except AuthError as exc:
            return Response.error(401, exc)
        if req.method == "GET" and req.path == "/v1/health":
            return Response(
                200,
                {
                    "name": self.name,
                    "gpus": self.gpus,
                    "python": sys.executable,
                    "jobs": [j for j in joblogs.job_ids(self.jobs_dir) if share_running(StateDir(self.jobs_dir / j))],
                },
            )
        if req.method == "POST" and req.path == "/v1/coordinator/prepare":
            if any(share_running(StateDir(self.jobs_dir / j)) for j in joblogs.job_ids(self.jobs_dir)):
                return Response.error(
                    409, LaunchError(f"{self.name} runs a job's share", "wait for its jobs to end, or cancel them")
                )
            log.info("a coordinator asked this node to become a coordinator: making its etcd key")
            return Response(200, ha.prepare(self.state))
        if req.method == "POST" and req.path == "/v1/coordinator/reach":
            return Response(200, ha.offer_reach(self.state, req.body if isinstance(req.body, dict) else {}))
        if req.method == "POST" and req.path == "/v1/coordinator/promote":
            body = req.body if isinstance(req.body, dict) else {}
            ha.promote(self.state, body)
            if self.promoted is not None:
                self.promoted()
            return Response(200, {"promoted": True})
        m = PROJECT_ROUTE.match(req.path)
        if m and req.method == "POST":
            removed = ProjectDir(self.state, check_project(m.group(1))).remove()
            log.info("project %s %s on request", m.group(1), "removed" if removed else "was not here")
            return Response(200, {"removed": removed})
        m = ROUTE.match(req.path)
        if not m or req.method != "POST":
            return Response.error(404, f"no such endpoint {req.method} {req.path}")
        job_id, action, project = m.groups()
        if not JOB_ID_RE.match(job_id):
            return Response.error(400, UsageError(f"bad job id {job_id!r}", "use [A-Za-z0-9_.-]{1,64}"))
        job_dir = StateDir(self.jobs_dir / job_id)
        body = req.body if isinstance(req.body, dict) else {}
        project = check_project(str(project or body.get("project") or job_id))
        if action == "code":
            job_dir.create()
            blob = req.upload if req.upload is not None else io.BytesIO(req.raw)
            return Response(200, {"files": workdir.receive_code(self.state, job_id, project, blob, self.name)})
        if action == "preflight":
            job_dir.create()
            cwd = body.get("cwd")
            return Response(
                200,
                workdir.preflight(
                    self.state, job_dir, str(body.get("python") or sys.executable), project, str(cwd) if cwd else None
                ),
            )
        if action == "start":
            return self._start(job_id, job_dir, body, project)
        if not (job_dir / "share.json").exists():
            return Response.error(404, LaunchError(f"job {job_id} has no share on {self.name}", "check the job id"))
        if action == "cancel":
            cancelled = cancel_share(job_dir)
            log.info("job %s cancelled on request (%s)", job_id, "it was running" if cancelled else "not running")
            return Response(200, {"cancelled": cancelled})
        if action == "allow":
            ips = body.get("ips")
            if not isinstance(ips, list) or not ips:
                return Response.error(400, UsageError("malformed allow request", "use `meshrun train`"))
            self.firewall.allow(job_id, self.name, [str(ip) for ip in ips])
            log.info("job %s: %s may reach its ports too", job_id, ", ".join(map(str, ips)))
            return Response(200, {"allowed": len(ips)})
        if action == "restart":
            try:
                before = float(body["before"])
                lost = [str(ipaddress.ip_address(ip)) for ip in body.get("lost", [])[:MAX_LOST]]
                members = [str(ipaddress.ip_address(ip)) for ip in body.get("members", [])[:MAX_MEMBERS]]
            except (KeyError, TypeError, ValueError):
                return Response.error(400, UsageError("malformed restart request", "use `meshrun train`"))
            n = restart_workers(job_dir, before, lost, members)
            gone = f" without {', '.join(lost)}" if lost else ""
            log.info("job %s: %d worker process(es) ended to re-form the group%s", job_id, n, gone)
            return Response(200, {"signalled": n})
        if action == "pull":
            return self._pull(job_id, job_dir, body)
        if action == "prune":
            if share_running(job_dir):
                return Response.error(409, LaunchError(f"job {job_id} still runs on {self.name}", "cancel it first"))
            remove_tree(job_dir.path)
            return Response(200, {"pruned": True})
        try:
            offset = max(0, int(body.get("offset", 0)))
            wait = min(max(float(body.get("wait", 0)), 0.0), OUTPUT_WAIT_MAX)
        except (TypeError, ValueError, OverflowError):
            return Response.error(400, UsageError("malformed output request", "use `meshrun train`"))
        return Response(200, share_output(job_dir, offset, wait))

    def _pull(self, job_id: str, job_dir: StateDir, body: dict) -> Response:
        try:
            path = str(body["path"])
            max_bytes = min(int(body.get("max_bytes", workdir.MAX_PULL_BYTES)), workdir.MAX_PULL_BYTES)
        except (KeyError, TypeError, ValueError, OverflowError):
            return Response.error(400, UsageError("malformed pull request", "use `meshrun pull`"))
        spec = job_dir.read_json("share.json")
        root = Path(str(spec.get("cwd") or ""))
        blob, files = workdir.pull(root, path, max_bytes)
        log.info("job %s: %d file(s) of %s pulled", job_id, files, path)
        return Response(200, raw=blob)

    def _start(self, job_id: str, job_dir: StateDir, body: dict, project: str) -> Response:
        try:
            argv = [str(a) for a in body["argv"]]
            env = {str(k): str(v) for k, v in body.get("env", {}).items()}
            cwd = body.get("cwd")
            cwd = str(cwd) if cwd else None
            allow = [str(ip) for ip in body["allow"]]
            guard_rules.add_allowed(guard_rules.job_table(job_id, self.name), allow)  # addresses only
        except (KeyError, TypeError, AttributeError):
            return Response.error(400, UsageError("malformed start request", "use `meshrun train`"))
        if not argv:
            return Response.error(400, UsageError("empty command", "use `meshrun train`"))
        where = workdir.workdir(self.state, project, cwd)
        if not where.is_dir():
            return Response.error(
                400,
                LaunchError(
                    f"working directory {where} does not exist on {self.name}",
                    "drop --no-sync so meshrun ships the code, or copy it there",
                ),
            )
        job_dir.create()
        if share_running(job_dir):
            return Response.error(409, LaunchError(f"job {job_id} already runs on {self.name}", "use a new job id"))
        self.firewall.sweep()  # guards that jobs killed before their cleanup left behind
        try:
            pid = self.start(
                job_dir,
                self.name,
                argv,
                env,
                str(where),
                self.state,
                project,
                {
                    "interface": self.network.interface,
                    "allow": allow,
                    "gate": self.firewall.job_gate(job_id, self.network).record(),
                },
            )
        except MeshrunError as exc:
            log.warning("job %s could not start: %s", job_id, exc)
            return Response.error(400, exc)
        log.info("job %s started (pid %s) in %s: %s", job_id, pid, where, " ".join(argv))
        return Response(200, {"pid": pid})


class JobServer:
    """The job API served on the node's overlay IP, bound to the WireGuard device."""

    def __init__(self, api: JobAPI, overlay_ip: str) -> None:
        self.api = api
        uploads = StateDir(api.state / "uploads")
        uploads.create()
        # Only the coordinator may talk here: a connection from any other address is closed as it is
        # accepted (no thread, not a byte read), so no member can hold the coordinator's slots; then a
        # few connections per job it follows, a bounded total.
        self.server = JSONServer(
            (overlay_ip, api.network.api_port),
            api.handle,
            device=api.network.interface,
            max_body=MAX_CODE,
            gate=api.gate,
            max_conns=MAX_CONNS,
            max_per_source=MAX_CONNS,
            upload_dir=str(uploads.path),
            allow_source=api.coordinators.allowed if api.coordinators is not None else {api.network.coordinator_ip},
        )
        self.server.start("jobs")

    def close(self) -> None:
        # Shares are left running: they belong to their job, not to this agent process.
        self.server.shutdown()
        self.server.server_close()


def _restart_later(delay: float = 0.5) -> None:
    """Stop this agent a moment from now (after the answer went out): it comes back in its new role."""

    def stop() -> None:
        time.sleep(delay)
        procs.signal_pid(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, name="restart", daemon=True).start()


def start_job_server(state: StateDir, network: Network, rec: dict) -> JobServer:
    """The node's job API (an agent extension): shares under <state>/jobs, served on its overlay IP."""
    coordinators = Coordinators(state, network)
    firewall.sweep()
    try:  # an interface brought up by an older meshrun has no forward guard yet (a new one got it with it)
        firewall.install_forward_guard(network.interface)
    except MeshrunError as exc:
        log.warning("no forward guard on %s: %s", network.interface, exc)
    # Pre-flight reports import torch once (a second or two, or read what another agent here found): do it now,
    # not while a job waits. (Run niced, the kernel-WireGuard VM test's scenario stalled once for 20 minutes after
    # its fourth node joined, 2026-11-29; cause not found, so it runs at the agent's priority again.)
    threading.Thread(target=host.environment, args=(sys.executable,), name="preflight-warm", daemon=True).start()
    try:
        api = JobAPI(state, network, rec["name"], coordinators, gpus=host.visible_gpus(), promoted=_restart_later)
        return JobServer(api, rec["overlay_ip"])
    except OSError as exc:
        raise NetworkError(
            f"job API unavailable: cannot listen on {rec['overlay_ip']}:{network.api_port}: {exc.strerror}",
            "free that port on the node",
        ) from None
