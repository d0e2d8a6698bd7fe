"""Coordinator load: the real coordinator service, loop included, with N agents long-polling on loopback.

    python benchmarks/coordinator_load.py                          # 100, 300 and 1000 members
    python benchmarks/coordinator_load.py --sizes 200 --window 20  # quick

The coordinator is meshrun's `CoordinatorService` in a separate process (so its CPU is measured
alone, /proc/PID/stat): its overlay API (the real sync handler, long-poll, member-list deltas and
CoordinatorDB) served by meshrun's JSONServer on 127.0.0.1, and its real once-a-second loop
(`_loop` -> `tick`: observe the device, advance the pair driver, publish, apply peers) on a
FakeDevice, the device seam's in-memory implementation (WireGuard itself is not what is measured
here). The fake device's handshakes move as WireGuard's do: each peer's every ~120 s (rekey).

Agents are asyncio tasks in the driver process. Each binds its own 127.1.x.y, which the server maps to
that member's overlay IP (the overlay API identifies callers by source address). Each sends what
agent.py sends: candidates, its MTU, `version`, `delta`, and its handshake report with every other
member, with real public keys: complete on the first sync, then the peers whose handshake changed
since its last sync (each pair's WireGuard session rekeys every 120 s, so a sync after `wait` s
reports about n * wait / 120 of them, each with a new handshake time): the pair driver advances
exactly those pairs.

Per size: (1) steady state: coordinator CPU share over --window seconds, CPU per loop tick (mean,
p99, measured inside the loop thread), p99 latency of a non-waiting sync (wait=0) sent by --probes
agents once a second; (2) join storm: 100 members join in 10 s (enrolled in the database, then the
enrolment handler's own callback, which asks the loop for a tick), each starts its agent; seconds
until all original agents hold a version that includes the joined member (p50/p99/max over the
joins); (3) one removal: seconds until every agent holds the version without it.
Targets: steady state < 10% of one core, p99 sync < 100 ms, a new member visible to all agents < 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CANDIDATES = ["172.31.40.46:51820", "10.0.0.5:51820"]
VERSION_RE = re.compile(rb'"version":\s*(\d+)')
REKEY_S = 120.0
STORM_JOINS, STORM_S = 100, 10.0


def loop_ip(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


# --------------------------------------------------------------------------- server process


def server(args) -> int:
    from dataclasses import replace

    from meshrun.core import keys
    from meshrun.core.model import Network
    from meshrun.core.token import new_token
    from meshrun.mesh.coordinator.daemon import OVERLAY_MAX_CONNS, OVERLAY_PER_SOURCE, CoordinatorService
    from meshrun.system.coordinatordb import CoordinatorDB
    from meshrun.system.fakedevice import FakeDevice
    from meshrun.system.statedir import StateDir, remove_tree
    from meshrun.system.transport import JSONServer

    tmp = Path(tempfile.mkdtemp(prefix="meshrun-load-"))
    state = StateDir(tmp / "state")
    state.create()
    private = keys.generate_private_key()
    state.write("private.key", (private + "\n").encode(), secret=True)  # the wg-quick file embeds it
    net = Network(
        name="load",
        cidr="10.213.0.0/16",
        interface="meshrun0",
        listen_port=51820,
        mtu=1420,
        coordinator_ip="10.213.0.1",
        coordinator_public_key=keys.public_key(private),
        endpoints=("203.0.113.1:51820",),
        fingerprint="0" * 64,
        api_port=51821,
    )
    db = CoordinatorDB.create(state / "coordinator.db")
    db.set_meta(network=json.dumps(net.to_dict()))
    db.add_coordinator("coordinator", net.coordinator_public_key, net.coordinator_ip)
    tok = new_token(net.name, net.endpoints, net.fingerprint, net.coordinator_public_key)
    db.add_token(tok.token_id, tok.secret, 3600, None)
    mapping: dict[str, str] = {}
    members = []
    for i in range(args.agents + STORM_JOINS):
        members.append((f"n{i}", keys.public_key(keys.generate_private_key()), loop_ip(i)))
    for name, key, ip in members[: args.agents]:
        m, _ = db.enrol(tok.token_id, tok.secret, name, key, CANDIDATES, net.cidr)
        # Its first sync, as in a running network: a token holds at most 256 enrolments not yet completed.
        db.heartbeat(m.overlay_ip, list(CANDIDATES), touch=True)
        mapping[ip] = m.overlay_ip
    # Every member has an observed endpoint (each its own public address), as in a running network.
    db.observe(
        {
            m.public_key: (f"198.18.{j // 250}.{j % 250 + 1}:51820", int(time.time()))
            for j, m in enumerate(db.members())
            if not m.is_coordinator
        }
    )
    db.close()
    state.write_json(
        "member.json",
        {
            "role": "coordinator",
            "name": "coordinator",
            "network": net.to_dict(),
            "overlay_ip": net.coordinator_ip,
            "public_key": net.coordinator_public_key,
        },
    )
    device = FakeDevice(net.interface, present=True)
    svc = CoordinatorService(state, device=device)

    # CPU per tick, measured inside the loop thread.
    tick_cpu: list[tuple[float, float]] = []
    real_tick = svc.tick

    def timed_tick(now=None):
        t0 = time.thread_time()
        real_tick(now)
        tick_cpu.append((time.monotonic(), time.thread_time() - t0))

    svc.tick = timed_tick

    def rekeys() -> None:
        """WireGuard's view on the coordinator: each node's session rekeys about every 120 s."""
        while not svc.stop_event.is_set():
            time.sleep(1.0)
            peers = list(device._peers.values())
            now = int(time.time())
            for p in random.sample(peers, min(len(peers), max(1, round(len(peers) / REKEY_S)))):
                device._peers[p.public_key] = replace(p, latest_handshake=now)

    def handle(req):
        req.client_ip = mapping.get(req.client_ip, req.client_ip)
        return svc.overlay.handle(req)

    def gate(req):
        req.client_ip = mapping.get(req.client_ip, req.client_ip)
        return svc.overlay.gate(req)

    # The daemon's own bounds: a benchmark with laxer ones would measure a coordinator nobody runs.
    srv = JSONServer(
        ("127.0.0.1", 0), handle, gate=gate, max_conns=OVERLAY_MAX_CONNS, max_per_source=OVERLAY_PER_SOURCE
    )
    srv.start("overlay")
    svc.apply_peers()
    threading.Thread(target=svc._loop, name="loop", daemon=True).start()
    threading.Thread(target=rekeys, name="rekeys", daemon=True).start()
    print(
        json.dumps({"port": srv.server_address[1], "version": svc.roster.version, "keys": [k for _, k, _ in members]}),
        flush=True,
    )

    def say(**kw) -> None:
        print(json.dumps(kw), flush=True)

    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "ticks":  # CPU per tick since a monotonic time
            since = float(cmd[1])
            say(ticks=[c for t, c in tick_cpu if t >= since])
        elif cmd[0] == "storm":  # STORM_JOINS joins spread over STORM_S
            gap = STORM_S / STORM_JOINS
            for j, (name, key, ip) in enumerate(members[args.agents :]):
                t0 = time.monotonic()
                m, _ = svc.db.enrol(tok.token_id, tok.secret, name, key, CANDIDATES, net.cidr)
                mapping[ip] = m.overlay_ip
                svc._enrolled(m)  # what the enrolment API calls after recording a join
                say(joined=j, at=t0, version=svc.db.version())
                time.sleep(max(0.0, gap - (time.monotonic() - t0)))
            say(storm="done")
        elif cmd[0] == "remove":
            t0 = time.monotonic()
            svc.db.remove_member(cmd[1])
            svc.wake.set()  # what `meshrun remove` does through the admin API
            say(removed=cmd[1], at=t0, version=svc.db.version())
    svc.stop_event.set()
    srv.shutdown()
    remove_tree(tmp)
    return 0


# --------------------------------------------------------------------------- agents


async def post_sync(port: int, src: str, body: bytes) -> tuple[int, int, float]:
    """One POST /v1/sync from `src`; returns (status, version, seconds)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0), limit=1 << 24)
    writer.write(
        b"POST /v1/sync HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
    )
    await writer.drain()
    data = await reader.read()  # HTTP/1.0 answer: read to EOF
    writer.close()
    status = int(data[9:12]) if data[:5] == b"HTTP/" else 0
    m = VERSION_RE.search(data, data.find(b"\r\n\r\n"))
    return status, int(m.group(1)) if m else -1, time.monotonic() - t0


