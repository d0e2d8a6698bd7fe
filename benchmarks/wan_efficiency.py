"""How much of a WAN link does training over meshrun get? (issue: "the overlay costs almost nothing")

    sudo python benchmarks/wan_efficiency.py                       # 8, 64, 256 MiB; about 6 minutes
    sudo python benchmarks/wan_efficiency.py --sizes 8M,64M --rounds 1   # quick

A testbed world: coordinator + 2 nodes, each datacenter's internet link shaped to --rate Mbit/s
(tbf, both directions). Side by side in one run, alternating the order each round:
  - a 2-rank gloo all-reduce over the meshrun overlay (meshrun0, built by `meshrun init/join`),
  - the same over a minimal hand-built wireguard-go tunnel between the same two nodes (static keys
    from `wg genkey`, `wg set`, interface hand0, UDP 51830, 10.99.0.0/24, same MTU; nothing else),
  - iperf3 TCP over the overlay, over hand0, and over the underlay (public IPs).
busbw = algbw * 2(n-1)/n = size / time for 2 ranks: the bytes each rank sends per second, so
busbw / link rate is the fraction of the link training gets.
Targets: meshrun >= 0.98 x hand-built, and >= 0.87 x link rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HAND_IFACE = "hand0"
HAND_PORT = 51830
HAND_NET = "10.99.0"
ITERS = {8 << 20: 5, 64 << 20: 2, 256 << 20: 1}


# --------------------------------------------------------------------------- worker (runs in a node)


def worker(args) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = args.iface
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{args.port}",
        rank=args.rank,
        world_size=2,
        timeout=timedelta(seconds=300),
    )
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        buf = torch.ones(size // 4, dtype=torch.float32)
        dist.all_reduce(buf)  # warm-up (connections, buffers)
        ok = bool(torch.all(buf == 2).item())
        iters = ITERS.get(size, 2)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        el = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        sec = el.item()
        rows.append({"size": size, "iters": iters, "time_s": sec, "busbw_Bps": size / sec, "correct": ok})
    if args.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- driver


def allreduce(a, b, a_ip: str, iface: str, sizes: list[int], port: int) -> list[dict]:
    """2-rank gloo all-reduce between nodes a (rank 0, listening on a_ip) and b over `iface`."""
    me = str(Path(__file__).resolve())
    base = [
        sys.executable,
        me,
        "--worker",
        "--master",
        a_ip,
        "--port",
        str(port),
        "--iface",
        iface,
        "--sizes",
        ",".join(map(str, sizes)),
    ]
    from common import two_ranks

    out0, err0, _, err1 = two_ranks(a, b, base, 900)
    for line in out0.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"all-reduce over {iface} failed: {err0[-1500:]} {err1[-1500:]}")


def iperf(a, b, dst_ip: str, seconds: float, port: int = 5299) -> float:
    """iperf3 TCP a -> b (b's address dst_ip) for `seconds`; receiver's Mbit/s."""
    srv = b.popen("iperf3", "-s", "-1", "-p", str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):  # wait for the server to listen
            r = b.run("ss", "-ltn", f"sport = :{port}", check=False)
            if str(port) in r.stdout:
                break
            time.sleep(0.1)
        res = a.run("iperf3", "-c", dst_ip, "-p", str(port), "-t", f"{seconds:g}", "-J", timeout=seconds + 30)
        data = json.loads(res.stdout)
        return data["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()


def hand_tunnel(world, a, b, mtu: int, gomaxprocs: str | None) -> list:
    """The minimal hand-built wireguard-go tunnel a <-> b; returns the wireguard-go processes."""
    procs = []
    keys = {}
    for n in (a, b):
        n.workdir.mkdir(parents=True, exist_ok=True)
        priv = n.run("wg", "genkey").stdout.strip()
        (n.workdir / "hand.key").write_text(priv + "\n")
        os.chmod(n.workdir / "hand.key", 0o600)
        keys[n.name] = n.run("wg", "pubkey", input=priv + "\n").stdout.strip()
    for i, n in enumerate((a, b), start=1):
        env = {"GOMAXPROCS": gomaxprocs} if gomaxprocs else None
        procs.append(
            n.popen("wireguard-go", "-f", HAND_IFACE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    for i, (n, peer) in enumerate(((a, b), (b, a)), start=1):
        for _ in range(100):
            if n.run("wg", "show", HAND_IFACE, check=False).returncode == 0:
                break
            time.sleep(0.05)
        n.run(
            "wg",
            "set",
            HAND_IFACE,
            "listen-port",
            str(HAND_PORT),
            "private-key",
            str(n.workdir / "hand.key"),
            "peer",
            keys[peer.name],
            "endpoint",
            f"{peer.public_ip}:{HAND_PORT}",
            "allowed-ips",
            f"{HAND_NET}.{2 if i == 1 else 1}/32",
            "persistent-keepalive",
            "25",
        )
        n.run("ip", "addr", "add", f"{HAND_NET}.{i}/24", "dev", HAND_IFACE)
        n.run("ip", "link", "set", HAND_IFACE, "mtu", str(mtu), "up")
    return procs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--iface", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="8M,64M,256M")
    ap.add_argument("--rate", type=int, default=200, help="link rate, Mbit/s")
    ap.add_argument("--rounds", type=int, default=3, help="alternating meshrun/hand rounds")
    ap.add_argument("--iperf-seconds", type=float, default=5)
    ap.add_argument("--hand-mtu", type=int, default=1420)
    ap.add_argument("--gomaxprocs", help="GOMAXPROCS for every wireguard-go (meshrun's and hand-built)")
    ap.add_argument("--congctl", help="TCP congestion control over both tunnels (route attribute) [host default]")
    ap.add_argument("--name", default="wan_efficiency", help="results file name")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from common import mesh_world, need_root, set_congctl, verdict, write_result

    from meshrun.bench.worker import parse_sizes

    need_root()
    sizes = (
        parse_sizes(args.sizes)
        if not args.sizes.replace(",", "").isdigit()
        else [int(s) for s in args.sizes.split(",")]
    )
    if args.gomaxprocs:
        os.environ["GOMAXPROCS"] = args.gomaxprocs  # inherited by meshrun's wireguard-go via `meshrun join`
    t_start = time.monotonic()
    with mesh_world(2, "wan", rate_mbit=args.rate) as (world, mesh, names):
        a, b = world.node(names[0]), world.node(names[1])
        ov_a, ov_b = mesh.overlay_ip(a), mesh.overlay_ip(b)
        mesh.wait_ping(a, ov_b)
        procs = hand_tunnel(world, a, b, args.hand_mtu, args.gomaxprocs)
        try:
            mesh.wait_ping(a, f"{HAND_NET}.2")
            if args.congctl:
                for n in (a, b):
                    for dev in ("meshrun0", HAND_IFACE):
                        set_congctl(n, dev, args.congctl)
            mtu = mesh.status(a)["mtu"]
            runs = {"meshrun": [], "hand": []}
            tcp = {"meshrun": [], "hand": [], "underlay": []}
            port = 29600
            for r in range(args.rounds):
                order = ["meshrun", "hand"] if r % 2 == 0 else ["hand", "meshrun"]
                for kind in order:
                    port += 1
                    ip, iface = (ov_a, "meshrun0") if kind == "meshrun" else (f"{HAND_NET}.1", HAND_IFACE)
                    runs[kind].append(allreduce(a, b, ip, iface, sizes, port))
                    print(
                        f"round {r + 1} {kind:8s} "
                        + "  ".join(
                            f"{x['size'] >> 20}M {x['busbw_Bps'] * 8 / 1e6:.1f} Mbit/s" for x in runs[kind][-1]
                        ),
                        flush=True,
                    )
                for kind, dst in ((order[0], None), (order[1], None), ("underlay", None)):
                    dst = {"meshrun": ov_b, "hand": f"{HAND_NET}.2", "underlay": b.public_ip}[kind]
                    tcp[kind].append(iperf(a, b, dst, args.iperf_seconds))
                    print(f"round {r + 1} iperf3 {kind:8s} {tcp[kind][-1]:.1f} Mbit/s", flush=True)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for n in (a, b):
                n.run("ip", "link", "del", HAND_IFACE, check=False)
                (n.workdir / "hand.key").unlink(missing_ok=True)

    link_Bps = args.rate * 1e6 / 8
    per_size = []
    for i, size in enumerate(sizes):
        m = statistics.median(run[i]["busbw_Bps"] for run in runs["meshrun"])
        h = statistics.median(run[i]["busbw_Bps"] for run in runs["hand"])
        per_size.append(
            {
                "size": size,
                "meshrun_busbw_Mbit": m * 8 / 1e6,
                "hand_busbw_Mbit": h * 8 / 1e6,
                "meshrun_vs_hand": m / h,
                "meshrun_vs_link": m / link_Bps,
                "hand_vs_link": h / link_Bps,
                "correct": all(run[i]["correct"] for k in runs for run in runs[k]),
            }
        )
    tcp_med = {k: statistics.median(v) for k, v in tcp.items()}
    big = per_size[-1]
    vs_hand = min(p["meshrun_vs_hand"] for p in per_size)
    vs_link = big["meshrun_vs_link"]
    ok_hand, ok_link = vs_hand >= 0.98, vs_link >= 0.87
    cc = f" (congctl {args.congctl})" if args.congctl else ""
    summary = (
        f"wan_efficiency: {args.rate} Mbit/s link{cc}, gloo all-reduce {big['size'] >> 20} MiB: meshrun "
        f"{big['meshrun_busbw_Mbit']:.1f} Mbit/s busbw = {vs_link:.3f} x link ({verdict(ok_link)} >= 0.87); "
        f"meshrun/hand-built worst over sizes {vs_hand:.3f} ({verdict(ok_hand)} >= 0.98); iperf3 overlay "
        f"{tcp_med['meshrun']:.0f} / hand {tcp_med['hand']:.0f} / underlay {tcp_med['underlay']:.0f} Mbit/s "
        f"[{time.monotonic() - t_start:.0f} s]"
    )
    for p in per_size:
        print(
            f"  {p['size'] >> 20:>4} MiB: meshrun {p['meshrun_busbw_Mbit']:.1f}  hand {p['hand_busbw_Mbit']:.1f} "
            f"Mbit/s  meshrun/hand {p['meshrun_vs_hand']:.3f}  meshrun/link {p['meshrun_vs_link']:.3f}  "
            f"hand/link {p['hand_vs_link']:.3f}"
        )
    write_result(
        args.name,
        {
            "rate_mbit": args.rate,
            "overlay_mtu": mtu,
            "hand_mtu": args.hand_mtu,
            "gomaxprocs": args.gomaxprocs,
            "congctl": args.congctl,
            "rounds": args.rounds,
            "per_size": per_size,
            "iperf3_mbit": tcp_med,
            "iperf3_runs": tcp,
            "allreduce_runs": runs,
            "targets": {"meshrun_vs_hand": 0.98, "meshrun_vs_link": 0.87},
            "met": {"meshrun_vs_hand": ok_hand, "meshrun_vs_link": ok_link},
        },
        summary,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
