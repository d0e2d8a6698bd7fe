"""What the tests share that is not a fixture: the repository's paths, the testbed helpers, strategies.

Importable from every test (pyproject.toml puts tests/ on the path): `from support import joined_mesh`.
Fixtures live in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from textwrap import dedent as _dedent

import pytest

from meshrun.core.model import Network

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
EXAMPLES = REPO_ROOT / "examples"


def cannot_run(what: str, reason: str) -> None:
    """`what` cannot run here for `reason`: fail in CI (`CI` set), where a silent skip would prove nothing, else
    skip saying why."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def netns_unavailable_reason() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to build network namespaces (run the tests as root)"
    return None


def unique_prefix() -> str:
    """A short testbed prefix unique enough for concurrent runs: "t" + 4 hex digits."""
    return "t" + secrets.token_hex(2)


def _world(dcs, prefix: str, **kw):
    """World.standard(dcs) for a count, else World(dcs): a list of DatacenterSpecs."""
    from meshrun.lab.testbed import World

    return World.standard(dcs, prefix=prefix, **kw) if isinstance(dcs, int) else World(dcs, prefix=prefix, **kw)


@contextlib.contextmanager
def joined_mesh(
    tmp_path_factory,
    dcs,
    coordinator: str,
    nodes: Sequence[str],
    init_args: Sequence[str] = (),
    promote: Sequence[str] = (),
) -> Iterator:
    """A world (`dcs` as for world_factory) with meshrun init (`init_args`) on `coordinator` and `nodes` joined,
    then the nodes in `promote` made coordinators (`meshrun coordinator add`, at their public addresses), for a
    module-scoped fixture; torn down on exit. Skips where namespaces cannot be built (in CI,
    pytest_runtest_setup fails the netns tests instead)."""
    from meshrun.lab.mesh import Mesh

    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    prefix = unique_prefix()
    world = _world(dcs, prefix, workdir=tmp_path_factory.mktemp(prefix))
    try:
        world.up()
        mesh = Mesh(world, coordinator)
        mesh.init(*init_args)
        for n in nodes:
            mesh.join(n)
        for n in promote:
            out = mesh.meshrun(coordinator, "coordinator", "add", n, "--endpoint", str(world.node(n).public_ip)).stdout
            assert f"{n} is a coordinator" in out, out
        yield mesh
    finally:
        world.down()


# examples/diloco_charlm.py at its smallest, for the jobs end-to-end tests run (a few seconds of CPU a node).
CHARLM_SMALL = (
    "--compression",
    "fp4",
    "--hidden",
    "32",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--val-batches",
    "2",
    "--threads",
    "1",
)


class TrainJob:
    """`meshrun train ARGS` on a mesh's node (the coordinator by default), in examples/, its output collected
    line by line; a project of its own (DiLoCo resumes from the snapshots an earlier job of the project left)."""

    def __init__(self, mesh, *args: str, on=None) -> None:
        project = f"job-{secrets.token_hex(3)}"
        self.proc = mesh.meshrun_popen(
            on or mesh.coordinator,
            "train",
            "--project",
            project,
            *args,
            cwd=EXAMPLES,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True
        )
        self.reader.start()

    def _read(self) -> None:
        self.lines.extend(iter(self.proc.stdout.readline, ""))

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text, re.M):
            assert self.proc.poll() is None and time.monotonic() < deadline, (
                f"no {pattern!r} within {timeout} s:\n{self.text[-4000:]}"
            )
            time.sleep(0.5)

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(10)


def meshrun_process(proc: subprocess.Popen) -> int:
    """The PID of the `meshrun` that `proc` (nsenter ... meshrun, from Mesh.meshrun_popen) runs, to signal it: `proc`
    itself once nsenter has replaced itself with meshrun (it forks only to enter a PID namespace), else nsenter's
    child that runs meshrun. Never merely a first child: a short-lived subprocess of meshrun's own would take the
    signal instead (a SIGHUP that went to one left a `meshrun train` running past its test's timeout)."""

    def argv(pid: int | str) -> list[bytes]:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")

    if not argv(proc.pid)[0].endswith(b"nsenter"):
        return proc.pid
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    found = [int(c) for c in children if b"meshrun" in argv(c)]
    assert len(found) == 1, f"no single meshrun under nsenter {proc.pid}: {[argv(c) for c in children]}"
    return found[0]


