"""wireguard-go's ceiling on this machine, unshaped, and the knobs that might raise it.

Protocol (fixed before the first run; the overlay's-ceiling item of the data path issue):

Every variant is its own pair of network namespaces joined by one veth pair, nothing shaped, built before the
first measurement; the WireGuard variants run wireguard-go exactly as meshrun starts it
(meshrun.system.kernel.device: ``wireguard-go -f``, WG_PROCESS_FOREGROUND=1, LOG_LEVEL=error; TUN and UDP
offloads are wireguard-go's own, recorded from ``ip -d link`` and the veth's packet sizes) with the overlay MTU
meshrun picks for a 1500-byte underlay (1420), plus the variant's change:

- ``raw``: no WireGuard, the veth itself (the underlay)
- ``wg``: one wireguard-go tunnel, as meshrun runs it
- ``wg_gomaxprocs1``: GOMAXPROCS=1 (the Go scheduler's threads spinning for work on a shared machine)
- ``wg_gogc400``: GOGC=400 (fewer garbage collections)
- ``wg_jumbo``: a 9000-byte underlay and an 8920-byte overlay (datacenter jumbo frames; fewer packets per byte)
- ``wg_x2``, ``wg_x4``: several tunnels per pair (one wireguard-go each, own keys and port), the streams spread
  over them one per tunnel in turn (what multi-tunnel WireGuard does per flow)
- ``wg_jumbo_x4``: both (added after the first GPU run showed each winning alone)

Each round measures every variant, in alternating order (reversed every other round): iperf3 TCP from the first
namespace to the second for --seconds with 1 stream and with --streams streams (the multi-tunnel variants: the
streams spread over their tunnels, one iperf3 client and server per tunnel), the receiver's Gbit/s, and during the
1-stream run and the n-stream run the busy CPU of the whole machine (/proc/stat, what the hypervisor stole recorded
apart: common.cpu_jiffies) and the CPU of the variant's wireguard-go processes, each per GB received. Reported:
min / median / max over the rounds, and each WireGuard variant's median over ``wg``'s and over ``raw``'s, paired per
round. No target: the issue asks what keeps wireguard-go below its published class (about 10 Gbit/s on one stream
between two machines) and to adopt what wins; a variant "wins" only if every round's ratio to ``wg`` is above 1 and
its median beats the spread of ``wg``.

    sudo .venv/bin/python benchmarks/wg_ceiling.py [--rounds 3] [--seconds 5] [--streams 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WG_MTU, JUMBO = 1420, 9000
BASE_PORT = 5400
VARIANTS = {  # name: (tunnels, extra wireguard-go environment, underlay MTU)
    "raw": (0, {}, 1500),
    "wg": (1, {}, 1500),
    "wg_gomaxprocs1": (1, {"GOMAXPROCS": "1"}, 1500),
    "wg_gogc400": (1, {"GOGC": "400"}, 1500),
    "wg_jumbo": (1, {}, JUMBO),
    "wg_x2": (2, {}, 1500),
    "wg_x4": (4, {}, 1500),
    "wg_jumbo_x4": (4, {}, JUMBO),
}


def sh(*argv: str, check: bool = True, timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), input=input, capture_output=True, text=True, check=check, timeout=timeout)


def proc_jiffies(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])  # utime, stime
    return total


class Pair:
    """Two namespaces `<tag>a` and `<tag>b` over a veth pair, with `tunnels` wireguard-go tunnels between them."""

    def __init__(self, tag: str, index: int, tunnels: int, env: dict, mtu: int, wg_bin: str) -> None:
        self.a, self.b, self.tunnels = f"{tag}a", f"{tag}b", tunnels
        self.procs: list[subprocess.Popen] = []
        self.under_a, self.under_b = f"192.168.{100 + index}.1", f"192.168.{100 + index}.2"
        self.dst: list[str] = []  # the receiver's address of each path (tunnel, or the veth)
        self.offload: dict = {}
        try:
            self._build(tag, index, env, mtu, wg_bin)
        except BaseException:
            self.down()  # nothing half-built stays: its namespaces and wireguard-go processes go
            raise

    def _build(self, tag: str, index: int, env: dict, mtu: int, wg_bin: str) -> None:
        tunnels = self.tunnels
        for ns in (self.a, self.b):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", "va", "netns", self.a, "type", "veth", "peer", "name", "vb", "netns", self.b)
        for ns, dev, ip in ((self.a, "va", self.under_a), (self.b, "vb", self.under_b)):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "mtu", str(mtu), "up")
        if not tunnels:
            self.dst = [self.under_b]
            return
        for t in range(tunnels):
            keys = {ns: sh("wg", "genkey").stdout.strip() for ns in (self.a, self.b)}
            pubs = {ns: sh("wg", "pubkey", input=keys[ns]).stdout.strip() for ns in (self.a, self.b)}
            # Interface names are global to the UAPI socket directory (/var/run/wireguard), so unique per pair.
            names = {self.a: f"{tag}a{t}", self.b: f"{tag}b{t}"}
            for ns in (self.a, self.b):
                self.procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, wg_bin, "-f", names[ns]],
                        env={**os.environ, "WG_PROCESS_FOREGROUND": "1", "LOG_LEVEL": "error", **env},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
            for ns in (self.a, self.b):
                wait_until(lambda ns=ns: Path(f"/var/run/wireguard/{names[ns]}.sock").exists(), f"{names[ns]} up")
            port = 51820 + t
            for ns, other, ip, other_under, addr in (
                (self.a, self.b, f"10.{index}.{t}.1", self.under_b, f"10.{index}.{t}.2"),
                (self.b, self.a, f"10.{index}.{t}.2", self.under_a, f"10.{index}.{t}.1"),
            ):
                # The private key goes in on stdin: never in a file or on a command line.
                sh("ip", "netns", "exec", ns, "wg", "set", names[ns], "listen-port", str(port), "private-key",
                   "/dev/stdin", "peer", pubs[other], "allowed-ips", f"{addr}/32", "endpoint", f"{other_under}:{port}",
                   input=keys[ns])  # fmt: skip
                sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", names[ns])
                sh("ip", "-n", ns, "link", "set", names[ns], "mtu", str(mtu - 80), "up")
            self.dst.append(f"10.{index}.{t}.2")
        link = sh("ip", "-n", self.a, "-d", "link", "show", names[self.a]).stdout
        self.offload = {"vnet_hdr": "vnet_hdr on" in link, "mtu": mtu - 80, "underlay_mtu": mtu}
        for d in self.dst:
            ping = ["ip", "netns", "exec", self.a, "ping", "-c1", "-W1", d]
            wait_until(lambda ping=ping: sh(*ping, check=False).returncode == 0, f"a handshake to {d}")

    def wg_pids(self) -> list[int]:
        """The wireguard-go processes (ip netns exec execs it, so the child's pid is wireguard-go's)."""
        return [p.pid for p in self.procs]

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in (self.a, self.b):
            sh("ip", "netns", "del", ns, check=False)


def wait_until(check, what: str, timeout: float = 15) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if check():
            return
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def measure(pair: Pair, streams: int, seconds: float) -> dict:
    """iperf3 from a to b over the pair's paths, `streams` spread over them; Gbit/s, CPU per GB."""
    from common import cpu_jiffies

    paths = pair.dst[: max(1, min(streams, len(pair.dst)))]
    per = [streams // len(paths) + (1 if i < streams % len(paths) else 0) for i in range(len(paths))]
    servers = [
        subprocess.Popen(
            ["ip", "netns", "exec", pair.b, "iperf3", "-s", "-1", "-p", str(BASE_PORT + i)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(len(paths))
    ]
    try:
        for i in range(len(paths)):
            wait_until(
                lambda i=i: f":{BASE_PORT + i}" in sh("ip", "netns", "exec", pair.b, "ss", "-ltn").stdout,
                "iperf3 server",
            )
        (j0, s0), w0 = cpu_jiffies(), proc_jiffies(pair.wg_pids())
        clients = [
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    pair.a,
                    "iperf3",
                    "-c",
                    d,
                    "-p",
                    str(BASE_PORT + i),
                    "-t",
                    f"{seconds:g}",
                    "-P",
                    str(n),
                    "-J",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for i, (d, n) in enumerate(zip(paths, per))
        ]
        outs = [c.communicate(timeout=seconds + 60) for c in clients]
        (j1, s1), w1 = cpu_jiffies(), proc_jiffies(pair.wg_pids())
    finally:
        for s in servers:
            if s.poll() is None:
                s.kill()
            s.wait()
    bits = gbytes = retr = 0.0
    for out, err in outs:
        try:
            end = json.loads(out)["end"]
        except (ValueError, KeyError):
            raise SystemExit(f"iperf3 failed: {out[-1500:]} {err[-500:]}") from None
        bits += end["sum_received"]["bits_per_second"]
        gbytes += end["sum_received"]["bytes"] / 1e9
        retr += end["sum_sent"].get("retransmits", 0)
    hz = os.sysconf("SC_CLK_TCK")
    return {
        "gbit": bits / 1e9,
        "gb": gbytes,
        "retransmits": retr,
        "cpu_s_per_GB": (j1 - j0) / hz / gbytes,
        "wg_cpu_s_per_GB": (w1 - w0) / hz / gbytes,
        "steal_s": (s1 - s0) / hz,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--name", default="wg_ceiling")
    ap.add_argument("--out-dir", type=Path, help="where the JSON goes [benchmarks/results]")
    a = ap.parse_args()
    from common import alternating, need_root, spread, write_result

    need_root()
    wg_bin = os.environ.get("MESHRUN_WIREGUARD_GO") or shutil.which("wireguard-go") or "wireguard-go"
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    tag = f"wc{secrets.token_hex(2)}"
    t0 = time.monotonic()
    pairs: dict[str, Pair] = {}
    runs: dict[str, list[dict]] = {v: [] for v in names}
    order = []
    try:
        for i, v in enumerate(names):
            tunnels, env, mtu = VARIANTS[v]
            pairs[v] = Pair(f"{tag}{i}", i, tunnels, env, mtu, wg_bin)
        for r in range(a.rounds):
            this = alternating(names, r + 1)[-len(names) :]
            order.append(this)
            for v in this:
                one = measure(pairs[v], 1, a.seconds)
                many = measure(pairs[v], a.streams, a.seconds)
                runs[v].append({"round": r + 1, "one": one, "many": many})
                print(
                    f"round {r + 1} {v:15s} 1 stream {one['gbit']:6.2f} Gbit/s ({one['cpu_s_per_GB']:.2f} CPU s/GB, "
                    f"wireguard-go {one['wg_cpu_s_per_GB']:.2f}); {a.streams} streams {many['gbit']:6.2f}",
                    flush=True,
                )
    finally:
        for p in pairs.values():
            p.down()

    def med(v: str, k: str, m: str = "gbit") -> float:
        return spread([x[k][m] for x in runs[v]])["median"]

    table = {}
    for v in names:
        row = {
            k: {m: spread([x[k][m] for x in runs[v]]) for m in ("gbit", "cpu_s_per_GB", "wg_cpu_s_per_GB")}
            for k in ("one", "many")
        }
        for base in ("wg", "raw"):
            if base in runs and v != base:
                for k in ("one", "many"):
                    rs = [x[k]["gbit"] / y[k]["gbit"] for x, y in zip(runs[v], runs[base])]
                    row[k][f"over_{base}"] = spread(rs)
        if v.startswith("wg_") and "wg" in runs:
            wins = {}
            for k in ("one", "many"):
                rs = [x[k]["gbit"] / y[k]["gbit"] for x, y in zip(runs[v], runs["wg"])]
                wg_s = spread([x[k]["gbit"] for x in runs["wg"]])
                wins[k] = all(x > 1 for x in rs) and med(v, k) - wg_s["median"] > wg_s["max"] - wg_s["min"]
            row["wins_over_wg"] = wins
        table[v] = row
    parts = []
    for v in names:
        s = f"{v} {med(v, 'one'):.2f}/{med(v, 'many'):.2f} Gbit/s"
        s += f" ({spread([x['one']['cpu_s_per_GB'] for x in runs[v]])['median']:.2f} CPU s/GB)"
        parts.append(s)
    winners = [v for v in names if any(table[v].get("wins_over_wg", {}).values())]
    summary = (
        f"wg_ceiling ({os.cpu_count()} CPUs): 1/{a.streams} streams, medians of {a.rounds} rounds: "
        + "; ".join(parts)
        + f"; beats wg in every round beyond its spread: {', '.join(winners) or 'none'}"
    )
    offloads = {v: p.offload for v, p in pairs.items() if p.offload}
    result = {
        "protocol": __doc__.split("Protocol (fixed before the first run; ")[1].split("\n\n    sudo")[0],
        "rounds": a.rounds,
        "seconds": a.seconds,
        "streams": a.streams,
        "variants": {
            v: {"tunnels": VARIANTS[v][0], "env": VARIANTS[v][1], "underlay_mtu": VARIANTS[v][2]} for v in names
        },
        "offloads": offloads,
        "order": order,
        "runs": runs,
        "table": table,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    path = write_result(a.name, result, summary)
    if a.out_dir:
        a.out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, a.out_dir / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
