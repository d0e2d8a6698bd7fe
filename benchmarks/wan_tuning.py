"""Which WAN settings win back link rate? Each candidate vs meshrun's defaults, side by side in one run.

    sudo python benchmarks/wan_tuning.py                          # 256 MiB, 3 rounds, every variant: ~10 min
    sudo python benchmarks/wan_tuning.py --variants default,cubic --size 64M --rounds 5

The world of wan_efficiency.py (coordinator + 2 nodes, every datacenter link shaped to --rate Mbit/s,
real `meshrun init/join`). Each round runs every variant once, order rotated per round: one setting
changed on both nodes, a 2-rank gloo all-reduce over meshrun0, the setting restored.

  default   meshrun as shipped (overlay MTU from the join probe: 1420 on a 1500 underlay; wireguard-go's
            UDP socket buffers widened to 7 MiB, as newer wireguard-go does itself)
  smallbuf  wireguard-go's UDP socket buffers back at the kernel default, 208 KiB (meshrun before it
            widened them; what the packaged wireguard-go v0.0.20220316 keeps on its own)
  mtu1440   overlay MTU 1440, the IPv4 maximum (WireGuard + UDP + IPv4 = 60 B on a 1500 underlay)
  cubic     congestion control CUBIC / Reno for overlay connections (`congctl` on the overlay route)
  reno      instead of the host's default (BBR on the machine these ran on)
  nots      TCP timestamps off: 12 B less per segment and per ACK (a host-wide sysctl: diagnostic only)
  frag2840  overlay MTU 2840: every full WireGuard packet leaves in two IP fragments (diagnostic only:
            NATs and firewalls that drop fragments would black-hole the overlay)

For every run the dc2 gateway's shaper counts the bytes it puts on the link, and an iptables rule the
pure ACKs it forwards (packets <= 200 B): a 2-rank ring all-reduce sends both ways over one TCP
connection, so each direction carries data and the other direction's ACKs. `wire_ceiling` is the
all-reduce payload divided by the bytes on the link: the best busbw/link possible with those packets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import mesh_world, need_root, set_congctl, write_result  # noqa: E402  (common puts meshrun on sys.path)
from wan_efficiency import ITERS, allreduce  # noqa: E402

from meshrun.bench.worker import parse_sizes  # noqa: E402
from meshrun.system.kernel import device as wg  # noqa: E402

VARIANTS = ("default", "smallbuf", "mtu1440", "cubic", "reno", "nots", "frag2840")
CONGCTL = ("cubic", "reno")
ACK_RULE = "tuning-small"
KERNEL_DEFAULT_BUF = 212992  # net.core.{r,w}mem_default: what the packaged wireguard-go keeps
MTUS = {"mtu1440": 1440, "frag2840": 2840}


class Variants:
    """Applies and restores one variant on both nodes."""

    def __init__(self, mesh, nodes) -> None:
        self.nodes = nodes
        self.mtu = {n.name: mesh.status(n)["mtu"] for n in nodes}
        self.wg_pid = {n.name: json.loads((mesh.state_dir(n) / "member.json").read_text())["wg_pid"] for n in nodes}

    @contextlib.contextmanager
    def applied(self, variant: str):
        for n in self.nodes:
            self._set(n, variant, on=True)
        try:
            yield
        finally:
            for n in self.nodes:
                self._set(n, variant, on=False)

    def _set(self, n, variant: str, on: bool) -> None:
        if variant in MTUS:
            n.run("ip", "link", "set", "meshrun0", "mtu", str(MTUS[variant] if on else self.mtu[n.name]))
        elif variant == "smallbuf":
            # The kernel stores twice what setsockopt asks for.
            got = wg.widen_socket_buffers(self.wg_pid[n.name], *((KERNEL_DEFAULT_BUF // 2, False) if on else ()))
            want = KERNEL_DEFAULT_BUF if on else 2 * wg.SOCKET_BUFFER
            if not got or any(b != want for pair in got for b in pair):
                raise RuntimeError(f"wireguard-go's socket buffers on {n.name} are {got}, not {want}")
        elif variant in CONGCTL:
            set_congctl(n, "meshrun0", variant if on else None)
        elif variant == "nots":
            n.run("sysctl", "-qw", f"net.ipv4.tcp_timestamps={0 if on else 1}")
        elif variant != "default":
            raise SystemExit(f"unknown variant {variant!r}: use {', '.join(VARIANTS)}")


def counters(world, nodes) -> dict[str, int]:
    """Link bytes/packets the dc2 gateway's shaper sent, its small forwarded packets, node drop counters."""
    gw = world._gw("dc2").netns
    q = json.loads(
        subprocess.run(
            ["ip", "netns", "exec", gw, "tc", "-s", "-j", "qdisc", "show", "dev", "wan0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )[0]
    out = {"wire_bytes": q["bytes"], "wire_packets": q["packets"], "shaper_drops": q["drops"]}
    ipt = subprocess.run(
        ["ip", "netns", "exec", gw, "iptables", "-w", "-nvxL", "FORWARD"], capture_output=True, text=True, check=True
    ).stdout
    for line in ipt.splitlines():
        if f"/* {ACK_RULE} */" in line:
            out["small_packets"], out["small_bytes"] = int(line.split()[0]), int(line.split()[1])
    for n in nodes:
        ns = n.run("nstat", "-az", "UdpRcvbufErrors", "TcpRetransSegs").stdout.split()
        for key in ("UdpRcvbufErrors", "TcpRetransSegs"):
            out[key] = out.get(key, 0) + int(ns[ns.index(key) + 1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--size", default="256M", help="all-reduce size")
    ap.add_argument("--rate", type=int, default=200, help="link rate, Mbit/s")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="wan_tuning", help="results file name")
    args = ap.parse_args()

    need_root()
    variants = args.variants.split(",")
    if variants[0] != "default":
        raise SystemExit("the first variant must be `default`: every other one is compared with it")
    size = parse_sizes(args.size)[0]
    payload = size * (1 + ITERS.get(size, 2))  # the worker's warm-up all-reduce plus the timed ones
    link_Bps = args.rate * 1e6 / 8
    t_start = time.monotonic()
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with mesh_world(2, "tun", rate_mbit=args.rate) as (world, mesh, names):
        a, b = world.node(names[0]), world.node(names[1])
        mesh.wait_ping(a, mesh.overlay_ip(b))
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                world._gw("dc2").netns,
                "iptables",
                "-w",
                "-A",
                "FORWARD",
                "-i",
                "lan0",
                "-m",
                "length",
                "--length",
                "0:200",
                "-m",
                "comment",
                "--comment",
                ACK_RULE,
            ],
            check=True,
        )
        vs = Variants(mesh, (a, b))
        port = 29700
        for r in range(args.rounds):
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                port += 1
                with vs.applied(v):
                    c0 = counters(world, (a, b))
                    row = allreduce(a, b, mesh.overlay_ip(a), "meshrun0", [size], port)[0]
                    c1 = counters(world, (a, b))
                d = {k: c1[k] - c0[k] for k in c0}
                run = {
                    "busbw_Mbit": row["busbw_Bps"] * 8 / 1e6,
                    "vs_link": row["busbw_Bps"] / link_Bps,
                    "correct": row["correct"],
                    "wire_ceiling": payload / d["wire_bytes"],
                    "acks_per_data_packet": d["small_packets"] / max(1, d["wire_packets"] - d["small_packets"]),
                    **d,
                }
                runs[v].append(run)
                print(
                    f"round {r + 1} {v:9s} {run['busbw_Mbit']:.1f} Mbit/s = {run['vs_link']:.3f} x link, "
                    f"wire ceiling {run['wire_ceiling']:.3f}, {run['acks_per_data_packet']:.2f} ACKs per data "
                    f"packet, udp rcvbuf errors {d['UdpRcvbufErrors']}, retransmits {d['TcpRetransSegs']}",
                    flush=True,
                )

    base = statistics.median(x["busbw_Mbit"] for x in runs["default"])
    table = []
    for v in variants:
        med = statistics.median(x["busbw_Mbit"] for x in runs[v])
        table.append(
            {
                "variant": v,
                "busbw_Mbit": med,
                "vs_default": med / base,
                "vs_link": med * 1e6 / 8 / link_Bps,
                "wire_ceiling": statistics.median(x["wire_ceiling"] for x in runs[v]),
                "acks_per_data_packet": statistics.median(x["acks_per_data_packet"] for x in runs[v]),
                "busbw_range_Mbit": [min(x["busbw_Mbit"] for x in runs[v]), max(x["busbw_Mbit"] for x in runs[v])],
                "correct": all(x["correct"] for x in runs[v]),
            }
        )
    for t in table:
        print(
            f"  {t['variant']:9s} {t['busbw_Mbit']:6.1f} Mbit/s ({t['busbw_range_Mbit'][0]:.1f}-"
            f"{t['busbw_range_Mbit'][1]:.1f})  x default {t['vs_default']:.3f}  x link {t['vs_link']:.3f}  "
            f"wire ceiling {t['wire_ceiling']:.3f}  ACKs/data {t['acks_per_data_packet']:.2f}"
        )
    summary = (
        f"wan_tuning: {args.rate} Mbit/s link, gloo all-reduce {size >> 20} MiB, median of {args.rounds}: "
        + ", ".join(f"{t['variant']} {t['vs_default']:.3f}" for t in table)
        + f" x default ({base:.1f} Mbit/s = {base / args.rate:.3f} x link) "
        f"[{time.monotonic() - t_start:.0f} s]"
    )
    write_result(
        args.name,
        {"rate_mbit": args.rate, "size": size, "rounds": args.rounds, "table": table, "runs": runs},
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
