"""Runs inside every torchrun worker of `meshrun bench`: pairwise TCP tests, then an all-reduce sweep.

    python -m meshrun.bench.worker --sizes 1M,4M,16M --duration 2 --streams 4

Launched by `meshrun bench` through the same machinery as `meshrun train` (agents, torchrun,
the coordinator's rendezvous store), so it measures exactly the path a training job uses.

1. Every node's first worker (LOCAL_RANK 0) opens a TCP server on its overlay IP; the
   addresses are exchanged with ``all_gather_object`` over a gloo group.
2. Ordered pairs run one at a time (barriers between them, so tests never overlap): the source
   measures the round-trip time (1-byte TCP ping-pong) and pushes data for ``--duration``
   seconds over ``--streams`` parallel connections; the receiver reports bytes and seconds.
3. Every rank takes part in an in-place all-reduce (sum, float32) per size: gloo on CPU,
   NCCL on GPU. A size whose first all-reduce takes longer than ``--size-budget`` seconds
   is the last one run (so the whole benchmark stays bounded on slow links).

Rank 0 prints one line ``MESHRUN_BENCH_RESULT {json}`` that `meshrun bench` picks up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

RESULT_MARK = "MESHRUN_BENCH_RESULT "
CHUNK = 256 * 1024
PINGS = 10


# --------------------------------------------------------------------------- TCP tests (stdlib only)

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection")
        buf += part
    return buf


class PairServer:
    """TCP server for the pair tests: 'P' echoes 1-byte pings, 'S' sinks data and reports bytes/seconds."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mode = _recv_exact(conn, 1)
            if mode == b"P":
                while True:
                    b = conn.recv(1)
                    if not b:
                        return
                    conn.sendall(b)
            elif mode == b"S":
                total, first, last = 0, None, None
                while True:
                    n = conn.recv_into(memoryview(bytearray(CHUNK)))
                    if not n:
                        break
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    total += n
                secs = (last - first) if first is not None and last is not None else 0.0
                conn.sendall(struct.pack("!Qd", total, secs))
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stopped = True
        self.sock.close()


def tcp_rtt_ms(host: str, port: int, count: int = PINGS, timeout: float = 10) -> float:
    """Median round trip of a 1-byte TCP ping-pong, in milliseconds (first exchange not counted)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"P")
        times = []
        for _ in range(count + 1):
            t0 = time.perf_counter()
            s.sendall(b"x")
            _recv_exact(s, 1)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def tcp_bandwidth(host: str, port: int, duration: float, streams: int = 1, timeout: float = 30) -> dict:
    """Push data to host:port over `streams` connections for `duration` s; the receiver's view.

    Returns {"bytes", "seconds", "mbit_s"}: total bytes over the longest receiving time.
    """
    payload = b"\0" * CHUNK
    results: list[tuple[int, float]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(streams)

    def one() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout) as s:
                s.sendall(b"S")
                start.wait()
                end = time.perf_counter() + duration
                while time.perf_counter() < end:
                    s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                total, secs = struct.unpack("!Qd", _recv_exact(s, 16))
                results.append((total, secs))
        except (OSError, threading.BrokenBarrierError) as exc:
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    total = sum(r[0] for r in results)
    secs = max(r[1] for r in results) or 1e-9
    return {"bytes": total, "seconds": secs, "mbit_s": total * 8 / secs / 1e6}


# --------------------------------------------------------------------------- where this node is

def overlay_ip(interface: str) -> str:
    """This node's address on `interface` (the overlay), from `ip -4 -o addr show`."""
    import subprocess
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", interface], capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            return parts[parts.index("inet") + 1].split("/")[0]
    raise RuntimeError(f"interface {interface} has no IPv4 address; is this node on the overlay?")


def peer_paths() -> dict[str, str]:
    """{peer name: "direct" | "relayed" ...} from this node's `meshrun status` (missing field: direct)."""
    job_dir = os.environ.get("MESHRUN_JOB_DIR")
    if not job_dir:
        return {}
    try:
        from meshrun.mesh import status
        from meshrun.system.store import StateDir
        st = status.gather(StateDir(Path(job_dir).parents[1]))     # <state>/jobs/<id>
    except Exception:
        return {}
    return {p.get("name"): str(p.get("path") or "direct") for p in st.get("peers", [])}


# --------------------------------------------------------------------------- the run

