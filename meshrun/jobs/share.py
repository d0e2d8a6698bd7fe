"""One node's share of a job: ``python -m meshrun.jobs.share JOB_DIR`` runs torchrun and outlives its caller.

The node's job API (or, on the coordinator, the job's supervisor) starts this process in its own
session with meshrun.system.machine.procs.spawn_daemon; it is ready once torchrun runs. It holds
JOB_DIR/share.lock while it lives (the agent finds running shares again after its own restart by
that lock), writes every output line to JOB_DIR/output.log (bounded), and on exit writes
JOB_DIR/status.json: torchrun's exit code or signal, the workers' failure records, torchrun's own
last error line, and whether it was cancelled. SIGTERM cancels: the whole tree under torchrun is
stopped. SIGHUP is ignored: a closed terminal anywhere is not a reason to stop training.
"""

from __future__ import annotations

import codecs
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.core import termtext
from meshrun.core.firewall import ProcessGate
from meshrun.core.jobspec import ShareEnd
from meshrun.core.termtext import LINE_RE, is_noise
from meshrun.errors import LaunchError, MeshrunError
from meshrun.system.files import joblogs, statedir
from meshrun.system.files.joblogs import BoundedLog
from meshrun.system.files.projects import ProjectDir
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import net
from meshrun.system.kernel.firewall import JobGuard
from meshrun.system.machine import procs, warmfork

# Bytes read at most for one line: a worker's capped line (MAX_LINE characters, up to 4 bytes each in UTF-8)
# with its prefix and redraw marker comes whole; anything longer (torchrun's own) is passed on in pieces.
LINE_CAP = 4 * termtext.MAX_LINE + 256
# torchrun's own lines that name what went wrong (the last one is the most specific)
STATE_ENV = "MESHRUN_STATE_DIR"  # the member's state directory, for torchrun's agent (meshrun.jobs.rdzv_backend)
ERROR_RE = re.compile(r"^\S*(Error|Exception)\b.*?: \S|^RuntimeError|^ERROR:")


def _interface_of(address: str) -> str | None:
    """The interface holding `address` here; None when none does or `ip` fails (the site group then uses
    the process's default interface, the overlay)."""
    try:
        return net.interface_of(address)
    except MeshrunError:
        return None


