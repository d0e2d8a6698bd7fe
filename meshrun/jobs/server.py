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

import io
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from meshrun.errors import LaunchError, MeshrunError, UsageError
from meshrun.system.transport import JSONServer, Request, Response

log = logging.getLogger("meshrun.jobs.server")

JOB_ID_RE = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,64}\Z")  # never "." or "..": it names a directory
MAX_CODE = 200 * 1024 * 1024
TICK_S = 2.0
KILL_GRACE_S = 5.0


def visible_gpus() -> int:
    """Number of CUDA devices a worker on this node would see (0 without a GPU)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


# --------------------------------------------------------------------------- process trees

def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, start time) for every process we can see."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            table[int(entry)] = (int(rest[1]), rest[19])
        except (OSError, IndexError, ValueError):
            continue
    return table


def descendants(root: int) -> dict[int, str]:
    """{pid: start time} of `root` and everything below it."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in out:
            out[pid] = table[pid][1]
            todo.extend(children.get(pid, []))
    return out


def kill_tree(proc: subprocess.Popen, grace: float = KILL_GRACE_S) -> None:
    """Stop `proc` and all its descendants: SIGTERM first, SIGKILL after `grace` seconds.

    PIDs are snapshotted before any signal (workers get re-parented once torchrun exits)
    and re-checked by start time before SIGKILL, so a reused PID is never hit.
    """
    tree = descendants(proc.pid)
    for pid in tree:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        tree.update({p: s for p, s in descendants(proc.pid).items() if p not in tree})
        if proc.poll() is not None and not _alive(tree):
            return
        time.sleep(0.1)
    table = _proc_table()
    for pid, start in tree.items():
        if pid in table and table[pid][1] == start:
            _signal(pid, signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _alive(tree: dict[int, str]) -> bool:
    table = _proc_table()
    return any(pid in table and table[pid][1] == start and _state(pid) != "Z" for pid, start in tree.items())


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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
            self.proc = subprocess.Popen(argv, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
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
            kill_tree(self.proc)

    def exit_records(self) -> list[dict]:
        recs = []
        for f in sorted(self.job_dir.glob("exit-r*.json")):
            try:
                recs.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        return recs

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


class JobServer:
    """HTTP job API of one agent."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.network = agent.network
        self.jobs_dir = agent.state.path / "jobs"
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()
        self.gpus = visible_gpus()
        self.server = JSONServer((agent.rec["overlay_ip"], self.network.api_port), self.handle,
                                 device=self.network.interface, max_body=MAX_CODE)
        self.server.start("jobs")

    def close(self) -> None:
        with self.lock:
            jobs = list(self.jobs.values())
        for j in jobs:
            j.cancel()
        self.server.shutdown()
        self.server.server_close()

    def handle(self, req: Request) -> Response:
        if req.client_ip != self.network.coordinator_ip:
            return Response.error(403, f"{req.client_ip} is not the coordinator")
        if req.method == "GET" and req.path == "/v1/health":
            with self.lock:
                running = [j for j, job in self.jobs.items() if job.proc.poll() is None]
            return Response(200, {"name": self.agent.rec["name"], "gpus": self.gpus, "jobs": running,
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
        dest = job_dir / "code"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True, mode=0o700)
        try:
            with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
                tar.extractall(dest, filter="data")  # refuses absolute paths, .., devices, links out
        except (tarfile.TarError, OSError, EOFError) as exc:
            return Response.error(400, UsageError(f"the code archive cannot be unpacked ({exc})",
                                                  "retry; meshrun train builds it itself"))
        return Response(200, {"files": sum(1 for _ in dest.rglob("*"))})

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
            return Response.error(400, LaunchError(f"working directory {cwd} does not exist on "
                                                   f"{self.agent.rec['name']}",
                                                   "drop --no-sync so meshrun ships the code, or copy it there"))
        job_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self.lock:
            old = self.jobs.get(job_id)
            if old is not None and old.proc.poll() is None:
                return Response.error(409, LaunchError(f"job {job_id} already runs here", "use a new job id"))
            try:
                job = Job(job_id, argv, env, cwd, job_dir)
            except MeshrunError as exc:
                return Response.error(400, exc)
            self.jobs[job_id] = job
        log.info("job %s started: %s", job_id, " ".join(argv))
        return Response(200, stream=job.stream())


def start_job_server(agent) -> JobServer:
    try:
        return JobServer(agent)
    except OSError as exc:
        raise MeshrunError(f"cannot listen on {agent.rec['overlay_ip']}:{agent.network.api_port}: {exc.strerror}",
                           "free that port on the node") from None
