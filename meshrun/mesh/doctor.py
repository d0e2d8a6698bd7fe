"""`meshrun doctor`: gather the facts of this member (daemon, interface, paths, clock, disk, torch,
environment) by probing the live system; meshrun.core.doctor judges them.

Probes that cross the overlay: a TCP/HTTP round trip and the clock from the coordinator's overlay
API, ICMP echoes with DF set at the interface MTU (and below it, to find what gets through), and on a
node a UDP probe the coordinator sends to the node's observed endpoint from an ephemeral port,
counted on arrival by a temporary iptables rule (removed before doctor returns).
"""

from __future__ import annotations

import os
import sys
import time

from meshrun.core import doctor, mtu, preflight
from meshrun.core.model import split_endpoint
from meshrun.errors import MeshrunError
from meshrun.mesh import iface, member, process
from meshrun.mesh import status as mstatus
from meshrun.mesh.coordinator import ha
from meshrun.mesh.coordinator.overlay import PROBE_INTERVAL_S
from meshrun.system.files import joblogs
from meshrun.system.files.statedir import StateDir, disk_use
from meshrun.system.kernel import firewall, net
from meshrun.system.kernel.device import USERSPACE
from meshrun.system.machine import host, procs
from meshrun.system.sockets import probe, transport

UDP_WAIT_S = 1.0


def run(state: StateDir, shell_env: dict[str, str] | None = None) -> tuple[dict, list[doctor.Check]]:
    """The facts and the checks for this member (MeshrunError if this machine is not one)."""
    facts = gather(state, os.environ if shell_env is None else shell_env)
    return facts, doctor.judge(facts)


def _watched(env: dict[str, str] | None) -> dict[str, str]:
    """Only the variables doctor judges: the rest of an environment may hold secrets."""
    return {k: v for k, v in (env or {}).items() if k in doctor.PINNED + doctor.STEERING}


def gather(state: StateDir, shell_env) -> dict:
    rec, network = member.load(state)
    if rec.get("removed"):  # nothing else applies to it (core/doctor.judge), and its network state may not answer
        return {"role": rec["role"], "name": rec["name"], "network": network.name, "removed": True,
                "removed_by": rec.get("removed_by")}  # fmt: skip
    st = mstatus.gather(state, measure=False)
    pid = process.pid(state)
    device = iface.device_for(state, network, rec)
    link = net.link(network.interface)
    if link["exists"] and rec["role"] == "node":
        # Asked now, as `meshrun status` asks them: by handshake age alone a coordinator powered off counted
        # as heard from for up to HANDSHAKE_STALE_S (3 min) after.
        for p in st["peers"]:
            if p["coordinator"] and p["overlay_ip"]:
                p["answered"] = mstatus.rtt_ms(p["overlay_ip"], network.api_port, samples=1)[1]
    backend = device.backend() if link["exists"] else None
    # A node's coordinator is the one its agent syncs with (several coordinators: any of them).
    coordinator_ip = st.get("coordinator") or network.coordinator_ip
    coordinator = next((p for p in st["peers"] if p["overlay_ip"] == coordinator_ip), None)
    f = {
        "role": rec["role"],
        "name": rec["name"],
        "network": network.name,
        "overlay_ip": rec["overlay_ip"],
        "prefixlen": network.prefixlen,
        "interface_name": network.interface,
        "listen_port": network.listen_port,
        "daemon_pid": pid,
        "interface": link,
        "trains": bool(rec.get("train")),
        "coordinator_name": coordinator["name"] if coordinator else None,
        "backend": {"kind": backend, "kernel_module": host.kernel_wireguard()},
        "peers": [
            {k: p[k] for k in ("name", "overlay_ip", "endpoint", "path", "handshake_age_s", "coordinator", "answered")}
            for p in st["peers"]
        ],
        "sync": st.get("sync") or {},
        "lan": st.get("lan") or {},
        "tunnels": st.get("tunnels") or {},
        "job_guards": {"cgroup": firewall.hierarchy(), "problem": firewall.available()},
        "reverse_dns_s": probe.reverse_lookup_s(rec["overlay_ip"], doctor.REVERSE_DNS_LIMIT_S),
        "relaying": {"pairs": len(st.get("relaying") or []), "forwarding": st.get("relay_forwarding")},
        "now": time.time(),
        "shell_env": _watched(dict(shell_env)),
        "daemon_env": _watched(procs.environ(pid) if pid else None),
    }
    if backend == USERSPACE:
        v = device.userspace_version()
        f["backend"].update(version=".".join(map(str, v)) if v else None, warning=device.warning())
    if link["up"]:
        f["mtu_probe"] = _probe_mtu(st, link["mtu"], coordinator_ip if rec["role"] == "node" else None)
        if rec["role"] == "node":
            f["coordinator"], f["clock_offset_s"] = _ask_coordinator(network, coordinator_ip)
            f["udp_probe"] = (
                _probe_udp(network, coordinator_ip, _public_endpoint(coordinator))
                if f["coordinator"]["reachable"]
                else {"error": "the coordinator does not answer over the overlay"}
            )
    if rec["role"] == "coordinator" and ha.replicated(rec):
        f["control"] = {"coordinators": st.get("coordinators") or [], "etcd_pid": ha.etcd_pid(state)}
    python = _job_python(pid)
    jobs = joblogs.jobs_root(state).path
    f["jobs_dir"] = str(jobs)
    f["environment"] = dict(host.environment(python), free_bytes=host.free_bytes(jobs))
    projects = state / "projects"
    f["disk_use"] = {
        "jobs": disk_use(jobs)[0],
        "projects": {p.name: disk_use(p)[0] for p in sorted(projects.iterdir()) if p.is_dir()}
        if projects.is_dir()
        else {},
    }
    return f