def rendezvous_together(handlers: Sequence, timeout: float) -> tuple[dict[int, object], list[BaseException]]:
    """Call next_rendezvous() on every torch rendezvous handler at once, each on its thread, as torchrun's agents
    on several nodes would; ({handler index: its RendezvousInfo}, the errors raised), after at most `timeout` s."""
    infos: dict[int, object] = {}
    errors: list[BaseException] = []

    def join(i: int) -> None:
        try:
            infos[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return infos, errors


def json_strategy(max_text: int = 40, max_list: int = 5, max_key: int = 12, max_dict: int = 6, max_leaves: int = 20):
    """Hypothesis strategy: any JSON value (NaN, huge integers and odd text included), for fuzzing parsers."""
    from hypothesis import strategies as st

    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True)
        | st.text(max_size=max_text),
        lambda children: st.lists(children, max_size=max_list)
        | st.dictionaries(st.text(max_size=max_key), children, max_size=max_dict),
        max_leaves=max_leaves,
    )


# --------------------------------------------------------------------------- a second Python environment

REPO = REPO_ROOT
PY310_VENV = REPO / ".venv-py310"
PY310_DEPS = ["typer>=0.9", "cryptography>=41", "wgconfig>=1.0", "numpy", "tomli>=1.1", "pytest>=7", "hypothesis>=6"]


def python310() -> str | None:
    """A working Python 3.10 (a pyenv shim on PATH may name one that is not installed)."""
    candidates = [
        p
        for pattern in (
            "/root/.pyenv/versions/3.10*/bin/python3.10",
            os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10"),
        )
        for p in sorted(glob.glob(pattern), reverse=True)
    ]
    candidates += [p for p in (shutil.which("python3.10"), "/usr/bin/python3.10", "/usr/local/bin/python3.10") if p]
    for py in candidates:
        ok = (
            subprocess.run(
                [py, "-c", "import sys, venv; assert sys.version_info[:2] == (3, 10)"], capture_output=True
            ).returncode
            == 0
        )
        if ok:
            return py
    return None


# A network description for unit tests of job planning and submission (nothing listens there).
JOB_NETWORK = Network(
    name="t",
    cidr="10.213.0.0/16",
    interface="meshrun0",
    listen_port=51820,
    mtu=1420,
    coordinator_ip="10.213.0.1",
    coordinator_public_key="A" * 43 + "=",
    endpoints=("192.0.2.1:51820",),
    fingerprint="0" * 64,
)


def relay_world():
    """hq (the coordinator), dca and dcb (one-to-one NAT: members that may relay), dcc and dcd (symmetric NAT:
    never direct with each other, so their pair is relayed): the relay tests' world."""
    from meshrun.lab.testbed import DatacenterSpec

    return [
        DatacenterSpec("hq"),
        DatacenterSpec("dca"),
        DatacenterSpec("dcb"),
        DatacenterSpec("dcc", nat="symmetric"),
        DatacenterSpec("dcd", nat="symmetric"),
    ]


# Prints "ready", then "SOURCE PAYLOAD" for each UDP datagram its address:port (argv 1, 2) gets for argv 3 seconds.
UDP_LISTEN = _dedent("""\
    import socket, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.settimeout(0.5)
    print("ready", flush=True)
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        try:
            data, addr = s.recvfrom(2048)
        except TimeoutError:
            continue
        print(addr[0], data.decode(errors="replace"), flush=True)
""")


# A member probing ports from inside its namespace, all at once (a dropped one costs its 2 s timeout):
# {"host:port": "connected" or the error's name}. A second argument: the IP TOS byte its packets carry (any
# user may set it).
PROBE_ALL = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
tos = int(sys.argv[2]) if len(sys.argv) > 2 else 0
def one(target):
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    try:
        if tos:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
        s.settimeout(2)
        s.connect((host, int(port)))
        return "connected"
    except OSError as exc:
        return type(exc).__name__
    finally:
        s.close()
targets = json.loads(sys.argv[1])
with ThreadPoolExecutor(max(1, min(32, len(targets)))) as pool:
    print(json.dumps(dict(zip(targets, pool.map(one, targets)))))
"""


def listening(mesh, node: str, ip: str, skip: set[int]) -> list[str]:
    """host:port of every TCP socket listening in `node` on `ip` or the wildcard, but `skip`'s ports."""
    out = []
    for line in mesh.world.node(node).run("ss", "-tlnH").stdout.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        host = host.strip("[]").split("%")[0]  # "10.213.0.2%meshrun0": bound to the device too
        if host in (ip, "*", "0.0.0.0", "::") and int(port) not in skip:
            out.append(f"{ip}:{port}")
    return sorted(set(out))


