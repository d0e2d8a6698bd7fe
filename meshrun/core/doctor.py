"""`meshrun doctor`: what a member's facts mean for training, as lines of ok/warn/FAIL with the fix.

Pure: `judge` turns the facts that meshrun.mesh.doctor gathered (a plain dict, the same as
`doctor --json` shows under "facts") into checks. FAIL is for what stops or hangs a job (the daemon
down, the interface down, packets of full size lost, the coordinator unreachable, torch missing, an
override of meshrun's interface pinning); warn is for what costs speed or may bite later (an old
wireguard-go, a stale peer, UDP not reachable from outside, a drifting clock, little disk).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshrun.core import preflight
from meshrun.core.etcdconf import TWO_COORDINATORS
from meshrun.core.lanpath import LAN_PORT

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
HANDSHAKE_STALE_S = 180  # WireGuard re-handshakes every 2 min while traffic flows; keepalives keep it flowing
PEER_LINES_MAX = 12  # above this many healthy peers, one summary line
# torch's c10d store reverse-resolves each connection's own address before a rank's process group exists: a
# resolver this slow to name the overlay address (or to say it cannot) delays every rank's start as much.
REVERSE_DNS_WARN_S = 1.0
REVERSE_DNS_LIMIT_S = 6.0  # glibc's timeout is 5 s a try: how long doctor waits for the lookup
# meshrun sets these for every job; one set elsewhere to another value sends traffic off the overlay.
PINNED = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Not set by meshrun, passed to jobs as they are, and each able to take a job off the overlay.
STEERING = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_COMM_ID",
    "NCCL_SOCKET_FAMILY",
    "NCCL_NET_PLUGIN",
    "GLOO_DEVICE_TRANSPORT",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
)


@dataclass(frozen=True)
class Check:
    """One line of the doctor's report."""

    name: str
    level: str  # OK | WARN | FAIL | SKIP
    detail: str
    fix: str = ""


def blocking(checks: list[Check]) -> bool:
    """True when something stops training on this member (doctor's exit code is then 1)."""
    return any(c.level == FAIL for c in checks)


