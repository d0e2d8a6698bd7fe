"""The agent's job API: run this node's share of a training job and stream its output.

Listens on the node's overlay IP (socket bound to the WireGuard device) and only answers
the coordinator's overlay address. `meshrun train` on the coordinator plans the command
(meshrun.core.launch), uploads the code, then POSTs /v1/jobs/ID/run and reads NDJSON events
until the job exits. If that connection drops (Ctrl-C, coordinator gone) or
/v1/jobs/ID/cancel arrives, the whole process tree is stopped: SIGTERM to torchrun, then
SIGKILL to every process that was in the tree (torchrun starts workers in their own
sessions, so killing a process group is not enough).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import sys
import threading
from pathlib import Path

from meshrun.core.model import Network
from meshrun.errors import LaunchError, MeshrunError, UsageError
from meshrun.system import archive, host, procs, store
from meshrun.system.store import StateDir
from meshrun.system.transport import JSONServer, Request, Response

log = logging.getLogger("meshrun.jobs.server")

JOB_ID_RE = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,64}\Z")  # never "." or "..": it names a directory
MAX_CODE = 200 * 1024 * 1024
TICK_S = 2.0
KILL_GRACE_S = 5.0


# --------------------------------------------------------------------------- one job

class Job:
    """A running share of a job: the torchrun process plus its output queue."""

    def __init__(self, job_id: str, argv: list[str], env: dict[str, str], cwd: Path, job_dir: Path) -> None:
        self.id = job_id
        self.job_dir = job_dir
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        full_env = dict(os.environ)
        full_env.update(env)
        full_env["MESHRUN_JOB_DIR"] = str(job_dir)
        try:
            self.proc = procs.popen(argv, cwd=cwd, env=full_env, stdin=procs.DEVNULL, stdout=procs.PIPE,
                                    stderr=procs.PIPE, start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"cannot start {argv[0]} on this node: {exc.strerror}",
                              "check the python interpreter and torch are installed on every node") from None
        self.readers = [threading.Thread(target=self._pump, args=(s, n), daemon=True)
                        for s, n in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr"))]
        for t in self.readers:
            t.start()

    def _pump(self, pipe, name: str) -> None:
        for raw in iter(pipe.readline, b""):
            self.events.put({"type": "out", "stream": name, "line": raw.decode(errors="replace").rstrip("\n")})
        pipe.close()

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            log.info("cancelling job %s", self.id)
            procs.kill_tree(self.proc.pid, KILL_GRACE_S)
            with contextlib.suppress(procs.TimeoutExpired):
                self.proc.wait(5)

    def exit_records(self) -> list[dict]:
        return store.read_json_files(self.job_dir, "exit-r*.json")

    def stream(self):
        """Yield output events, ticks while quiet, and a final exit event."""
        try:
            while True:
                try:
                    yield self.events.get(timeout=TICK_S)
                    continue
                except queue.Empty:
                    pass
                if self.proc.poll() is not None and not any(t.is_alive() for t in self.readers):
                    break
                yield {"type": "tick"}
            while not self.events.empty():
                yield self.events.get_nowait()
            yield {"type": "exit", "code": self.proc.returncode, "cancelled": self.cancelled.is_set(),
                   "failures": [r for r in self.exit_records() if r.get("exit_code") not in (0, None)]}
        finally:
            # Reached on normal end, and on GeneratorExit when the coordinator hangs up.
            if self.proc.poll() is None:
                self.cancel()


class JobAPI:
    """The job API's handler for the node `name`: jobs kept under `jobs_dir`, started by `launch`
    (a Job; tests pass a stand-in that runs nothing), `gpus` reported to the coordinator."""

    def __init__(self, jobs_dir: Path, network: Network, name: str, launch=None, gpus: int = 0) -> None:
        self.network = network
        self.name = name
        self.jobs_dir = jobs_dir
        self.launch = launch or Job
        self.gpus = gpus
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()

    def cancel_all(self) -> None:
        with self.lock:
            jobs = list(self.jobs.values())
        for j in jobs:
            j.cancel()

    def handle(self, req: Request) -> Response:
        if req.client_ip != self.network.coordinator_ip:
            return Response.error(403, f"{req.client_ip} is not the coordinator")
        if req.method == "GET" and req.path == "/v1/health":
            with self.lock:
                running = [j for j, job in self.jobs.items() if job.proc.poll() is None]
            return Response(200, {"name": self.name, "gpus": self.gpus, "jobs": running,
                                  "python": sys.executable})
        m = re.match(r"^/v1/jobs/([^/]+)/(code|run|cancel)$", req.path)
        if not m or req.method != "POST":
            return Response.error(404, f"no such endpoint {req.method} {req.path}")
        job_id, action = m.groups()
        if not JOB_ID_RE.match(job_id):
            return Response.error(400, UsageError(f"bad job id {job_id!r}", "use [A-Za-z0-9_.-]{1,64}"))
        job_dir = self.jobs_dir / job_id
        if action == "code":
            return self._code(job_dir, req.raw)
        if action == "cancel":
            with self.lock:
                job = self.jobs.get(job_id)
            if job:
                job.cancel()
            return Response(200, {"cancelled": bool(job)})
        return self._run(job_id, job_dir, req.body)

    def _code(self, job_dir: Path, blob: bytes) -> Response:
        try:
            return Response(200, {"files": archive.unpack_code(blob, job_dir / "code")})
        except UsageError as exc:
            return Response.error(400, exc)

    def _run(self, job_id: str, job_dir: Path, body: object) -> Response:
        try:
            if not isinstance(body, dict):
                raise TypeError("body must be an object")
            argv = [str(a) for a in body["argv"]]
            env = {str(k): str(v) for k, v in body.get("env", {}).items()}
            cwd = body.get("cwd")
            cwd = Path(cwd) if cwd else job_dir / "code"
        except (KeyError, TypeError, AttributeError):
            return Response.error(400, UsageError("malformed run request", "use `meshrun train`"))
        if not argv:
            return Response.error(400, UsageError("empty command", "use `meshrun train`"))
        if not cwd.is_dir():
            return Response.error(400, LaunchError(f"working directory {cwd} does not exist on {self.name}",
                                                   "drop --no-sync so meshrun ships the code, or copy it there"))
        store.make_dir(job_dir, 0o700)
        with self.lock:
            old = self.jobs.get(job_id)
            if old is not None and old.proc.poll() is None:
                return Response.error(409, LaunchError(f"job {job_id} already runs here", "use a new job id"))
            try:
                job = self.launch(job_id, argv, env, cwd, job_dir)
            except MeshrunError as exc:
                return Response.error(400, exc)
            self.jobs[job_id] = job
        log.info("job %s started: %s", job_id, " ".join(argv))
        return Response(200, stream=job.stream())


class JobServer:
    """The job API served on the node's overlay IP, bound to the WireGuard device."""

    def __init__(self, api: JobAPI, overlay_ip: str) -> None:
        self.api = api
        self.server = JSONServer((overlay_ip, api.network.api_port), api.handle, device=api.network.interface,
                                 max_body=MAX_CODE)
        self.server.start("jobs")

    def close(self) -> None:
        self.api.cancel_all()
        self.server.shutdown()
        self.server.server_close()


def start_job_server(state: StateDir, network: Network, rec: dict) -> JobServer:
    """The node's job API (an agent extension): jobs under <state>/jobs, served on its overlay IP."""
    try:
        return JobServer(JobAPI(state.path / "jobs", network, rec["name"], gpus=host.visible_gpus()), rec["overlay_ip"])
    except OSError as exc:
        raise MeshrunError(f"job API unavailable: cannot listen on {rec['overlay_ip']}:{network.api_port}: "
                           f"{exc.strerror}", "free that port on the node") from None