def wait_for(check, what: str, timeout: float = 60, ping: tuple | None = None) -> None:
    """Poll `check()` every 0.5 s until it is true, or AssertionError naming `what` after `timeout` s. `ping`
    (mesh, node, peer): ping the peer's overlay address from the node first each time (a tunnel to wake)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ping:
            m, a, b = ping
            m.ping(a, m.overlay_ip(b))
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting until {what}")


class Drain:
    """Everything `procs` write to their pipes, read by a thread per pipe from now on, so that none of them
    blocks on a full pipe (64 KiB) while another is waited for or read: ranks of one job wait for each other, and
    a rank blocked on a write would never end. Its text can be looked at while they run."""

    def __init__(self, procs: Sequence[subprocess.Popen]) -> None:
        self.procs = list(procs)
        self.got: dict[tuple[int, str], list] = {}
        self.readers: dict[tuple[int, str], threading.Thread] = {}
        for i, p in enumerate(self.procs):
            for name in ("stdout", "stderr"):
                pipe = getattr(p, name)
                if pipe is not None:
                    chunks = self.got[(i, name)] = []
                    self.readers[(i, name)] = threading.Thread(target=chunks.extend, args=(pipe,), daemon=True)
        for t in self.readers.values():
            t.start()

    def text(self, i: int, name: str = "stdout"):
        """What process `i` wrote to `name` so far (None: not a pipe)."""
        chunks = self.got.get((i, name))
        if chunks is None:
            return None
        chunks = list(chunks)
        return "".join(chunks) if not chunks or isinstance(chunks[0], str) else b"".join(chunks)

    def wait_until(self, ended_early, timeout: float) -> None:
        """Return once every process has ended, or once one that has ended satisfies `ended_early(i)` (`i`: its
        index). subprocess.TimeoutExpired if neither happens within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            ended = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if len(ended) == len(self.procs):
                return
            for i in ended:
                self.readers_done(i)
                if ended_early(i):
                    return
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.procs[0].args, timeout)
            time.sleep(0.2)

    def readers_done(self, i: int) -> None:
        """Wait (up to 10 s) until everything process `i` wrote, which has ended, has been read."""
        for (j, _name), t in self.readers.items():
            if j == i:
                t.join(timeout=10)

    def finish(self, timeout: float) -> list:
        """Wait for every process, then return what each wrote: its stdout, or (stdout, stderr) when both are
        pipes, as `communicate()` would. subprocess.TimeoutExpired if one still runs after `timeout` s (with
        what every process wrote so far in `.output`)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.001))
            except subprocess.TimeoutExpired as exc:
                exc.output = "".join(str(self.text(i)) for i in range(len(self.procs)))
                raise
        for t in self.readers.values():
            t.join(timeout=30)
        return [
            (self.text(i), self.text(i, "stderr")) if p.stderr is not None else self.text(i)
            for i, p in enumerate(self.procs)
        ]


def communicate_all(procs: Sequence[subprocess.Popen], timeout: float) -> list:
    """`communicate()` of every process in `procs` at once (`Drain`): what each wrote."""
    return Drain(procs).finish(timeout)


def hang_guard(design_s: float) -> float:
    """The most seconds an end-to-end test lets a thing designed to take `design_s` take: three times that.

    An end-to-end bound catches a hang or a regression by a factor, not a target missed by a loaded 2-core
    CI machine: the targets are measured side by side in benchmarks/ (issue 57). Every wall-clock bound in
    tests/e2e/ goes through this, so a grep shows each design value next to its bound.
    """
    return 3 * design_s


def coordinator_pairs(mesh) -> dict[frozenset, dict]:
    """{frozenset((a, b)): row} as `meshrun status --json` on the (single) coordinator lists its "pairs", read
    in this process from the coordinator's database: a wait polling it every second starts no Python and
    measures no peer each time (a `status` costs about 0.3 s of CPU). Several coordinators keep it in etcd,
    which only their namespaces reach: ask `mesh.status` there."""
    from meshrun.mesh import status
    from meshrun.system.files.statedir import StateDir

    rows = status.pair_rows(StateDir(mesh.state_dir(mesh.coordinator)))
    return {frozenset((p["a"], p["b"])): p for p in rows}


def wg_handshake(to_key: str, kind: int = 1) -> bytes:
    """A WireGuard handshake message as the protocol lays it out (kind 1: an initiation, 148 bytes; 2: a response,
    92), its mac1 made for the public key `to_key` (base64): what a relay latches an end on (meshrun.core.relayfwd)."""
    import base64

    from meshrun.core.relayfwd import mac1

    body = bytes([kind, 0, 0, 0]) + os.urandom(112 if kind == 1 else 56)
    return body + mac1(body, base64.b64decode(to_key)) + bytes(16)