def render(checks: list[Check], head: str) -> str:
    """One screen: a head line, then each check (`fix:` under the ones that need one)."""
    width = max([len(c.name) for c in checks] + [6])
    lines = [head]
    for c in checks:
        lines.append(f"{c.level:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.level in (WARN, FAIL):
            lines.append(f"{'':4}  {'':<{width}}  fix: {c.fix}")
    failed = sum(c.level == FAIL for c in checks)
    warned = sum(c.level == WARN for c in checks)
    lines.append(
        f"{failed} problem(s) that block training, {warned} warning(s)"
        if failed or warned
        else "everything meshrun checks is fine"
    )
    return "\n".join(lines)


def to_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _age(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def removed(role: str, name: str, by: str | None = None) -> tuple[str, str]:
    """(what, fix) for a member the network removed for good (its record's "removed"): what status, doctor and
    `coordinator list` say there. Nothing else applies to it: `meshrun up` refuses, and it takes no part in the
    network's state, so no other member is suggested to bring back or remove from here."""
    who = f"{by} says this coordinator" if role == "coordinator" and by else f"this {role}"
    what = f"{who} ({name}) was removed from the network for good: it takes no part in it any more"
    fix = "clean up with `meshrun down --purge`" if role == "coordinator" else "clean up with `meshrun leave --purge`"
    again = "join again with a new token (`meshrun token create` on a coordinator)"
    if role == "coordinator":
        again += " and `meshrun coordinator add` it"
    return what, f"{fix}; to take part again, {again}"


def judge(f: dict) -> list[Check]:
    """Every check for the facts `f` (see meshrun.mesh.doctor.gather for the keys); a removed member gets only
    the one that says so (`removed`)."""
    if f.get("removed"):
        return [Check("membership", FAIL, *removed(f["role"], f["name"], f.get("removed_by")))]
    out = [_daemon(f), _interface(f), _backend(f)]
    if f.get("control"):
        out.append(_control(f))
    if f.get("interface", {}).get("up"):
        out.append(_mtu(f))
        if f["role"] == "node":
            out.append(_coordinator(f))
            out.append(_coordinators_seen(f))
        out += _peers(f)
        out.append(_lan(f))
        out.append(_tunnels(f))
        out.append(_relay(f))
        out.append(_udp(f))
    out.append(_clock(f))
    out.append(_job_guards(f))
    out.append(_reverse_dns(f))
    out += _environment(f)
    out += _variables(f)
    return [c for c in out if c is not None]


def _daemon(f: dict) -> Check:
    what = "coordinator daemon" if f["role"] == "coordinator" else "agent"
    if f.get("daemon_pid"):
        return Check("daemon", OK, f"the {what} runs (pid {f['daemon_pid']})")
    return Check(
        "daemon",
        FAIL,
        f"the {what} is not running: peers are not kept in sync and no job can start here",
        "meshrun up (or: systemctl start meshrun, if you installed the service)",
    )


def _control(f: dict) -> Check:
    """Several coordinators: does etcd have a majority (quorum), and who leads?"""
    c = f["control"]
    rows = c.get("coordinators") or []
    if not c.get("etcd_pid"):
        return Check(
            "control",
            FAIL,
            "this coordinator's etcd member is not running: its copy of the network's state is not served",
            "meshrun up (the daemon starts it again); its log is <state>/etcd/etcd.log",
        )
    total = len(rows)
    ok = [r for r in rows if r.get("etcd") == "ok"]
    need = total // 2 + 1
    leader = next((r["name"] for r in rows if r.get("role") == "leader"), None)
    # Without a majority this coordinator's own member answers nothing either (its rows are named by overlay
    # address then): what to bring back is the others, never itself.
    me = {f.get("name"), f.get("overlay_ip")} - {None}
    down = [r["name"] for r in rows if r.get("etcd") != "ok" and not me & {r.get("name"), r.get("overlay_ip")}]
    if total and len(ok) >= need:
        if not down and total == 2:
            return Check("control", WARN, f"etcd: 2 of 2 coordinators answer; {TWO_COORDINATORS}")
        if not down:
            return Check("control", OK, f"etcd: {len(ok)} of {total} coordinators answer; {leader or '?'} leads")
        return Check(
            "control",
            WARN,
            f"etcd: {len(ok)} of {total} coordinators answer ({', '.join(down)} not): still a majority, but one more "
            "loss stops enrolment, path changes and job takeovers",
            f"bring {', '.join(down)} back (`meshrun up` there), or take it out: `meshrun coordinator remove "
            f"{down[0]}` (here; `--force` when its machine is gone for good)",
        )
    return Check(
        "control",
        FAIL,
        f"etcd has no majority: {len(ok)} of {total or '?'} coordinators answer, {need if total else '?'} are needed "
        f"({', '.join(down) or 'the others'} do not). Nothing can change: no joins, removals, path changes, jobs "
        "or takeovers; tunnels and running jobs go on as they are",
        f"bring back {', '.join(down) or 'the other coordinators'} (`meshrun up` there, their etcd data is in "
        "<state>/etcd/); if they are gone for good, this coordinator's data can seed a new cluster: stop it, run "
        "etcd once with --force-new-cluster on <state>/etcd/data (see docs/ha.md), then `meshrun up`",
    )


def control_warnings(role: str, peers: list[dict], coordinators: list[dict]) -> list[str]:
    """What `meshrun status` warns about the coordinators: any that is lost, and a pair of them. A coordinator
    reads `coordinators` (meshrun.mesh.status.coordinators: etcd's health of each); a node its peers' rows
    (`_silent`: a coordinator that did not answer now, or without a recent WireGuard handshake)."""
    out = []
    if role == "coordinator":
        total = len(coordinators)
        lost = [r["name"] for r in coordinators if r.get("etcd") not in ("ok", "-", "learner")]
    else:
        coords = [p for p in peers if p.get("coordinator")]
        total = len(coords)
        lost = [p["name"] for p in coords if _silent(p)]
    if lost and total > 1:
        left = total - len(lost)
        if left >= total // 2 + 1:
            way = (
                f"a reboot comes back by itself; gone for good: `meshrun coordinator remove {lost[0]} --force` on "
                "another coordinator"
            )
        else:  # no majority: a removal could not be decided either (it would fail wherever it was run)
            way = (
                "no majority: nothing can change until enough come back (`meshrun up` on each); gone for good: "
                "seed a new cluster from one of them (docs/ha.md, --force-new-cluster)"
            )
        out.append(f"coordinator {', '.join(lost)} not heard from: the control plane runs on {left} of {total} ({way})")
    if total == 2:
        out.append(TWO_COORDINATORS)
    return out


def _silent(peer: dict) -> bool:
    """A peer that did not answer when asked now, or (not asked) without a WireGuard handshake for
    HANDSHAKE_STALE_S (keepalives keep every live tunnel handshaking)."""
    if peer.get("answered") is not None:
        return not peer["answered"]
    return peer.get("handshake_age_s") is None or peer["handshake_age_s"] > HANDSHAKE_STALE_S


def _coordinators_seen(f: dict) -> Check | None:
    """On a node of a network with several coordinators: is every coordinator heard from?"""
    if f["role"] != "node":
        return None
    peers = f.get("peers") or []
    total = sum(1 for p in peers if p.get("coordinator"))
    if total < 2:
        return None
    warnings = control_warnings("node", peers, [])
    if warnings:
        return Check("coordinators", WARN, "; ".join(warnings), "see `meshrun coordinator list` on a coordinator")
    if all(p.get("answered") for p in peers if p.get("coordinator")):
        return Check("coordinators", OK, f"all {total} coordinators answer now")
    return Check("coordinators", OK, f"all {total} coordinators heard from in the last {_age(HANDSHAKE_STALE_S)}")


def _interface(f: dict) -> Check:
    i, name = f.get("interface", {}), f["interface_name"]
    if not i.get("exists"):
        return Check(
            "interface",
            FAIL,
            f"{name} does not exist: this member is off the overlay",
            "meshrun up (it creates the interface from the saved state)",
        )
    if not i.get("up"):
        return Check(
            "interface",
            FAIL,
            f"{name} exists but is down: nothing crosses the overlay",
            f"ip link set {name} up (or: meshrun leave && meshrun up)",
        )
    return Check("interface", OK, f"{name} is up, {f['overlay_ip']}/{f.get('prefixlen', 32)}, mtu {i.get('mtu')}")


def _backend(f: dict) -> Check:
    b = f.get("backend") or {}
    kind, version, module = b.get("kind"), b.get("version"), b.get("kernel_module")
    if kind == "kernel":
        return Check("wireguard", OK, "kernel WireGuard")
    if kind is None:
        return Check("wireguard", SKIP, "no interface to read the backend from")
    why = (
        "this kernel has no WireGuard module"
        if module is False
        else "the kernel module is present but the interface was not created with it"
        if module
        else "the kernel module could not be looked for"
    )
    label = f"wireguard-go {version}" if version else "wireguard-go (version unknown)"
    if b.get("warning"):
        return Check(
            "wireguard",
            WARN,
            f"{label}, userspace ({why}): {b['warning']}",
            "install a wireguard-go with batched I/O (Debian 12: apt-get install -t bookworm-backports "
            "wireguard-go) and run `meshrun leave && meshrun up`",
        )
    fix = "" if module is False else "meshrun leave && modprobe wireguard && meshrun up, for the kernel's faster path"
    return Check("wireguard", OK if module is not True else WARN, f"{label}, userspace ({why})", fix)


def _mtu(f: dict) -> Check:
    m = f.get("mtu_probe") or {}
    mtu = f.get("interface", {}).get("mtu")
    target = m.get("target")
    if not target:
        return Check("mtu", SKIP, f"{mtu}: no peer with a handshake to probe the path to")
    if m.get("full") is None:
        return Check("mtu", SKIP, f"{mtu}: could not probe ({m.get('error') or 'no permission for ICMP'})")
    if m["full"]:
        return Check("mtu", OK, f"{mtu}: a full-size packet with DF set reaches {target} over the overlay")
    if not m.get("small"):
        return Check(
            "mtu",
            FAIL,
            f"not even a small packet reaches {target} over the overlay",
            "see the peer and coordinator lines; the tunnel itself is down",
        )
    largest = m.get("largest")
    return Check(
        "mtu",
        FAIL,
        f"packets of {mtu} bytes to {target} are lost (a path MTU black hole: ICMP "
        f"'fragmentation needed' does not come back); {largest} bytes get through",
        f"meshrun leave && meshrun join --mtu {largest} ... (or ask for ICMP type 3 code 4 to be let through)",
    )


def _coordinator(f: dict) -> Check:
    c = f.get("coordinator") or {}
    if c.get("reachable"):
        return Check("coordinator", OK, f"{c['ip']} answers over the overlay (an API call took {c['rtt_ms']:.0f} ms)")
    sync = f.get("sync") or {}
    since = f" for {_age(int(f['now'] - sync['failing_since']))}" if sync.get("failing_since") and f.get("now") else ""
    return Check(
        "coordinator",
        FAIL,
        f"{c.get('ip')} does not answer over the overlay{since}: {c.get('error') or 'timeout'}; the agent keeps "
        "every tunnel, path and relay as last known and retries (joins, removals and path changes wait)",
        "check the coordinator runs (`meshrun status` there) and that UDP "
        f"{f.get('listen_port', 51820)} reaches it from here",
    )


def _peers(f: dict) -> list[Check]:
    rows = f.get("peers") or []
    if not rows:
        return [
            Check(
                "peers",
                WARN if f["role"] == "coordinator" else FAIL,
                "no peers yet",
                "join a node with `meshrun join TOKEN`"
                if f["role"] == "coordinator"
                else "meshrun leave && meshrun up",
            )
        ]
    bad, good = [], []
    for r in rows:
        age = r.get("handshake_age_s")
        via = r.get("path") or "?"
        if r.get("endpoint") and via != "relayed":
            via += f" via {r['endpoint']}"
        name = f"peer {r['name']}"
        if age is None:
            bad.append(Check(name, WARN, f"no handshake yet ({via})", f"is {r['name']} up? run `meshrun doctor` there"))
        elif age > HANDSHAKE_STALE_S:
            bad.append(
                Check(
                    name,
                    WARN,
                    f"last handshake {_age(age)} ago ({via})",
                    f"is {r['name']} up? run `meshrun doctor` there",
                )
            )
        else:
            good.append(Check(name, OK, f"handshake {_age(age)} ago, {via}"))
    if f["role"] == "node":  # without the coordinator nothing is kept in sync and relayed pairs are cut
        for c in list(bad):
            if c.name == f"peer {f.get('coordinator_name')}":
                bad[bad.index(c)] = Check(c.name, FAIL, c.detail, c.fix)
    if len(good) > PEER_LINES_MAX:
        good = [Check("peers", OK, f"{len(good)} peers with a handshake in the last {_age(HANDSHAKE_STALE_S)}")]
    return good + bad


def _lan(f: dict) -> Check | None:
    """The site LAN path (a trusted site's pairs without WireGuard, meshrun.core.lanpath): made, and answering?"""
    lan = f.get("lan") or {}
    if lan.get("error"):
        return Check(
            "site LAN path",
            WARN,
            f"cannot be made here ({lan['error']}): this site's pairs stay on WireGuard, at its speed",
            "see the agent's log (daemon.log) for the fix, or `meshrun site untrust SITE` on the coordinator"
            if lan.get("routed")
            else "load the vxlan kernel module, or `meshrun site untrust SITE` on the coordinator",
        )
    planned, active = lan.get("planned") or [], set(lan.get("active") or [])
    if not planned:
        return None
    down = [n for n in planned if n not in active]
    if down:
        return Check(
            "site LAN path",
            WARN,
            f"{len(down)} of {len(planned)} peers do not answer on it ({', '.join(down[:8])}): on WireGuard instead",
            "the site's encapsulation is none: the LAN must be one layer-2 segment that passes the overlay's "
            "addresses (a cloud VPC does not); else `meshrun site trust SITE --encapsulation vxlan`"
            if lan.get("routed")
            else f"allow UDP {LAN_PORT} between the site's nodes' LAN addresses (security groups, host firewalls)",
        )
    how = "routed, no encapsulation" if lan.get("routed") else "VXLAN"
    return Check(
        "site LAN path", OK, f"{len(planned)} peers on the site network, unencrypted ({how}, {lan.get('device')})"
    )


def _tunnels(f: dict) -> Check | None:
    """Several tunnels per same-site pair (`join --tunnels`, meshrun.core.tunnels): made, and carrying flows?"""
    t = f.get("tunnels") or {}
    count = int(t.get("count") or 1)
    if count < 2:
        return None
    if t.get("error"):
        return Check(
            "tunnels",
            WARN,
            f"{count} tunnels per pair asked for, none made here ({t['error']}): every pair on "
            f"{f.get('interface_name') or 'the overlay interface'} alone",
            "see the agent's log (daemon.log); or `meshrun leave`, then `meshrun join --tunnels 1`",
        )
    peers = t.get("peers") or {}
    if not peers:
        return Check(
            "tunnels", OK, f"{count} tunnels per pair, no same-site peer on the private path runs extra tunnels yet"
        )
    # A pair uses as many tunnels as the member with fewer runs (`count` in the record: that pair's).
    full = [n for n, p in peers.items() if len(p.get("live") or []) == int(p.get("count") or count) - 1]
    none = [n for n, p in peers.items() if not p.get("live")]
    detail = f"{len(full)} of {len(peers)} same-site peers with extra tunnels on all of them"
    if none and len(none) == len(peers):
        last = t.get("ports") or []
        return Check(
            "tunnels",
            WARN,
            f"no same-site peer answers on the extra tunnels ({', '.join(sorted(none)[:8])})",
            f"allow UDP {last[0]}-{last[-1]} between the site's nodes' LAN addresses (security groups, host firewalls)"
            if last
            else "allow the extra tunnels' UDP ports between the site's nodes' LAN addresses",
        )
    if none:
        detail += f"; {len(none)} answer on none, their ports closed? ({', '.join(sorted(none)[:8])})"
    return Check("tunnels", OK, detail)


def _relay(f: dict) -> Check | None:
    """Pairs this node relays, and whether the kernel forwards them (meshrun.system.kernel.relaykernel)."""
    r = f.get("relaying") or {}
    if not r.get("pairs"):
        return None
    how = r.get("forwarding") or "unknown"
    if how.startswith("userspace"):
        return Check(
            "relay",
            WARN,
            f"relays {r['pairs']} pairs in {how}: each datagram costs two system calls here",
            "install nftables (apt-get install nftables) on a kernel with nftables' netdev family (Linux >= 5.5), "
            "then restart the agent",
        )
    return Check("relay", OK, f"relays {r['pairs']} pairs, forwarded by the {how}")


def _udp(f: dict) -> Check:
    u = f.get("udp_probe") or {}
    port = f.get("listen_port", 51820)
    if f["role"] == "coordinator":
        n = sum(1 for r in f.get("peers") or [] if r.get("handshake_age_s") is not None)
        return Check(f"udp/{port}", OK if n else SKIP, f"members reach this coordinator ({n} with a handshake)")
    if "arrived" not in u:
        return Check(f"udp/{port}", SKIP, f"reachability from outside not tested: {u.get('error') or 'no probe'}")
    if u["arrived"]:
        return Check(
            f"udp/{port}",
            OK,
            f"reachable from outside: {u['arrived']} of {u['sent']} probes the coordinator "
            f"sent to {u['endpoint']} arrived",
        )
    return Check(
        f"udp/{port}",
        WARN,
        f"not reachable from outside: none of {u['sent']} probes the coordinator sent to "
        f"{u['endpoint']} arrived: direct paths to this node rely on hole punching (pairs where it "
        "fails go through the relay)",
        f"forward UDP {port} to this machine (NAT/security group) for direct paths",
    )


def _clock(f: dict) -> Check | None:
    off = f.get("clock_offset_s")
    if f["role"] == "coordinator":
        return None
    if off is None:
        return Check("clock", SKIP, "offset unknown (the coordinator did not answer)")
    if abs(off) >= preflight.CLOCK_WARN_S:
        level = FAIL if abs(off) >= preflight.CLOCK_BLOCK_S else WARN
        return Check(
            "clock",
            level,
            f"{off:+.1f} s off the coordinator's (job control refuses 300 s)",
            "synchronise the clocks (NTP/chrony)",
        )
    return Check("clock", OK, f"{off:+.2f} s off the coordinator's")


def _job_guards(f: dict) -> Check | None:
    """Whether a job's ports can be kept to its nodes here (meshrun.system.kernel.firewall), and with which cgroup v2: a
    node's share and a coordinator's job store are both guarded."""
    g = f.get("job_guards")
    if g is None:
        return None
    if g.get("problem"):
        message, fix = g["problem"]
        return Check("job guards", FAIL, f"jobs cannot start here: {message}", fix)
    return Check("job guards", OK, f"a job's ports admit only its nodes; {g.get('cgroup')}")


def _reverse_dns(f: dict) -> Check | None:
    """How long the resolver took to name this member's overlay address (docs/troubleshooting.md)."""
    if "reverse_dns_s" not in f:
        return None
    took, ip = f["reverse_dns_s"], f.get("overlay_ip")
    fix = (
        "make the resolver in /etc/resolv.conf answer (or name the overlay addresses in /etc/hosts): "
        "torch looks this up before every rank's process group exists"
    )
    if took is None:
        return Check("resolver", WARN, f"looking {ip} up had not ended after {REVERSE_DNS_LIMIT_S:g} s", fix)
    if took >= REVERSE_DNS_WARN_S:
        return Check("resolver", WARN, f"naming {ip} took {took:.1f} s: every rank's start waits as long", fix)
    return Check("resolver", OK, f"{ip} looked up in {took * 1000:.0f} ms")


def _environment(f: dict) -> list[Check]:
    """Disk and torch, judged by the same rules as a job's pre-flight."""
    env = f.get("environment") or {}
    report = preflight.EnvReport.from_dict(f["name"], env)
    trains = f["role"] == "node" or f.get("trains")
    out = []
    disk = f"{(report.free_bytes or 0) >> 20} MiB free in {f.get('jobs_dir')}"
    findings = {fi.what: fi for fi in preflight.compare([report])}
    for fi in findings.values():
        name = "disk" if "free" in fi.what else "clock" if "clock" in fi.what else "torch"
        level = FAIL if fi.level == preflight.BLOCK else WARN
        if name == "torch" and not trains:
            level = SKIP
        out.append(Check(name, level, fi.what, fi.fix))
    if not any(c.name == "disk" for c in out):
        out.append(Check("disk", OK, disk))
    use = f.get("disk_use")
    if use is not None:
        projects = use.get("projects") or {}
        biggest = sorted(projects.items(), key=lambda kv: -kv[1])[:3]
        out.append(
            Check(
                "job files",
                OK,
                f"jobs {_mib(use.get('jobs', 0))}, {len(projects)} project(s) "
                f"{_mib(sum(projects.values()))}"
                + (" (" + ", ".join(f"{n} {_mib(b)}" for n, b in biggest) + ")" if biggest else ""),
                "`meshrun jobs --prune` (finished jobs) and `meshrun jobs --prune-project NAME` on the "
                "coordinator free them"
                if projects or use.get("jobs")
                else "",
            )
        )
    if not any(c.name == "torch" for c in out) and not report.error:
        build = report.build + (f", NCCL {report.nccl}" if report.nccl else "") + (", gloo" if report.gloo else "")
        gpus = (
            f", {report.gpus} GPU(s)" + (f" {report.gpu_names[0]}" if report.gpu_names else "") if report.gpus else ""
        )
        out.append(Check("torch", OK, f"{report.torch} ({build}{gpus}) in {report.python}"))
    return out


def _variables(f: dict) -> list[Check]:
    """Variables that would take traffic off the overlay, in this shell or in the daemon."""
    iface = f["interface_name"]
    mine = {"NCCL_SOCKET_IFNAME": ("=" + iface, iface), "GLOO_SOCKET_IFNAME": (iface,)}
    out = []
    for where, env in (("this shell", f.get("shell_env") or {}), ("the daemon", f.get("daemon_env") or {})):
        for k in PINNED:
            if k in env and env[k] not in mine[k]:
                if where == "this shell":
                    out.append(
                        Check(
                            "environment",
                            FAIL,
                            f"{k}={env[k]} in {where} overrides meshrun's pinning ({mine[k][0]}): "
                            "`meshrun train` passes it to every node and the job leaves the overlay",
                            f"unset {k}",
                        )
                    )
                else:
                    out.append(
                        Check(
                            "environment",
                            WARN,
                            f"{k}={env[k]} in {where}'s environment (pid {f.get('daemon_pid')}) overrides "
                            f"meshrun's pinning ({mine[k][0]}) for anything started from it but "
                            "`meshrun train`, which sets its own",
                            f"unset {k} where it is set (the service's Environment=, /etc/environment)",
                        )
                    )
        for k in STEERING:
            if k not in env:
                continue
            if k.startswith("MASTER_"):  # torchrun sets its own for the workers of a meshrun job
                if where == "this shell":
                    out.append(
                        Check(
                            "environment",
                            WARN,
                            f"{k}={env[k]} is set in {where}: `meshrun train` ignores "
                            "it, a torchrun started by hand would use it",
                            f"unset {k}",
                        )
                    )
                continue
            out.append(
                Check(
                    "environment",
                    FAIL,
                    f"{k}={env[k]} is set in {where}: every job "
                    f"{'submitted from here' if where == 'this shell' else 'on this node'} "
                    "gets it and may leave the overlay",
                    f"unset {k}",
                )
            )
    if not out:
        out.append(
            Check(
                "environment",
                OK,
                "nothing overrides meshrun's pinning (" + ", ".join(PINNED + STEERING[:1]) + " and the like are unset)",
            )
        )
    return out
