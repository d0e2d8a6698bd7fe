"""Pure parts of `meshrun bench`: busbw math, slow-pair flagging, matrix rendering, JSON shape, options."""

from __future__ import annotations

import json

import pytest

from meshrun.bench import report as bench
from meshrun.bench.run import _Capture
from meshrun.errors import UsageError
from meshrun.system.sockets.tcpbench import PairServer, tcp_bandwidth, tcp_rtt_ms


def _raw(rates=None):
    names = ["gpu-a", "gpu-b", "gpu-c"]
    rates = rates or {}
    pairs = [
        {
            "src": s,
            "dst": d,
            "path": "relayed" if {s, d} == {"gpu-a", "gpu-c"} else "direct",
            "rtt_ms": 1.5,
            "mbit_s": rates.get((s, d), 900.0),
            "bytes": 1,
        }
        for s in names
        for d in names
        if s != d
    ]
    return {
        "nodes": [{"name": n, "overlay_ip": f"10.213.0.{i + 2}"} for i, n in enumerate(names)],
        "world_size": 3,
        "pairs": pairs,
        "allreduce": {
            "backend": "gloo",
            "dtype": "float32",
            "op": "sum",
            "results": [
                {
                    "size": 1 << 20,
                    "iters": 10,
                    "time_s": 0.01,
                    "algbw_GBps": 0.1048576,
                    "busbw_GBps": bench.busbw(0.1048576, 3),
                    "correct": True,
                }
            ],
        },
        "settings": {"duration_s": 2.0, "streams": 4, "sizes": [1 << 20]},
    }


