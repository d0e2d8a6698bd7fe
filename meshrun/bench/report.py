"""`meshrun bench`: pairwise RTT / TCP bandwidth / path, then an all-reduce sweep, across the mesh.

`run` (meshrun.bench.run) launches ``python -m meshrun.bench.worker`` on every node through
`meshrun train`'s own machinery (a job submitted through meshrun.jobs.control: agents, torchrun, the
coordinator's rendezvous store, NCCL/Gloo pinned to the overlay), so the numbers describe the path
training takes. Rank 0 prints one result line; meshrun.bench.run picks it up and this module flags
slow pairs and renders it. Everything here except `plot` is pure.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from meshrun.errors import UsageError

SLOW_FRACTION = 0.5  # a pair below this fraction of the median bandwidth is flagged
DEFAULT_SIZES = "1M,4M,16M,64M"
DEFAULT_DURATION = 2.0
DEFAULT_STREAMS = 4
PROGRESS_MARKS = ("] pair ", "] all_reduce ", "meshrun: ")
RESULT_MARK = "MESHRUN_BENCH_RESULT "  # rank 0 of the bench job prints its result after this


def busbw(algbw: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw * 2(n-1)/n (0 for a single rank)."""
    if world < 1:
        raise ValueError("world size must be at least 1")
    return algbw * 2 * (world - 1) / world


def _parse_sizes(text: str) -> list[int]:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in text.split(","):
        p = part.strip().upper().removesuffix("IB").removesuffix("B")
        if not p:
            continue
        num, unit = (p[:-1], p[-1]) if p[-1] in units else (p, "")
        out.append(int(num) * units[unit])
    return out


def parse_sizes(text: str) -> list[int]:
    """``"1M,4M,64M"`` -> byte counts (K/M/G are binary; a trailing B or iB is allowed); UsageError else."""
    try:
        sizes = _parse_sizes(text)
    except (ValueError, IndexError):
        sizes = []
    if not sizes or any(s < 4 for s in sizes):
        raise UsageError(
            f"--sizes {text!r} is not a comma-separated list of sizes of at least 4 bytes", "e.g. --sizes 1M,4M,16M"
        )
    return sorted(set(sizes))