def _probe_mtu(st: dict, size: int, target: str | None) -> dict:
    """Does a packet of the interface's full MTU, DF set, reach the coordinator (or, on the coordinator,
    the peer with the freshest handshake)? If not, the largest size that does."""
    if target is None:
        fresh = [p for p in st["peers"] if p["handshake_age_s"] is not None and p["overlay_ip"]]
        if not fresh:
            return {}
        target = min(fresh, key=lambda p: p["handshake_age_s"])["overlay_ip"]
    # The pair's own MTU where it has one (a jumbo interface keeps the internet's size as /32 routes).
    size = next((p["mtu"] for p in st["peers"] if p["overlay_ip"] == target and p.get("mtu")), size)
    full = probe.echo(target, size)
    out = {"target": target, "size": size, "full": full}
    if full is False:
        out["small"] = bool(probe.echo(target, 576))
        if out["small"]:
            out["largest"] = mtu.largest(lambda n: probe.echo(target, n), 576, size)
    return out


def _ask_coordinator(network, ip: str) -> tuple[dict, float | None]:
    """Reachability over the overlay, the round trip, and the clock offset (ours minus the coordinator's)."""
    out = {"ip": ip}
    t0 = time.time()
    try:
        answer = transport.call(ip, network.api_port, "GET", "/v1/time", timeout=5)
    except MeshrunError as exc:
        return dict(out, reachable=False, error=exc.message), None
    t1 = time.time()
    out.update(reachable=True, rtt_ms=(t1 - t0) * 1000)
    return out, -preflight.clock_offset(t0, t1, float(answer["time"]))


def _public_endpoint(peer: dict | None) -> str | None:
    """A coordinator peer's WireGuard endpoint where it is the coordinator's own address (not a relay's)."""
    if not peer or not peer.get("endpoint") or peer.get("path") == "relayed":
        return None
    return str(peer["endpoint"])


def _probe_udp(network, ip: str, endpoint: str | None) -> dict:
    """Ask the coordinator at overlay address `ip` to send datagrams to our observed endpoint; count those that
    arrive from its public address: `endpoint`, its WireGuard endpoint as we see it (the token's first
    enrolment address where there is none). With several coordinators the one asked is the one our agent syncs
    with, not always the token's first: counting the first's address alone, a node whose first coordinator was
    lost was told its port was not reachable from outside."""
    host_, _ = split_endpoint(endpoint or network.endpoints[0])
    try:
        source = net.resolve(host_)
        with net.udp_arrivals(source, network.listen_port) as arrived:
            answer = _ask_probe(ip, network.api_port)
            deadline = time.monotonic() + UDP_WAIT_S
            while arrived() < int(answer["sent"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            return {"endpoint": answer["endpoint"], "sent": int(answer["sent"]), "arrived": arrived()}
    except (MeshrunError, OSError) as exc:
        return {"error": getattr(exc, "message", str(exc))}


def _ask_probe(ip: str, port: int) -> dict:
    """POST /v1/probe-udp; a 429 (this node was probed less than PROBE_INTERVAL_S ago: doctor run twice in a
    row) is asked again once the interval has passed, so a second doctor gets the answer, not a skip."""
    try:
        return transport.call(ip, port, "POST", "/v1/probe-udp", {}, timeout=5)
    except MeshrunError as exc:
        if exc.status != 429:
            raise
    time.sleep(PROBE_INTERVAL_S + 0.2)  # the coordinator's limit, plus its clock's and our requests' slack
    return transport.call(ip, port, "POST", "/v1/probe-udp", {}, timeout=5)


def _job_python(pid: int | None) -> str:
    """The interpreter the daemon runs under: jobs run under it unless --python says otherwise."""
    argv = procs.argv(pid) if pid else None
    return argv[0] if argv else sys.executable
