"""A node's job API: the coordinator starts, follows and cancels this node's shares here.

It listens on the node's overlay IP with the socket bound to the WireGuard device, answers only
the coordinator's overlay address, and only requests that carry a valid MAC under this node's
job key (meshrun.core.auth): a process on the coordinator that cannot read the coordinator's
job key (anyone but root) cannot start, read or cancel anything, and a captured request cannot
be replayed.

  GET  /v1/health                 name, GPUs, Python, running shares
  POST /v1/jobs/ID/code           the job's code (tar.gz), unpacked into <state>/jobs/ID/code
  POST /v1/jobs/ID/preflight      {python, cwd}: what that interpreter has, free disk, the code's hash, the clock
  POST /v1/jobs/ID/start          {argv, env, cwd}: start the share (meshrun.jobs.share)
  POST /v1/jobs/ID/output         {offset, wait}: output lines from `offset`, then the share's end
  POST /v1/jobs/ID/cancel         stop the share

Shares run in their own processes, so they outlive an agent restart; the API finds them again
through their job directories.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from pathlib import Path

from meshrun.core import auth
from meshrun.core.jobs import JOB_ID_RE
from meshrun.core.model import Network
from meshrun.errors import LaunchError, MeshrunError, UsageError
from meshrun.jobs.share import cancel_share, share_output, share_running, start_share
from meshrun.system import archive, host, jobfiles
from meshrun.system.store import StateDir
from meshrun.system.transport import JSONServer, Request, Response

log = logging.getLogger("meshrun.jobs.server")

MAX_CODE = 200 * 1024 * 1024
OUTPUT_WAIT_MAX = 10.0
ROUTE = re.compile(r"^/v1/jobs/([^/]+)/(code|preflight|start|output|cancel)$")


def preflight(job_dir: StateDir, python: str, cwd: object = None) -> dict:
    """This node's environment for a job (meshrun.core.preflight.EnvReport fields), with its clock."""
    t0 = time.monotonic()
    report = host.environment(python)
    code = Path(str(cwd)) if cwd else job_dir / "code"
    report.update(free_bytes=host.free_bytes(job_dir.path), code_hash=archive.tree_hash(code))
    # "took" lets the caller tell our work from the network in the round trip (preflight.clock_offset)
    report.update(took=time.monotonic() - t0, time=time.time())
    return report