class Share:
    """The running share: torchrun, the pumps copying its output, and how it ended."""

    def __init__(self, job_dir: Path) -> None:
        self.dir = statedir.StateDir(job_dir)
        spec = self.dir.read_json("share.json")
        self.node = str(spec.get("node", ""))
        self.argv = [str(a) for a in spec["argv"]]
        self.env = {str(k): str(v) for k, v in spec.get("env", {}).items()}
        self.state = str(spec.get("state") or "")  # the member's: its rendezvous requests are signed with its key
        self.cwd = str(spec.get("cwd") or self.dir / "code")
        # The project's persistent directory: the working directory of a shipped job, $MESHRUN_OUTPUT_DIR always.
        self.project = ProjectDir(StateDir(spec["state"]), str(spec["project"])) if spec.get("project") else None
        self.job_id = self.dir.path.name if self.dir.path.name != "share" else self.dir.path.parent.name
        self.log = BoundedLog(self.dir / "output.log")
        self.error = ""
        self.cancelled = threading.Event()
        self.proc = None

    def guard(self) -> JobGuard | None:
        """The job's guard, made now and joined by this process (torchrun and the workers inherit it)."""
        spec = self.dir.read_json("share.json").get("guard")
        if not spec:
            return None
        gate = ProcessGate.from_record(spec.get("gate"))
        g = JobGuard(self.job_id, self.node, str(spec["interface"]), gate).create([str(ip) for ip in spec["allow"]])
        try:
            g.join()
        except OSError as exc:
            g.remove()
            raise LaunchError(
                f"cannot move the share of job {self.job_id} into its cgroup: {exc}", "run the agent as root"
            ) from None
        return g

    def start(self) -> None:
        env = {**os.environ, **self.env, "MESHRUN_JOB_DIR": str(self.dir.path)}
        if self.state:
            env[STATE_ENV] = self.state  # meshrun.jobs.rdzv_backend signs its requests to the coordinators
        if self.project is not None:
            env["MESHRUN_OUTPUT_DIR"] = str(self.project.work)
            env["MESHRUN_PROJECT"] = self.project.name
        site_addr = env.get("MESHRUN_SITE_ADDR")
        if site_addr and not env.get("MESHRUN_SITE_IFNAME"):
            # The coordinator knows the node's site address, only the node its interface (gloo binds by name).
            dev = _interface_of(site_addr)
            if dev:
                env["MESHRUN_SITE_IFNAME"] = dev
        try:
            self.proc = procs.popen(
                self.argv,
                cwd=self.cwd,
                env=env,
                stdin=procs.DEVNULL,
                stdout=procs.PIPE,
                stderr=procs.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise LaunchError(
                f"cannot start {self.argv[0]} on {self.node}: {exc.strerror}",
                "check that the Python interpreter and torch are installed on every node",
            ) from None
        self.pumps = [
            threading.Thread(target=self._pump, args=(s, s is self.proc.stderr), daemon=True)
            for s in (self.proc.stdout, self.proc.stderr)
        ]
        for t in self.pumps:
            t.start()

    def _pump(self, pipe, is_stderr: bool) -> None:
        """Copy torchrun's output (`pipe`, binary) into output.log line by line, never holding more than
        LINE_CAP bytes. The workers' lines come formed (prefixed, cleaned, redraws marked: meshrun.jobs.worker)
        and are kept as they are; torchrun's own are settled as a terminal shows them and prefixed [node]."""
        prefix = f"[{self.node}] "
        # Incremental: a UTF-8 character cut by the bounded read is finished by the next one, not garbled.
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        cut = False  # the last read ended inside a line (it was passed on as a piece)
        for raw in iter(lambda: pipe.readline(LINE_CAP), b""):
            ended = raw.endswith(b"\n")
            text = decode(raw).removesuffix("\n")
            if not (cut and ended and not text):  # not just the end of a line already passed on
                self._line(text, prefix, is_stderr)
            cut = not ended
        rest = decode(b"", final=True)
        if rest:
            self._line(rest, prefix, is_stderr)
        pipe.close()

    def _line(self, line: str, prefix: str, is_stderr: bool) -> None:
        m = LINE_RE.match(line)
        ours = m is not None and m.group("node") == self.node and m.group("rank") is not None
        if not ours:
            line = termtext.settle(line)
        if is_noise(line):
            return
        if not ours:
            if is_stderr and ERROR_RE.search(line):
                self.error = line.strip()[:300]
            line = prefix + line
        self.log.write(line)

    def cancel(self) -> None:
        if self.proc is not None and not self.cancelled.is_set():
            self.cancelled.set()
            procs.stop_tree(self.proc.pid)  # torchrun passes it to each worker, which passes it to the script

    def wait(self) -> ShareEnd:
        rc = self.proc.wait()
        procs.kill_tree(self.proc.pid, grace=2)  # workers torchrun left behind, if any
        for t in self.pumps:
            t.join(10)
        failures = [
            r for r in statedir.read_json_files(self.dir.path, "exit-r*.json") if r.get("exit_code") not in (0, None)
        ]
        sig = signal.Signals(-rc).name if rc < 0 else None
        return ShareEnd(
            code=None if sig else rc,
            signal=sig,
            failures=failures,
            error=self.error,
            cancelled=self.cancelled.is_set(),
            ended=time.time(),
        )


def start_share(
    job_dir: StateDir,
    node: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str | None,
    state: StateDir | None = None,
    project: str | None = None,
    guard: dict | None = None,
    timeout: float = 30,
) -> int:
    """Write the share's command and start `python -m meshrun.jobs.share` for it; its PID once torchrun runs.

    With `project` (and the member's `state`) the share holds that project's directory while it runs
    (LaunchError from the share when another job has it) and its workers get $MESHRUN_OUTPUT_DIR. With
    `guard` ({"interface", "allow": [overlay IPs], "gate": ProcessGate.record()}) every port the job opens
    answers only those addresses on the overlay, and on this member only the job's own processes
    (meshrun.system.kernel.firewall.JobGuard, made before torchrun starts, removed after it).
    """
    job_dir.write_json(
        "share.json",
        {
            "node": node,
            "argv": argv,
            "env": env,
            "cwd": cwd,
            "state": str(state.path) if state is not None else None,
            "project": project,
            "guard": guard,
        },
    )
    job_dir.remove("status.json", "output.log")
    return procs.spawn_daemon(
        [sys.executable, "-m", "meshrun.jobs.share", str(job_dir.path)],
        job_dir / "share.out",
        timeout=timeout,
        what=f"the share of job {job_dir.path.name}",
    )


def share_running(job_dir: StateDir) -> bool:
    return procs.DaemonLock(job_dir / "share.lock").held()


def cancel_share(job_dir: StateDir) -> bool:
    """Stop a running share (its process cancels torchrun and records it); True if one ran."""
    return procs.DaemonLock(job_dir / "share.lock").stop(timeout=30)


REGROUP = "regroup.json"  # what the supervisor said at its last regroup, read by the rendezvous handler
# How long after a regroup its member list may complete a rendezvous round early: long enough for the round
# it restarted; a node added to the job later (scale-up) is never left out of a round for being unlisted.
REGROUP_ROUND_S = 60.0


@dataclass(frozen=True)
class Regroup:
    """The supervisor's last word on an elastic job's membership, as one share was told it.

    `lost`: {overlay IP: unix s it was called lost}, every node lost so far. `members`: the overlay IPs of
    the nodes the re-formed group consists of, and `at` (unix s) when that was said; empty when not told.
    """

    lost: dict[str, float] = field(default_factory=dict)
    members: frozenset[str] = frozenset()
    at: float = 0.0

    def expected(self, now: float) -> frozenset[str]:
        """The nodes whose joining completes the re-formed round (empty once REGROUP_ROUND_S passed)."""
        return self.members if now - self.at < REGROUP_ROUND_S else frozenset()


def read_regroup(job_dir: Path | str) -> Regroup:
    """What this share was told at the last regroup; an empty Regroup if nothing or unreadable."""
    try:
        data = StateDir(job_dir).read_json(REGROUP)
        lost = {str(k): float(v) for k, v in data.get("lost", {}).items() if isinstance(v, (int, float))}
        return Regroup(lost, frozenset(str(m) for m in data.get("members", [])), float(data.get("at", 0)))
    except (OSError, ValueError, TypeError, AttributeError, MeshrunError):
        return Regroup()


def restart_workers(
    job_dir: StateDir, started_before: float, lost: Sequence[str] = (), members: Sequence[str] = ()
) -> int:
    """End this share's workers that started before `started_before` (unix s), so its torchrun restarts them
    and they rendezvous again; returns how many were signalled (0: none that old, or no share runs).

    `lost`: the overlay addresses of the nodes the supervisor called lost; `members`: those of the nodes it
    restarts together (this one among them). Both are noted first (REGROUP, stamped now), so that this
    share's rendezvous handler (meshrun.jobs.rdzv_backend) drops the lost nodes from the finished round at
    once instead of waiting for their heartbeats to expire (15 s at torch's 5 s), and completes the next
    round as soon as every member joined it instead of waiting out the last call for nodes that are gone.

    For an elastic job that lost a node: the survivors' collectives would otherwise wait for the lost
    machine until torch's process-group timeout (30 minutes for gloo), because packets to a machine that is
    gone are simply dropped. Workers torchrun already restarted after the loss (a refused connection tells it
    at once when only processes died) are younger and left alone. It takes one of the job's --max-restarts."""
    if lost or members:
        now = time.time()
        before = read_regroup(job_dir.path)
        note = {"lost": {**before.lost, **dict.fromkeys(lost, now)}, "members": sorted(members), "at": now}
        job_dir.write_json(REGROUP, note)
    share = procs.DaemonLock(job_dir / "share.lock").holder()
    if share is None:
        return 0
    signalled = 0
    for agent in procs.children(share):  # torchrun (meshrun.jobs.agent)
        # Its own children are multiprocessing's forkserver, which keeps torch imported for the next workers,
        # and resource tracker: left alone. The workers are the forkserver's children (warm) or the agent's
        # (cold). Each worker passes the signal to its script's process group, as torchrun's own stop reaches
        # it: the script gets it once (signalled here as well, a checkpoint-on-SIGTERM handler ran twice).
        agent_argv = procs.argv(agent)
        workers = []
        for pid in procs.children(agent):
            helper = warmfork.is_helper(procs.argv(pid), agent_argv)
            workers += procs.children(pid) if helper else [pid]
        for pid in workers:
            born = procs.started_at(pid)
            if born is not None and born < started_before and procs.signal_pid(pid, signal.SIGTERM):
                signalled += 1
    return signalled


def share_output(job_dir: StateDir, offset: int, wait: float) -> dict:
    """Output lines from `offset` (waiting up to `wait` s for some); once the share has ended and
    everything was read, its status too."""
    deadline = time.monotonic() + wait
    while True:
        running = share_running(job_dir)
        status = None if running or not (job_dir / "status.json").exists() else job_dir.read_json("status.json")
        # Once the share has ended its log is complete: a last line without a newline is read too, so that
        # `done` always comes.
        lines, new = joblogs.read_from(job_dir / "output.log", offset, final=status is not None)
        if lines or status is not None or time.monotonic() >= deadline:
            done = status is not None and new >= joblogs.size(job_dir / "output.log")
            return {"lines": lines, "offset": new, "done": done, "status": status if done else None, "running": running}
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.stderr.write("usage: python -m meshrun.jobs.share JOB_DIR\n")
        return 2
    job_dir = Path(args[0])
    guard = None
    try:
        lock = procs.DaemonLock(job_dir / "share.lock").acquire("this job's share")
        share = Share(job_dir)
        project_lock = share.project.take(share.job_id, share.node) if share.project is not None else None
        guard = share.guard()
        share.start()
    except MeshrunError as exc:
        if guard is not None:
            guard.remove()
        procs.notify_error(exc)
        return 1
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: threading.Thread(target=share.cancel, daemon=True).start())
    procs.notify_ready()
    end = share.wait()
    share.log.close()
    share.dir.write_json("status.json", end.__dict__)
    if guard is not None:
        guard.remove()
    if project_lock is not None:
        project_lock.release()
    lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