def human_size(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


def flag_slow(pairs: list[dict], fraction: float = SLOW_FRACTION) -> list[dict]:
    """Pairs whose bandwidth is below `fraction` of the median of all pairs (each gets "slow": True).

    Returns the flagged pairs, each with "fraction_of_median"; every pair dict gets "slow" set.
    A pair that failed (mbit_s 0 or missing) is always flagged when others worked.
    """
    rates = [float(p.get("mbit_s") or 0.0) for p in pairs]
    med = statistics.median(rates) if rates else 0.0
    flagged = []
    for p, r in zip(pairs, rates):
        p["slow"] = bool(med > 0 and r < fraction * med)
        if p["slow"]:
            flagged.append(
                {"src": p["src"], "dst": p["dst"], "mbit_s": r, "median_mbit_s": med, "fraction_of_median": r / med}
            )
    return flagged


def summarize(raw: dict, fraction: float = SLOW_FRACTION) -> dict:
    """The worker's raw result plus "flagged", "median_mbit_s" and "best_busbw_GBps" (JSON output)."""
    out = dict(raw)
    out["pairs"] = [dict(p) for p in raw.get("pairs", [])]
    out["flagged"] = flag_slow(out["pairs"], fraction)
    rates = [float(p.get("mbit_s") or 0.0) for p in out["pairs"]]
    out["median_mbit_s"] = statistics.median(rates) if rates else None
    results = raw.get("allreduce", {}).get("results", [])
    out["best_busbw_GBps"] = max((r["busbw_GBps"] for r in results), default=None)
    return out


def matrix(names: list[str], pairs: list[dict], key: str) -> list[list[float | str | None]]:
    """A names x names matrix of pair[key] (row = source, column = destination; None on the diagonal)."""
    idx = {n: i for i, n in enumerate(names)}
    m: list[list] = [[None] * len(names) for _ in names]
    for p in pairs:
        if p["src"] in idx and p["dst"] in idx:
            m[idx[p["src"]]][idx[p["dst"]]] = p.get(key)
    return m


def _table(title: str, names: list[str], cells: list[list[str]]) -> list[str]:
    w0 = max([len("from \\ to")] + [len(n) for n in names])
    widths = [max(len(n), *(len(row[j]) for row in cells)) for j, n in enumerate(names)]
    lines = [title, "  " + "from \\ to".ljust(w0) + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths))]
    for n, row in zip(names, cells):
        lines.append("  " + n.ljust(w0) + "  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
    return lines


def render(res: dict) -> str:
    """The terminal report: bandwidth, RTT and path matrices, the all-reduce table, flagged pairs."""
    names = [n["name"] for n in res.get("nodes", [])]
    pairs = res.get("pairs", [])
    lines: list[str] = []
    by_site = res.get("sites") or {}
    if by_site:
        lines += [
            f"sites: {len(by_site)} ("
            + "; ".join(f"{site}: {', '.join(nodes)}" for site, nodes in by_site.items())
            + ")"
            + (
                "" if res.get("hierarchical") or len(by_site) < 2 else " of different sizes: no hierarchical all-reduce"
            ),
            "",
        ]
    if pairs:
        st = res.get("settings", {})
        bw = matrix(names, pairs, "mbit_s")
        slow = {(p["src"], p["dst"]) for p in pairs if p.get("slow")}
        cells = [
            [
                "-"
                if i == j
                else (f"{bw[i][j]:.0f}" + ("!" if (a, b) in slow else "") if bw[i][j] is not None else "?")
                for j, b in enumerate(names)
            ]
            for i, a in enumerate(names)
        ]
        lines += _table(
            f"TCP bandwidth over the overlay, Mbit/s ({st.get('streams', '?')} stream(s), "
            f"{st.get('duration_s', '?')} s each; ! = below {SLOW_FRACTION:.0%} of the median)",
            names,
            cells,
        )
        rtt = matrix(names, pairs, "rtt_ms")
        cells = [
            ["-" if i == j else (f"{rtt[i][j]:.2f}" if rtt[i][j] is not None else "?") for j in range(len(names))]
            for i in range(len(names))
        ]
        lines += [""] + _table("round-trip time, ms (TCP, median of 10)", names, cells)
        path = matrix(names, pairs, "path")
        cells = [["-" if i == j else str(path[i][j] or "?") for j in range(len(names))] for i in range(len(names))]
        lines += [""] + _table("path", names, cells)
        site_bw = matrix(names, pairs, "site_mbit_s")
        if any(v is not None for row in site_bw for v in row):
            cells = [
                [
                    "-" if i == j else (f"{site_bw[i][j]:.0f}" if site_bw[i][j] is not None else "")
                    for j in range(len(names))
                ]
                for i in range(len(names))
            ]
            lines += [""] + _table("TCP bandwidth on the site network (pairs in one site), Mbit/s", names, cells)
    ar = res.get("allreduce", {})
    rows = ar.get("results", [])
    if rows:
        hier = any("hier_time_s" in r for r in rows)
        lines += [
            "",
            f"all-reduce ({ar.get('backend')}, {res.get('world_size')} ranks, sum float32"
            + ("; hier = reduce-scatter in each site, shards across sites, all-gather)" if hier else ")"),
            f"  {'size':>6} {'iters':>5} {'time(ms)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
            f"{'busbw(Mbit/s)':>14}" + (f" {'hier(ms)':>10} {'hier speedup':>12}" if hier else ""),
        ]
        for r in rows:
            extra = ""
            if "hier_time_s" in r:
                extra = f" {r['hier_time_s'] * 1e3:>10.2f} {r['time_s'] / r['hier_time_s']:>11.2f}x"
            wrong = not (r.get("correct", True) and r.get("hier_correct", True))
            lines.append(
                f"  {human_size(r['size']):>6} {r['iters']:>5} {r['time_s'] * 1e3:>10.2f} "
                f"{r['algbw_GBps']:>12.4f} {r['busbw_GBps']:>12.4f} {r['busbw_GBps'] * 8e3:>14.1f}"
                + extra
                + ("  WRONG RESULT" if wrong else "")
            )
    flagged = res.get("flagged", [])
    if flagged:
        lines.append("")
        for f in flagged:
            lines.append(
                f"SLOW PAIR: {f['src']} -> {f['dst']} {f['mbit_s']:.0f} Mbit/s is "
                f"{f['fraction_of_median']:.0%} of the median {f['median_mbit_s']:.0f} Mbit/s"
            )
    elif pairs:
        lines += [
            "",
            f"no slow pairs (all within {SLOW_FRACTION:.0%} of the median {res.get('median_mbit_s') or 0:.0f} Mbit/s)",
        ]
    for p in pairs:
        if p.get("error"):
            lines.append(f"FAILED PAIR: {p['src']} -> {p['dst']}: {p['error']}")
    return "\n".join(lines)


def require_matplotlib():
    """matplotlib.pyplot (Agg backend), or UsageError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed", "pip install meshrun[plot]") from None
    return plt


def figure(res: dict):
    """The heat-map figure: pair bandwidth and RTT matrices, relayed pairs hatched and labelled."""
    plt = require_matplotlib()
    from matplotlib.patches import Patch, Rectangle

    names = [n["name"] for n in res.get("nodes", [])]
    pairs = res.get("pairs", [])
    relayed = {(p["src"], p["dst"]) for p in pairs if p.get("path") == "relayed"}
    fig, axes = plt.subplots(1, 2, figsize=(4.5 + 2.4 * len(names), 2.5 + 1.1 * len(names)), layout="constrained")
    for ax, key, title, fmt, cmap in (
        (axes[0], "mbit_s", "TCP bandwidth (Mbit/s)", "{:.0f}", "viridis"),
        (axes[1], "rtt_ms", "RTT (ms)", "{:.2f}", "magma_r"),
    ):
        m = matrix(names, pairs, key)
        data = [[float("nan") if v is None else float(v) for v in row] for row in m]
        im = ax.imshow(data, cmap=cmap)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("to")
        ax.set_ylabel("from")
        ax.set_title(title)
        for i, row in enumerate(m):
            for j, v in enumerate(row):
                if v is None:
                    continue
                # Dark text on light cells, light on dark: readable on every colour of the map.
                r, g, b, _ = im.cmap(im.norm(v))
                color = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                is_relayed = (names[i], names[j]) in relayed
                ax.text(
                    j,
                    i,
                    fmt.format(v) + ("\nrelayed" if is_relayed else ""),
                    ha="center",
                    va="center",
                    color=color,
                    fontsize=8,
                )
                if is_relayed:
                    ax.add_patch(
                        Rectangle(
                            (j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor=color, linewidth=0, alpha=0.6
                        )
                    )
        fig.colorbar(im, ax=ax, shrink=0.8)
    if relayed:
        fig.legend(
            handles=[Patch(facecolor="white", edgecolor="gray", hatch="///", label="relayed through the coordinator")],
            loc="outside lower center",
        )
    best = res.get("best_busbw_GBps")
    if best is not None:
        fig.suptitle(f"meshrun bench: best all-reduce busbw {best:.3f} GB/s ({best * 8e3:.0f} Mbit/s)")
    return fig


def plot(res: dict, path: str | Path) -> Path:
    """Write `figure(res)` as a PNG; needs matplotlib."""
    plt = require_matplotlib()
    fig = figure(res)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- running it


def worker_args(
    sizes: str, duration: float, streams: int, iters: int, size_budget: float, pairs: bool = True
) -> list[str]:
    """The benchworker's argument list (validated)."""
    parse_sizes(sizes)
    if not 0.1 <= duration <= 30:
        raise UsageError(f"--duration {duration} is out of range", "use 0.1 to 30 seconds")
    if not 1 <= streams <= 64:
        raise UsageError(f"--streams {streams} is out of range", "use 1 to 64")
    if iters < 1:
        raise UsageError(f"--iters {iters} must be at least 1", "e.g. --iters 10")
    args = [
        "--sizes",
        sizes,
        "--duration",
        f"{duration:g}",
        "--streams",
        str(streams),
        "--iters",
        str(iters),
        "--size-budget",
        f"{size_budget:g}",
    ]
    return args + ([] if pairs else ["--no-pairs"])


def auto_duration(n_nodes: int, total_s: float = 20.0) -> float:
    """Seconds per ordered pair so that all n(n-1) pair tests take about `total_s` (0.5 to 2 s each)."""
    n_pairs = max(1, n_nodes * (n_nodes - 1))
    return max(0.5, min(DEFAULT_DURATION, total_s / n_pairs))
