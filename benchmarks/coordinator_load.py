"""Coordinator load: 1000 agents long-polling the overlay API (on loopback, no namespaces).

    python benchmarks/coordinator_load.py                    # 1000 agents, 40 s steady window
    python benchmarks/coordinator_load.py --agents 200 --window 20    # quick

The coordinator side is meshrun's own `CoordinatorService.handle_overlay` (the real sync
handler, long-poll and CoordinatorDB with --agents enrolled members) served by meshrun's
JSONServer on 127.0.0.1 in a separate process, so its CPU is measured alone
(/proc/PID/stat utime+stime). The overlay API identifies callers by source address: each
simulated agent binds its own 127.1.x.y, which the handler maps to that member's overlay IP.
Agents are asyncio tasks in this process sending what agent.py sends: heartbeat with
candidates and a report on every peer, `version`, `wait` = agent.SYNC_WAIT; after an answer
they sync again at once (the agent loop).

Measured: (1) idle long-poll load: coordinator CPU share over --window seconds in steady
state; (2) p99 latency of a non-waiting sync (wait=0) issued by --probes agents once a
second during that window; (3) change notification: one member joins; seconds until all
long-polls returned with the new version (p50/p99/max).
Targets: coordinator < 20% of one core, p99 sync latency < 100 ms.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CANDIDATES = ["172.31.40.46:51820", "10.0.0.5:51820"]
VERSION_RE = re.compile(rb'"version":\s*(\d+)')


def loop_ip(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


# --------------------------------------------------------------------------- server process

def server(args) -> int:
    from meshrun.mesh import coordinator
    from meshrun.core import keys
    from meshrun.core.model import Network
    from meshrun.system.store import CoordinatorDB, StateDir
    from meshrun.core.token import new_token
    from meshrun.system.transport import JSONServer, Request

    tmp = Path(tempfile.mkdtemp(prefix="meshrun-load-"))
    state = StateDir(tmp / "state")
    state.create()
    net = Network(name="load", cidr="10.213.0.0/16", interface="meshrun0", listen_port=51820, mtu=1420,
                  coordinator_ip="10.213.0.1", coordinator_public_key=keys.public_key(keys.generate_private_key()),
                  endpoints=("203.0.113.1:51820",), fingerprint="0" * 64, api_port=51821)
    db = CoordinatorDB.create(state / "coordinator.db")
    db.set_meta(network=json.dumps(net.to_dict()))
    db.add_coordinator("coordinator", net.coordinator_public_key, net.coordinator_ip)
    tok = new_token(net.name, net.endpoints, net.fingerprint)
    db.add_token(tok.token_id, tok.secret, 3600, None)
    mapping = {}
    for i in range(args.agents):
        m, _ = db.enrol(tok.token_id, tok.secret, f"n{i}", keys.public_key(keys.generate_private_key()),
                        CANDIDATES, net.cidr)     # what its agent reports: no version bump per sync
        mapping[loop_ip(i)] = m.overlay_ip
    # Every member has synced once and has an observed endpoint, as in a running network.
    db.observe({m.public_key: (f"198.18.{j // 250}.{j % 250 + 1}:51820", int(time.time()))
                for j, m in enumerate(db.members()) if not m.is_coordinator})
    db.close()
    state.write_json("member.json", {"role": "coordinator", "name": "coordinator", "network": net.to_dict(),
                                     "overlay_ip": net.coordinator_ip})
    svc = coordinator.CoordinatorService(state)

    def handle(req: Request):
        req.client_ip = mapping.get(req.client_ip, req.client_ip)
        return svc.handle_overlay(req)

    srv = JSONServer(("127.0.0.1", 0), handle)
    srv.start("overlay")
    print(json.dumps({"port": srv.server_address[1], "version": svc.version}), flush=True)
    extra = 0
    for line in sys.stdin:                      # "join": enrol one more member and notify
        if line.strip() == "join":
            extra += 1
            db2 = CoordinatorDB(state / "coordinator.db")
            db2.enrol(tok.token_id, tok.secret, f"late{extra}", keys.public_key(keys.generate_private_key()), [],
                      net.cidr)
            with svc.cond:                          # what CoordinatorService.tick does on a change
                svc.version = svc.db.version()
                svc.cond.notify_all()
            print(json.dumps({"notified": time.monotonic(), "version": svc.version}), flush=True)
    srv.shutdown()
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


# --------------------------------------------------------------------------- agents

def sync_body(n_peers: int, version: int, wait: float, full: bool = False) -> bytes:
    """What agent.py sends: candidates, and {peer key: latest handshake} for the peers whose
    handshake changed since its last acknowledged report. WireGuard rekeys an active tunnel every
    120 s, so a steady-state long-poll of `wait` s reports about n_peers * wait / 120 of them
    (all of them on the first sync, which the coordinator asks for with "report": "full")."""
    count = n_peers if full else max(1, round(n_peers * max(wait, 1.0) / 120))
    report = {f"{'k' * 40}{j:03d}==": int(time.time()) for j in range(count)}
    return json.dumps({"candidates": CANDIDATES, "peers": report, "full": full,
                       "version": version, "wait": wait}).encode()


async def post_sync(port: int, src: str, body: bytes) -> tuple[int, int, float]:
    """One POST /v1/sync from `src`; returns (status, version, seconds)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0), limit=1 << 22)
    writer.write(b"POST /v1/sync HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    data = await reader.read()                    # HTTP/1.0 answer: read to EOF
    writer.close()
    status = int(data[9:12]) if data[:5] == b"HTTP/" else 0
    m = VERSION_RE.search(data, data.find(b"\r\n\r\n"))
    return status, int(m.group(1)) if m else -1, time.monotonic() - t0


class Agents:
    def __init__(self, port: int, n: int, wait: float, bodies: dict) -> None:
        self.port, self.n, self.wait, self.bodies = port, n, wait, bodies
        self.version = [0] * n
        self.got_version_at: dict[int, dict[int, float]] = {}
        self.overshoot: list[tuple[float, float]] = []   # (time, seconds past the wait) of idle answers
        self.errors = 0
        self.stop = False

    def body(self, version: int, wait: float, full: bool = False) -> bytes:
        key = (version, wait, full)
        if key not in self.bodies:
            self.bodies[key] = sync_body(self.n - 1, version, wait, full)
        return self.bodies[key]

    async def agent(self, i: int, start_delay: float) -> None:
        await asyncio.sleep(start_delay)
        src = loop_ip(i)
        while not self.stop:
            v = self.version[i]
            try:
                # The first sync of an agent carries its complete report, as agent.py's does.
                status, nv, secs = await post_sync(self.port, src, self.body(v, self.wait, full=(v == 0)))
            except OSError:
                self.errors += 1
                await asyncio.sleep(0.5)
                continue
            if status != 200:
                self.errors += 1
                await asyncio.sleep(0.5)
                continue
            now = time.monotonic()
            if nv != v:
                self.got_version_at.setdefault(nv, {})[i] = now
            else:
                self.overshoot.append((now, secs - self.wait))
            self.version[i] = nv


async def probe(port: int, srcs: list[str], agents: Agents, seconds: float, out: list[float]) -> None:
    """Non-waiting syncs (wait=0) from `srcs`, once a second each, for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        async def one(i, src):
            try:
                status, _, secs = await post_sync(port, src, agents.body(agents.version[i], 0.0))
                if status == 200:
                    out.append(secs)
            except OSError:
                agents.errors += 1
        await asyncio.gather(*(one(i, s) for i, s in srcs))
        await asyncio.sleep(1.0)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(args, port: int, proc: subprocess.Popen, version0: int) -> dict:
    from meshrun.mesh.agent import SYNC_WAIT
    agents = Agents(port, args.agents, SYNC_WAIT, {})
    for i in range(args.agents):
        agents.version[i] = 0
    agents.body(0, SYNC_WAIT)
    # Start spread over one long-poll period (real agents joined at different times).
    tasks = [asyncio.create_task(agents.agent(i, random.uniform(0, SYNC_WAIT))) for i in range(args.agents)]
    await asyncio.sleep(SYNC_WAIT + 5)          # every agent has done its first (immediate) sync
    agents.overshoot.clear()
    probes: list[float] = []
    srcs = [(i, loop_ip(i)) for i in random.sample(range(args.agents), args.probes)]
    c0, t0 = cpu_seconds(proc.pid), time.monotonic()
    await probe(port, srcs, agents, args.window, probes)
    c1, t1 = cpu_seconds(proc.pid), time.monotonic()
    idle_cpu = (c1 - c0) / (t1 - t0)
    overshoot = [s for t, s in agents.overshoot if t0 <= t <= t1]
    idle_answers = len(overshoot)

    # Change notification: one member joins; every long-poll should return with the new version.
    waiting_before = sum(1 for v in agents.version if v >= version0)
    proc.stdin.write("join\n")
    proc.stdin.flush()
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, proc.stdout.readline)
    note = json.loads(line)
    deadline = time.monotonic() + 30
    c2 = cpu_seconds(proc.pid)
    while time.monotonic() < deadline and len(agents.got_version_at.get(note["version"], {})) < args.agents:
        await asyncio.sleep(0.05)
    got = agents.got_version_at.get(note["version"], {})
    lat = sorted(t - note["notified"] for t in got.values())
    c3 = cpu_seconds(proc.pid)
    agents.stop = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None
    probes.sort()
    return {"agents": args.agents, "sync_wait_s": SYNC_WAIT, "window_s": round(t1 - t0, 2),
            "idle_cpu_share": idle_cpu, "idle_syncs_per_s": idle_answers / (t1 - t0),
            "idle_overshoot_p99_s": pct(sorted(overshoot), 0.99),
            "probe_syncs": len(probes), "sync_latency_p50_s": pct(probes, 0.5), "sync_latency_p99_s": pct(probes, 0.99),
            "sync_latency_max_s": probes[-1] if probes else None,
            "notify_received": len(got), "notify_waiting_before": waiting_before,
            "notify_p50_s": pct(lat, 0.5), "notify_p99_s": pct(lat, 0.99), "notify_max_s": lat[-1] if lat else None,
            "notify_cpu_s": c3 - c2, "errors": agents.errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--window", type=float, default=40, help="steady-state measuring window, seconds")
    ap.add_argument("--probes", type=int, default=20, help="agents also sending a wait=0 sync every second")
    ap.add_argument("--name", default="coordinator_load")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8 * args.agents + 1024)), hard))
    if args.server:
        return server(args)
    if not 1 <= args.agents <= 62500:
        sys.exit("--agents must be 1 to 62500")
    from common import verdict, write_result
    t_start = time.monotonic()
    proc = subprocess.Popen([sys.executable, __file__, "--server", "--agents", str(args.agents)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(proc.stdout.readline())
        res = asyncio.run(drive(args, hello["port"], proc, hello["version"]))
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    ok_cpu = res["idle_cpu_share"] < 0.20
    ok_lat = res["sync_latency_p99_s"] is not None and res["sync_latency_p99_s"] < 0.100
    summary = (f"coordinator_load: {args.agents} agents long-polling: coordinator CPU {res['idle_cpu_share']:.1%} "
               f"of one core ({verdict(ok_cpu)} < 20%), p99 sync latency {res['sync_latency_p99_s'] * 1e3:.0f} ms "
               f"({verdict(ok_lat)} < 100 ms); change reached {res['notify_received']}/{args.agents} long-polls in "
               f"p50 {res['notify_p50_s'] or 0:.2f} s / p99 {res['notify_p99_s'] or 0:.2f} s; errors {res['errors']} "
               f"[{time.monotonic() - t_start:.0f} s]")
    write_result(args.name, {**res, "targets": {"idle_cpu_share": 0.20, "sync_latency_p99_s": 0.100},
                             "met": {"idle_cpu_share": ok_cpu, "sync_latency_p99_s": ok_lat}}, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