class Agents:
    """Simulated agents; agent i has key keys[i] and source address loop_ip(i)."""

    def __init__(self, port: int, keys: list[str], wait: float) -> None:
        self.port, self.keys, self.wait = port, keys, wait
        self.live = 0  # agents 0..live-1 are members (others: not joined yet)
        self.version: dict[int, int] = {}
        self.last_sync: dict[int, float] = {}
        self.got: dict[int, list[tuple[int, float]]] = {}  # agent -> [(version, when received)]
        self.errors = 0
        self.gone: set[int] = set()
        self.stop = False

    def body(self, i: int, version: int, wait: float, full: bool) -> bytes:
        others = [k for j, k in enumerate(self.keys[: self.live]) if j != i]
        now = int(time.time())
        if full:
            report = {k: now for k in others}
        else:
            since = time.monotonic() - self.last_sync.get(i, time.monotonic())
            count = min(len(others), max(0, round(len(others) * since / REKEY_S)))
            report = {k: now for k in random.sample(others, count)}
        self.last_sync[i] = time.monotonic()
        return json.dumps(
            {
                "candidates": CANDIDATES,
                "peers": report,
                "full": full,
                "mtu": 1420,
                "version": version,
                "wait": wait,
                "delta": True,
            }
        ).encode()

    async def agent(self, i: int, start_delay: float) -> None:
        await asyncio.sleep(start_delay)
        src = loop_ip(i)
        full = True
        while not self.stop:
            v = self.version.get(i, 0)
            try:
                status, nv, _ = await post_sync(self.port, src, self.body(i, v, 0 if full else self.wait, full))
            except OSError:
                self.errors += 1
                await asyncio.sleep(0.5)
                continue
            if status == 410:
                self.gone.add(i)
                return
            if status != 200:
                self.errors += 1
                await asyncio.sleep(0.5)
                continue
            full = False
            if nv != v:
                self.got.setdefault(i, []).append((nv, time.monotonic()))
            self.version[i] = nv

    def reached(self, version: int, agents: range) -> list[float]:
        """When each agent in `agents` first held a version >= `version` (missing: not yet)."""
        out = []
        for i in agents:
            t = next((when for v, when in self.got.get(i, []) if v >= version), None)
            if t is not None:
                out.append(t)
        return out


