"""Inside the test VM (tests/vm.py): a mesh on kernel WireGuard across WAN links with delay and loss.

Run by the guest as root; writes one JSON line per check to OUTDIR/checks.jsonl as it goes (so a
timeout still shows how far it came) and OUTDIR/done when every step ran. A failed step is recorded
with its error and ends the scenario (later steps build on it); the host test asserts on the lines.

World: the coordinator (1:1 NAT), two nodes behind 1:1 NAT, and later a node behind symmetric NAT
next to one already behind symmetric NAT (that pair cannot punch: it must be relayed). Every
datacenter's internet link has DELAY_MS each way and LOSS_PCT loss each way (netem).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from meshrun.core import pairpaths
from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec, World
from meshrun.mesh import process, status
from meshrun.system.files.statedir import StateDir

DELAY_MS, LOSS_PCT = 25, 1
PING_TIMEOUT = 120  # TCG runs Python ~15x slower than the host: generous, the check is that it works
# Every meshrun command's timeout, times this: four `status` at once took 57 s in the guest on an idle host,
# and a status or a join over 120 s beside a busy CI worker.
TIME_SCALE = 3
# The agent's first sync, (`join --wait`, 45 s by default) scaled alike: two joins at once beside a busy CI
# worker passed 45 s.
JOIN_WAIT = str(45 * TIME_SCALE)
TRANSFER_BYTES = 512 << 10  # a bulk transfer that must ride out loss; 2 MiB cost ~50 s of the guest at 40 KB/s
PORT = 5201
RECEIVE = f"""
import hashlib, socket, sys
srv = socket.create_server((sys.argv[1], {PORT}))
print("listening", flush=True)
conn, _ = srv.accept()
h, n = hashlib.sha256(), 0
while chunk := conn.recv(1 << 16):
    h.update(chunk)
    n += len(chunk)