def parse_sizes(text: str) -> list[int]:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in text.split(","):
        p = part.strip().upper().removesuffix("IB").removesuffix("B")
        if not p:
            continue
        num, unit = (p[:-1], p[-1]) if p[-1] in units else (p, "")
        out.append(int(num) * units[unit])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshrun.bench.worker")
    ap.add_argument("--sizes", default="1M,4M,16M")
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--size-budget", type=float, default=4.0)
    ap.add_argument("--no-pairs", action="store_true")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from datetime import timedelta

    t_start = time.perf_counter()
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=120))
    ctl = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "meshrun0")
    node = os.environ.get("MESHRUN_NODE_NAME") or socket.gethostname()

    leader = local_rank == 0
    server = PairServer(overlay_ip(iface)) if leader and not args.no_pairs else None
    me = {"rank": rank, "node": node, "leader": leader,
          "overlay_ip": overlay_ip(iface) if leader else None, "port": server.port if server else None,
          "paths": peer_paths() if leader else {}}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, me, group=ctl)
    leaders = [e for e in everyone if e["leader"]]
    t_setup = time.perf_counter() - t_start

    pairs = []
    if not args.no_pairs:
        for src in leaders:
            for dst in leaders:
                if src is dst:
                    continue
                row = None
                if rank == src["rank"]:
                    row = {"src": src["node"], "dst": dst["node"], "path": src["paths"].get(dst["node"], "direct")}
                    try:
                        row["rtt_ms"] = tcp_rtt_ms(dst["overlay_ip"], dst["port"])
                        bw = tcp_bandwidth(dst["overlay_ip"], dst["port"], args.duration, args.streams)
                        row["mbit_s"] = bw["mbit_s"]
                        row["bytes"] = bw["bytes"]
                    except (OSError, ConnectionError) as exc:
                        row.update(rtt_ms=None, mbit_s=0.0, bytes=0, error=str(exc))
                    print(f"pair {row['src']} -> {row['dst']}: rtt {row['rtt_ms'] or 0:.2f} ms, "
                          f"{row['mbit_s']:.1f} Mbit/s", flush=True)
                got: list = [None] * world
                dist.all_gather_object(got, row, group=ctl)
                pairs.append(got[src["rank"]])
    t_pairs = time.perf_counter() - t_start - t_setup
    if server:
        server.close()

    def sync():
        if use_cuda:
            torch.cuda.synchronize(device)

    rows = []
    for size in parse_sizes(args.sizes):
        count = max(1, size // 4)
        buf = torch.ones(count, dtype=torch.float32, device=device)
        t0 = time.perf_counter()
        dist.all_reduce(buf)                     # warm-up and correctness check: every element == world
        sync()
        first = torch.tensor([time.perf_counter() - t0, 0.0 if bool(torch.all(buf == world).item()) else 1.0],
                             dtype=torch.float64, device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MAX)
        first_s, ok = first[0].item(), first[1].item() == 0.0
        # As many timed iterations as fit in the budget (at least 1, at most --iters); same on every rank.
        iters = int(max(1, min(args.iters, args.size_budget // max(first_s, 1e-6))))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        el = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        sec = el[0].item()
        algbw = size / sec / 1e9
        rows.append({"size": size, "iters": iters, "time_s": sec, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (world - 1) / world, "correct": ok})
        if rank == 0:
            print(f"all_reduce {size} B: {sec * 1e3:.1f} ms, busbw {rows[-1]['busbw_GBps']:.4f} GB/s", flush=True)
        del buf
        if first_s > args.size_budget:
            break
    t_ar = time.perf_counter() - t_start - t_setup - t_pairs
    if rank == 0:
        out = {"nodes": [{"name": e["node"], "overlay_ip": e["overlay_ip"]} for e in leaders],
               "world_size": world, "pairs": pairs,
               "allreduce": {"backend": backend, "dtype": "float32", "op": "sum", "results": rows},
               "settings": {"duration_s": args.duration, "streams": args.streams, "sizes": parse_sizes(args.sizes),
                            "iters": args.iters, "size_budget_s": args.size_budget},
               "timings_s": {"setup": round(t_setup, 3), "pairs": round(t_pairs, 3), "allreduce": round(t_ar, 3)}}
        print(RESULT_MARK + json.dumps(out), flush=True)
    dist.barrier(group=ctl)
    dist.destroy_process_group()
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