@pytest.mark.parametrize("world, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_busbw_is_algbw_times_2_n_minus_1_over_n(world, factor):
    assert bench.busbw(10.0, world) == pytest.approx(10.0 * factor)


def test_busbw_rejects_empty_world():
    with pytest.raises(ValueError):
        bench.busbw(1.0, 0)


def test_flag_slow_marks_pairs_under_half_the_median():
    res = bench.summarize(_raw({("gpu-b", "gpu-c"): 300.0, ("gpu-c", "gpu-a"): 460.0}))
    assert [(f["src"], f["dst"]) for f in res["flagged"]] == [("gpu-b", "gpu-c")]
    assert res["flagged"][0]["fraction_of_median"] == pytest.approx(300 / 900)
    assert res["median_mbit_s"] == 900.0
    slow = {(p["src"], p["dst"]) for p in res["pairs"] if p["slow"]}
    assert slow == {("gpu-b", "gpu-c")}


def test_flag_slow_flags_failed_pair_and_nothing_when_all_equal():
    assert bench.flag_slow([{"src": "a", "dst": "b", "mbit_s": 5.0}, {"src": "b", "dst": "a", "mbit_s": 5.0}]) == []
    pairs = [
        {"src": "a", "dst": "b", "mbit_s": 100.0},
        {"src": "b", "dst": "a", "mbit_s": 0.0},
        {"src": "a", "dst": "c", "mbit_s": 100.0},
    ]
    assert [f["dst"] for f in bench.flag_slow(pairs)] == ["a"]
    assert bench.flag_slow([]) == []


def test_summary_is_json_with_the_documented_shape():
    res = json.loads(json.dumps(bench.summarize(_raw())))
    assert {
        "nodes",
        "pairs",
        "allreduce",
        "flagged",
        "median_mbit_s",
        "best_busbw_GBps",
        "settings",
        "world_size",
    } <= set(res)
    assert len(res["pairs"]) == 6
    for p in res["pairs"]:
        assert {"src", "dst", "path", "rtt_ms", "mbit_s", "slow"} <= set(p)
    assert res["best_busbw_GBps"] == pytest.approx(0.1048576 * 4 / 3)


def test_matrix_rows_are_sources_columns_destinations():
    raw = _raw({("gpu-a", "gpu-b"): 111.0, ("gpu-b", "gpu-a"): 222.0})
    m = bench.matrix(["gpu-a", "gpu-b", "gpu-c"], raw["pairs"], "mbit_s")
    assert m[0][0] is None and m[0][1] == 111.0 and m[1][0] == 222.0


def test_render_shows_matrices_paths_allreduce_and_slow_pairs():
    text = bench.render(bench.summarize(_raw({("gpu-b", "gpu-c"): 300.0})))
    lines = text.splitlines()
    assert lines[0].startswith("TCP bandwidth over the overlay, Mbit/s (4 stream(s), 2.0 s each")
    assert lines[1].split() == ["from", "\\", "to", "gpu-a", "gpu-b", "gpu-c"]
    assert lines[2].split() == ["gpu-a", "-", "900", "900"]
    assert lines[3].split() == ["gpu-b", "900", "-", "300!"]
    assert "relayed" in text and "direct" in text
    assert "   1M    10      10.00       0.1049       0.1398" in text
    assert "SLOW PAIR: gpu-b -> gpu-c 300 Mbit/s is 33% of the median 900 Mbit/s" in text


def test_render_says_when_no_pair_is_slow_and_reports_failures():
    raw = _raw()
    raw["pairs"][0].update(error="connection refused")
    text = bench.render(bench.summarize(raw))
    assert "no slow pairs (all within 50% of the median 900 Mbit/s)" in text
    assert "FAILED PAIR: gpu-a -> gpu-b: connection refused" in text


def test_parse_sizes_and_errors():
    assert bench.parse_sizes("4M,1M,1MiB,16K") == [16 << 10, 1 << 20, 4 << 20]
    assert bench.parse_sizes("1G") == [1 << 30]
    for bad in ("", "x", "1Q", "2"):
        with pytest.raises(UsageError):
            bench.parse_sizes(bad)


def test_worker_args_validates_options():
    args = bench.worker_args("1M,4M", 1.5, 2, 5, 3.0)
    assert args == ["--sizes", "1M,4M", "--duration", "1.5", "--streams", "2", "--iters", "5", "--size-budget", "3"]
    with pytest.raises(UsageError, match="--duration"):
        bench.worker_args("1M", 0, 2, 5, 3.0)
    with pytest.raises(UsageError, match="--streams"):
        bench.worker_args("1M", 1, 0, 5, 3.0)


def test_auto_duration_keeps_pair_tests_bounded():
    assert bench.auto_duration(2) == 2.0
    assert bench.auto_duration(4) == pytest.approx(20 / 12)
    assert bench.auto_duration(16) == 0.5


def test_capture_picks_the_result_line():
    cap = _Capture()
    cap.line("[gpu-a r0] pair gpu-a -> gpu-b: rtt 0.1 ms")
    cap.line('[gpu-a r0] MESHRUN_BENCH_RESULT {"pairs": []}')
    assert cap.result == {"pairs": []} and cap.lines == ["[gpu-a r0] pair gpu-a -> gpu-b: rtt 0.1 ms"]


def test_plot_error_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(UsageError) as ei:
        bench.plot(_raw(), "/nonexistent/x.png")
    assert "pip install meshrun[plot]" in ei.value.fix


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = bench.plot(bench.summarize(_raw()), tmp_path / "m.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pair_tests_on_loopback():
    srv = PairServer("127.0.0.1")
    try:
        assert 0 < tcp_rtt_ms("127.0.0.1", srv.port, count=3) < 1000
        bw = tcp_bandwidth("127.0.0.1", srv.port, 0.2, streams=2)
        assert bw["bytes"] > 0 and bw["mbit_s"] > 0
    finally:
        srv.close()


def test_heat_map_marks_relayed_pairs_and_keeps_every_label_inside():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig = bench.figure(bench.summarize(_raw({("gpu-b", "gpu-c"): 300.0})))
    try:
        fig.canvas.draw()
        box = fig.bbox
        renderer = fig.canvas.get_renderer()
        texts = [
            t
            for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent"))
            if t.get_text().strip() and t.get_visible()
        ]
        assert {"to", "from", "gpu-a", "relayed through the coordinator"} <= {t.get_text() for t in texts}
        for t in texts:
            ext = t.get_window_extent(renderer)
            assert box.x0 <= ext.x0 and ext.x1 <= box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1, t.get_text()
        for ax in fig.axes[:2]:  # both matrices: the a<->c pair (relayed) is hatched, the others are not
            hatched = sorted(
                (round(p.get_x() + 0.5), round(p.get_y() + 0.5))
                for p in ax.patches
                if isinstance(p, Rectangle) and p.get_hatch()
            )
            assert hatched == [(0, 2), (2, 0)]
            assert sum("relayed" in t.get_text() for t in ax.texts) == 2
    finally:
        plt.close(fig)


def test_render_shows_the_sites_the_site_network_and_the_hierarchical_all_reduce():
    raw = _raw()
    raw["sites"] = {"fra": ["gpu-a", "gpu-b"], "gpu-c": ["gpu-c"]}
    raw["hierarchical"] = False
    for p in raw["pairs"]:
        if {p["src"], p["dst"]} == {"gpu-a", "gpu-b"}:
            p.update(scope="site", site_mbit_s=9400.0, site_rtt_ms=0.1)
    raw["allreduce"]["results"][0].update(hier_time_s=0.004, hier_correct=True)
    text = bench.render(bench.summarize(raw))
    assert text.splitlines()[0] == (
        "sites: 2 (fra: gpu-a, gpu-b; gpu-c: gpu-c) of different sizes: no hierarchical all-reduce"
    )
    site = text[text.index("TCP bandwidth on the site network") :].splitlines()
    assert site[2].split() == ["gpu-a", "-", "9400"] and site[3].split() == ["gpu-b", "9400", "-"]
    assert "hier(ms) hier speedup" in text and "4.00        2.50x" in text
    raw["allreduce"]["results"][0]["hier_correct"] = False
    assert "WRONG RESULT" in bench.render(bench.summarize(raw))