print(n, h.hexdigest())
"""
SEND = f"""
import hashlib, random, socket, sys
data = random.Random(0).randbytes(int(sys.argv[2]))
conn = socket.create_connection((sys.argv[1], {PORT}), timeout=120)  # SYNs lost at ~4% a hop, a slow guest
conn.settimeout(None)      # a lossy relayed path may stall for a while: the caller's 600 s bound it
conn.sendall(data)
print(len(data), hashlib.sha256(data).hexdigest())
"""


class Scenario:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.t0 = time.monotonic()

    def record(self, check: str, ok: bool, **detail) -> None:
        line = {"check": check, "ok": ok, "t": round(time.monotonic() - self.t0, 1), **detail}
        with open(self.out / "checks.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
        if not ok:
            raise SystemExit(f"check {check} failed: {detail}")


def wait_pairs(mesh: Mesh, names: list[str], timeout: float) -> dict[str, float | str]:
    """Every ordered pair pings over the overlay (in parallel); {"a->b": seconds or error}."""
    ips = {n: mesh.overlay_ip(n) for n in names}
    took: dict[str, float | str] = {}

    def one(a: str, b: str) -> None:
        try:
            took[f"{a}->{b}"] = round(mesh.wait_ping(a, ips[b], timeout=timeout), 1)
        except Exception as exc:  # recorded: the check fails on it
            took[f"{a}->{b}"] = f"{exc}"

    threads = [threading.Thread(target=one, args=p) for p in itertools.permutations(names, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took


def parallel(fn, names: list[str]) -> dict:
    """{name: fn(name)} with one thread per name (the guest's Python is slow; its 2 vCPUs are not busy)."""
    out: dict = {}
    threads = [threading.Thread(target=lambda n=n: out.__setitem__(n, fn(n))) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = [n for n in names if n not in out]
    if missing:
        raise RuntimeError(f"{fn.__name__} failed on {missing} (its traceback is above)")
    return out


def daemon_pids(mesh: Mesh, names: list[str]) -> dict[str, int | None]:
    """Each node's daemon PID, the holder of its lock (what `status` reports, without a CLI start)."""
    return {n: process.pid(StateDir(mesh.state_dir(mesh.world.node(n)))) for n in names}


def wait_pairs_settled(mesh: Mesh, pred, timeout: float) -> list[dict]:
    """The coordinator's pairs (`status --json`'s "pairs") once `pred` holds of them (or at the deadline), read
    from its database in this process: a `meshrun status` every 2 s took seconds of the guest's CPU each, which
    the agents whose reports settle the pairs were waiting for."""
    state = StateDir(mesh.state_dir(mesh.coordinator))
    deadline = time.monotonic() + timeout
    while True:
        rows = status.pair_rows(state)
        if pred(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(1)


def ifaces(mesh: Mesh, node: str) -> list[str]:
    out = mesh.world.node(node).run("ip", "-j", "link", "show").stdout
    return [link["ifname"] for link in json.loads(out)]


def scenario(s: Scenario) -> None:
    wan = {"delay_ms": DELAY_MS, "loss_pct": LOSS_PCT}
    dcs = [
        DatacenterSpec("dc1", **wan),
        DatacenterSpec("dc2", **wan),
        DatacenterSpec("dc3", nat="symmetric", **wan),
        DatacenterSpec("dc4", nat="symmetric", **wan),
    ]
    with World(dcs, prefix="vm") as world:
        rtt = (
            world.node("dc1-a")
            .run("ping", "-c", "3", "-i", "0.2", "-q", str(world.node("dc2-a").public_ip), check=False)
            .stdout
        )
        s.record(
            "netem_on_the_wan",
            "rtt min/avg/max" in rtt and float(rtt.split("=")[-1].split("/")[1]) >= 90,
            ping=rtt.strip().splitlines()[-1],
        )
        mesh = Mesh(world, "dc1-a", time_scale=TIME_SCALE)
        mesh.init()

        def join(name: str):
            return mesh.join(name, "--wait", JOIN_WAIT)

        # At once, under TCG (about 15x slower): the direct attempt's 10 s count from when both agents have applied
        # the path (meshrun.core.pairpaths), so slow agents do not leave the pair relayed, as they did on 2026-11-27.
        parallel(join, ["dc2-a", "dc3-a"])
        first = ["dc1-a", "dc2-a", "dc3-a"]
        took = wait_pairs(mesh, first, PING_TIMEOUT)
        s.record("three_datacenters_all_pairs_ping", all(isinstance(v, float) for v in took.values()), took=took)
        pids = daemon_pids(mesh, first)

        join("dc4-a")  # later, symmetric NAT
        took = wait_pairs(mesh, first + ["dc4-a"], PING_TIMEOUT)
        s.record("a_later_node_is_reached_by_all", all(isinstance(v, float) for v in took.values()), took=took)
        after = daemon_pids(mesh, first)
        s.record("without_restarts", after == pids and all(pids.values()), before=pids, after=after)
        everyone = first + ["dc4-a"]
        statuses = parallel(mesh.status, everyone)
        backends = {n: st["backend"] for n, st in statuses.items()}
        s.record("kernel_backend", backends == dict.fromkeys(everyone, "kernel"), backends=backends)

        # The coordinator judges the pairs of nodes (it is itself reached directly by every node). A pair that can
        # go direct may have missed its first window (a handshake lost twice at ~4% a try, an agent slow to
        # report it under TCG): it is relayed then and tries again RETRY_MIN_S later, so that is waited for.
        def settled(rows: list[dict]) -> bool:
            paths = {frozenset((p["a"], p["b"])): (p["path"], p["verified"]) for p in rows}
            return len(paths) == 3 and all(
                v == (("relayed", True) if k == {"dc3-a", "dc4-a"} else ("direct (public)", True))
                for k, v in paths.items()
            )

        t = time.monotonic()
        rows = wait_pairs_settled(mesh, settled, pairpaths.RETRY_MIN_S + 180)
        paths = {f"{p['a']}|{p['b']}": p["path"] for p in rows}
        # The coordinator's path changes, so a pair that went direct only on its retry shows it here.
        log = (mesh.state_dir(world.node("dc1-a")) / "daemon.log").read_text(errors="replace").splitlines()
        moves = [line[-120:] for line in log if " path " in line and " -> " in line]
        s.record(
            "symmetric_pair_relayed_others_direct",
            settled(rows),
            paths=paths,
            waited=round(time.monotonic() - t, 1),
            pairs=rows,
            moves=moves[-12:],
        )

        # Bulk TCP over the relayed pair under the same delay and loss (4 WAN hops each way: 200 ms RTT and
        # ~4% loss, so TCP gets some 40 KB/s): what arrives is counted and hashed at the far end.
        dst = mesh.overlay_ip("dc4-a")
        server = world.node("dc4-a").popen(sys.executable, "-c", RECEIVE, dst, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "listening"
            t = time.monotonic()
            sent = world.node("dc3-a").run(sys.executable, "-c", SEND, dst, str(TRANSFER_BYTES), timeout=600).stdout
            got = server.communicate(timeout=60)[0]
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        s.record(
            "tcp_transfer_over_the_relayed_pair",
            got.split() == sent.split(),
            sent=sent.strip(),
            received=got.strip(),
            seconds=round(time.monotonic() - t, 1),
        )

        mesh.meshrun("dc4-a", "leave")
        s.record("leave_removes_the_interface", "meshrun0" not in ifaces(mesh, "dc4-a"), ifaces=ifaces(mesh, "dc4-a"))
        mesh.meshrun("dc1-a", "down")
        s.record("down_removes_the_interface", "meshrun0" not in ifaces(mesh, "dc1-a"), ifaces=ifaces(mesh, "dc1-a"))
    s.record("world_torn_down", True)


def main() -> int:
    out = Path(sys.argv[1])
    s = Scenario(out)
    try:
        scenario(s)
    except SystemExit as exc:
        print(exc, flush=True)
        return 1
    except BaseException:
        s_err = traceback.format_exc()
        with open(out / "checks.jsonl", "a") as f:
            f.write(json.dumps({"check": "scenario_error", "ok": False, "error": s_err[-3000:]}) + "\n")
        print(s_err, flush=True)
        return 1
    (out / "done").write_text("ok\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