async def probe(port: int, agents: Agents, srcs: list[int], seconds: float, out: list[float]) -> None:
    """Non-waiting syncs (wait=0) from `srcs`, once a second each, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:

        async def one(i):
            try:
                body = json.dumps(
                    {
                        "candidates": CANDIDATES,
                        "peers": {},
                        "version": agents.version.get(i, 0),
                        "wait": 0,
                        "delta": True,
                        "mtu": 1420,
                    }
                ).encode()
                status, _, secs = await post_sync(port, loop_ip(i), body)
                if status == 200:
                    out.append(secs)
            except OSError:
                agents.errors += 1

        await asyncio.gather(*(one(i) for i in srcs))
        await asyncio.sleep(1.0)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, agents: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--server", "--agents", str(agents)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello = json.loads(self.proc.stdout.readline())

    async def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(await asyncio.get_running_loop().run_in_executor(None, self.proc.stdout.readline))

    async def read(self) -> dict:
        return json.loads(await asyncio.get_running_loop().run_in_executor(None, self.proc.stdout.readline))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def one_size(n: int, args) -> dict:
    from meshrun.mesh.node.daemon import SYNC_WAIT

    srv = Server(n)
    port, pid = srv.hello["port"], srv.proc.pid
    agents = Agents(port, srv.hello["keys"], SYNC_WAIT)
    agents.live = n
    t_setup = time.monotonic()
    tasks = [asyncio.create_task(agents.agent(i, random.uniform(0, 5))) for i in range(n)]
    # Every agent has made its first (complete) report and the pairs are judged; then a long-poll
    # period so the reports are the steady trickle.
    await asyncio.sleep(SYNC_WAIT + 10)
    probes: list[float] = []
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await probe(port, agents, random.sample(range(n), min(args.probes, n)), args.window, probes)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    ticks = (await srv.ask(f"ticks {t0}"))["ticks"]

    # Join storm: STORM_JOINS members in STORM_S; each starts its agent once enrolled.
    c2 = cpu_seconds(pid)
    srv.proc.stdin.write("storm\n")
    srv.proc.stdin.flush()
    joins = []
    while True:
        msg = await srv.read()
        if "storm" in msg:
            break
        joins.append(msg)
        agents.live = n + msg["joined"] + 1
        tasks.append(asyncio.create_task(agents.agent(n + msg["joined"], 0)))
    await asyncio.sleep(5)
    visible = []
    for j in joins:
        seen = agents.reached(j["version"], range(n))
        visible.append(max(seen) - j["at"] if len(seen) == n else float("inf"))
    storm_cpu = cpu_seconds(pid) - c2

    # One removal: every remaining agent learns of it.
    victim = n // 2
    rem = await srv.ask(f"remove n{victim}")
    await asyncio.sleep(5)
    others = [i for i in range(n) if i != victim]
    seen = [t for i in others for t in agents.reached(rem["version"], range(i, i + 1))]
    removal_s = max(seen) - rem["at"] if len(seen) == len(others) else float("inf")

    agents.stop = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    srv.close()

    def finite(x):  # JSON has no infinity: null means "not every agent got it in time"
        return None if x is None or x == float("inf") else x

    return {
        "members": n,
        "window_s": round(t1 - t0, 2),
        "cpu_share": (c1 - c0) / (t1 - t0),
        "ticks": len(ticks),
        "tick_cpu_ms_mean": 1e3 * statistics.fmean(ticks) if ticks else None,
        "tick_cpu_ms_p99": 1e3 * pct(ticks, 0.99) if ticks else None,
        "probe_syncs": len(probes),
        "sync_p50_ms": 1e3 * (pct(probes, 0.5) or 0),
        "sync_p99_ms": 1e3 * (pct(probes, 0.99) or 0),
        "storm_joins": len(joins),
        "join_visible_p50_s": pct(visible, 0.5),
        "join_visible_p99_s": finite(pct(visible, 0.99)),
        "join_visible_max_s": finite(max(visible)) if visible else None,
        "storm_cpu_s": storm_cpu,
        "removal_visible_s": finite(removal_s),
        "removed_agent_told": victim in agents.gone,
        "errors": agents.errors,
        "setup_s": round(t0 - t_setup, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--agents", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="100,300,1000", help="member counts, comma-separated")
    ap.add_argument("--window", type=float, default=30, help="steady-state measuring window, seconds")
    ap.add_argument("--probes", type=int, default=20, help="agents also sending a wait=0 sync every second")
    ap.add_argument("--rounds", type=int, default=3, help="every size this many times, sizes in alternating order")
    ap.add_argument("--name", default="coordinator_load")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")] if not args.server else [args.agents]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8 * (max(sizes) + STORM_JOINS) + 1024)), hard))
    if args.server:
        return server(args)
    if not all(2 <= s <= 62000 for s in sizes):
        sys.exit("--sizes: each member count must be 2 to 62000")
    from common import alternating, spread, verdict, write_result

    t_start = time.monotonic()
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for n in alternating(sizes, args.rounds):
        runs[n].append(asyncio.run(one_size(n, args)))
        print(json.dumps(runs[n][-1]), flush=True)

    def over(n: int, key: str) -> dict:
        """A size's spread of `key` over its rounds (an unreached join or removal counts as infinite)."""
        return spread([float("inf") if r[key] is None else r[key] for r in runs[n]])

    keys = ("cpu_share", "sync_p99_ms", "tick_cpu_ms_mean", "join_visible_p50_s", "join_visible_max_s")
    rows = [
        {
            "members": n,
            "rounds": len(runs[n]),
            **{k: over(n, k) for k in (*keys, "removal_visible_s")},
            "errors": sum(r["errors"] for r in runs[n]),
            "runs": runs[n],
        }
        for n in sizes
    ]
    big = rows[-1]

    def secs(x: float) -> str:
        return "not reached by every agent within 5 s" if x == float("inf") else f"{x:.2f} s"

    med = {k: big[k]["median"] for k in (*keys, "removal_visible_s")}
    ok_cpu = med["cpu_share"] < 0.10
    ok_lat = med["sync_p99_ms"] < 100
    ok_join = med["join_visible_max_s"] < 2.0

    def per_tick(r):  # no tick in the window: the loop was starved
        t = r["tick_cpu_ms_mean"]["median"]
        return "no tick completed" if t == float("inf") else f"{t:.2f} ms/tick"

    growth = ", ".join(f"{r['members']}: {per_tick(r)}, {r['cpu_share']['median']:.1%}" for r in rows)
    summary = (
        f"coordinator_load (real loop, medians of {args.rounds} rounds): {big['members']} members: coordinator CPU "
        f"{med['cpu_share']:.1%} of one core ({verdict(ok_cpu)} < 10%; rounds {big['cpu_share']['min']:.1%}-"
        f"{big['cpu_share']['max']:.1%}), p99 sync {med['sync_p99_ms']:.0f} ms ({verdict(ok_lat)} < 100 ms); "
        f"join storm {STORM_JOINS} in {STORM_S:g} s: each visible to all in p50 "
        f"{med['join_visible_p50_s']:.2f} s / max {secs(med['join_visible_max_s'])} ({verdict(ok_join)} < 2 s); "
        f"removal {secs(med['removal_visible_s'])}; per tick: {growth}; errors "
        f"{sum(r['errors'] for r in rows)} [{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        args.name,
        {
            "sizes": rows,
            "targets": {"cpu_share": 0.10, "sync_p99_ms": 100, "join_visible_s": 2.0},
            "met": {"cpu_share": ok_cpu, "sync_p99_ms": ok_lat, "join_visible_s": ok_join},
        },
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