class JobAPI:
    """The job API's handler for node `name`: shares under `jobs_dir`, requests checked with `key`."""

    def __init__(self, jobs_dir: Path, network: Network, name: str, key: bytes, gpus: int = 0,
                 start=start_share) -> None:
        self.network = network
        self.name = name
        self.jobs_dir = StateDir(jobs_dir)
        self.verifier = auth.Verifier(key)
        self.gpus = gpus
        self.start = start           # tests pass a stand-in that runs nothing

    def handle(self, req: Request) -> Response:
        if req.client_ip != self.network.coordinator_ip:
            log.warning("refused job request %s %s from %s: not the coordinator", req.method, req.path, req.client_ip)
            return Response.error(403, f"{req.client_ip} is not the coordinator")
        try:
            self.verifier.verify(req.headers.get("Authorization"), req.method, req.path, req.raw, time.time())
        except auth.AuthError as exc:
            log.warning("refused job request %s %s from %s: %s", req.method, req.path, req.client_ip, exc.message)
            return Response.error(401, exc)
        if req.method == "GET" and req.path == "/v1/health":
            return Response(200, {"name": self.name, "gpus": self.gpus, "python": sys.executable,
                                  "jobs": [j for j in jobfiles.job_ids(self.jobs_dir)
                                           if share_running(StateDir(self.jobs_dir / j))]})
        m = ROUTE.match(req.path)
        if not m or req.method != "POST":
            return Response.error(404, f"no such endpoint {req.method} {req.path}")
        job_id, action = m.groups()
        if not JOB_ID_RE.match(job_id):
            return Response.error(400, UsageError(f"bad job id {job_id!r}", "use [A-Za-z0-9_.-]{1,64}"))
        job_dir = StateDir(self.jobs_dir / job_id)
        if action == "code":
            job_dir.create()
            return Response(200, {"files": archive.unpack_code(req.raw, job_dir / "code")})
        body = req.body if isinstance(req.body, dict) else {}
        if action == "preflight":
            return Response(200, preflight(job_dir, str(body.get("python") or sys.executable), body.get("cwd")))
        if action == "start":
            return self._start(job_id, job_dir, body)
        if not (job_dir / "share.json").exists():
            return Response.error(404, LaunchError(f"job {job_id} has no share on {self.name}", "check the job id"))
        if action == "cancel":
            cancelled = cancel_share(job_dir)
            log.info("job %s cancelled on request (%s)", job_id, "it was running" if cancelled else "not running")
            return Response(200, {"cancelled": cancelled})
        try:
            offset = max(0, int(body.get("offset", 0)))
            wait = min(max(float(body.get("wait", 0)), 0.0), OUTPUT_WAIT_MAX)
        except (TypeError, ValueError, OverflowError):
            return Response.error(400, UsageError("malformed output request", "use `meshrun train`"))
        return Response(200, share_output(job_dir, offset, wait))

    def _start(self, job_id: str, job_dir: StateDir, body: dict) -> Response:
        try:
            argv = [str(a) for a in body["argv"]]
            env = {str(k): str(v) for k, v in body.get("env", {}).items()}
            cwd = body.get("cwd")
            cwd = str(cwd) if cwd else None
        except (KeyError, TypeError, AttributeError):
            return Response.error(400, UsageError("malformed start request", "use `meshrun train`"))
        if not argv:
            return Response.error(400, UsageError("empty command", "use `meshrun train`"))
        if not Path(cwd or job_dir / "code").is_dir():
            return Response.error(400, LaunchError(f"working directory {cwd or job_dir / 'code'} does not exist on "
                                                   f"{self.name}",
                                                   "drop --no-sync so meshrun ships the code, or copy it there"))
        job_dir.create()
        if share_running(job_dir):
            return Response.error(409, LaunchError(f"job {job_id} already runs on {self.name}", "use a new job id"))
        try:
            pid = self.start(job_dir, self.name, argv, env, cwd)
        except MeshrunError as exc:
            log.warning("job %s could not start: %s", job_id, exc)
            return Response.error(400, exc)
        log.info("job %s started (pid %s): %s", job_id, pid, " ".join(argv))
        return Response(200, {"pid": pid})


class JobServer:
    """The job API served on the node's overlay IP, bound to the WireGuard device."""

    def __init__(self, api: JobAPI, overlay_ip: str) -> None:
        self.api = api
        self.server = JSONServer((overlay_ip, api.network.api_port), api.handle, device=api.network.interface,
                                 max_body=MAX_CODE)
        self.server.start("jobs")

    def close(self) -> None:
        # Shares are left running: they belong to their job, not to this agent process.
        self.server.shutdown()
        self.server.server_close()


def start_job_server(state: StateDir, network: Network, rec: dict) -> JobServer:
    """The node's job API (an agent extension): shares under <state>/jobs, served on its overlay IP."""
    key = auth.decode_key(state.read("job.key").decode())
    # Pre-flight reports import torch once (a second or two): do it now, not while a job waits.
    threading.Thread(target=host.environment, args=(sys.executable,), name="preflight-warm", daemon=True).start()
    try:
        return JobServer(JobAPI(state / "jobs", network, rec["name"], key, gpus=host.visible_gpus()),
                         rec["overlay_ip"])
    except OSError as exc:
        raise MeshrunError(f"job API unavailable: cannot listen on {rec['overlay_ip']}:{network.api_port}: "
                           f"{exc.strerror}", "free that port on the node") from None
