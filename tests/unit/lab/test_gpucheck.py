"""meshrun.lab.gpucheck: which backend and GPUs the check uses, and its reading of a job's output (NCCL's
transport lines, by the group they came after)."""

from __future__ import annotations

import dataclasses
import subprocess

from meshrun.lab.gpucheck import (
    SETTINGS,
    BenchJob,
    BenchTable,
    bench_jobs,
    bench_result,
    check_plan,
    main,
    nccl_net_lines,
    report_check,
    summarize,
)

NODES = ["s1-a", "s1-b", "s2-a", "s2-b"]


def test_one_gpu_runs_nccl_with_every_node_on_it_as_a_host_of_its_own():
    plan = check_plan(1, NODES)
    assert plan.backend == "nccl" and plan.gpu_of == dict.fromkeys(NODES, 0)
    assert "4 nodes share 1 GPU(s)" in plan.message and "NCCL_HOSTID" in plan.message
    args = plan.train_args()
    assert args[args.index("--nproc-per-node") + 1] == "1"  # a node reports the machine's GPUs: not one rank each
    assert args[args.index("nccl_check.py") :] == [
        "nccl_check.py",
        "--gpu-map",
        "s1-a=0,s1-b=0,s2-a=0,s2-b=0",
        "--hostid-per-node",
    ]
    assert "CUDA_VISIBLE_DEVICES=" not in args
    assert args[args.index("--workers") + 1] == "warm"  # meshrun train's default, said outright
    cold = dataclasses.replace(plan, workers="cold").train_args()
    assert cold[cold.index("--workers") + 1] == "cold"


def test_a_failed_check_shows_what_its_ranks_said_last_without_nccls_log():
    """The job's own error, not only torchrun's summary: the ranks' last lines, NCCL's INFO lines left out."""
    ranks = [f"[s1-a r0] line {i}" for i in range(60)] + ["[s1-a r0] RuntimeError: Cannot re-initialize CUDA"]
    noise = [f"[s1-b r1] host:1:1 [0] NCCL INFO Bootstrap {i}" for i in range(200)]
    agent = [f"[s2-a] torchrun summary {i}" for i in range(50)]
    res = subprocess.CompletedProcess([], 1, "\n".join(ranks + noise + agent), "meshrun: job x failed\n")
    said: list[str] = []
    report_check(res, said.append)
    text = "\n".join(said)
    assert "RuntimeError: Cannot re-initialize CUDA" in text and "line 59" in text and "line 0\n" not in text
    assert "NCCL INFO" not in text and "meshrun: job x failed" in text
    assert said[-1] == "groups check FAILED (exit 1)"


def test_several_gpus_are_dealt_round_robin_and_hosts_stay_apart():
    assert check_plan(3, NODES).gpu_of == {"s1-a": 0, "s1-b": 1, "s2-a": 2, "s2-b": 0}
    four = check_plan(4, NODES)
    assert four.gpu_of == {"s1-a": 0, "s1-b": 1, "s2-a": 2, "s2-b": 3} and four.message == ""
    assert "--hostid-per-node" in four.train_args()  # else NCCL would use NVLink/SHM, not the overlay


def test_no_gpu_falls_back_to_gloo_and_says_nccl_was_not_exercised():
    plan = check_plan(0, NODES)
    assert plan.backend == "gloo" and plan.gpu_of == {}
    assert "no GPU" in plan.message and "NCCL is NOT exercised" in plan.message
    args = plan.train_args()
    assert "CUDA_VISIBLE_DEVICES=" in args and args[-1] == "nccl_check.py"


OUTPUT = """\
[s1-a r0] backend=nccl device=cuda:0 interface=meshrun0
[s1-a r0] == world group ==
[s1-a r0] s1-a:123:456 [0] NCCL INFO NET/Socket : Using [0]meshrun0:10.213.0.2<0>
[s1-a r0] s1-a:123:456 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via NET/Socket/0
[s2-a r2] == world group ==
[s2-a r2] s2-a:125:458 [2] NCCL INFO Channel 00/0 : 2[2] -> 3[3] via NET/Socket/0
[s1-a r0] world group: ok
[s1-a r0] == site group ==
[s1-a r0] s1-a:123:460 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
[s1-a r0] some other NCCL INFO line that says nothing of transports
[s2-a r2] == site group ==
[s2-a r2] s2-a:125:461 [2] NCCL INFO Channel 00/0 : 2[2] -> 3[3] via P2P/IPC
meshrun: job gpu finished on 4 node(s)
NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
"""


def test_nccl_lines_are_grouped_by_the_marker_each_rank_printed_before_them():
    seen = summarize(OUTPUT)
    assert seen == {
        "world group": {"NET/Socket : Using [0]meshrun0:10.213.0.2<0>", "Channel 00/0 : a -> b via NET/Socket/0"},
        "site group": {"Channel 00/0 : a -> b via P2P/IPC"},
    }


def test_gloo_output_has_no_transport_lines():
    assert summarize("[s1-a r0] == world group ==\n[s1-a r0] world group: ok\n") == {}


def test_the_bench_measures_the_raw_lan_then_meshrun0_at_every_socket_setting_on_nccl():
    jobs = bench_jobs(check_plan(1, NODES))
    assert [j.label for j in jobs] == ["lan default"] + [f"meshrun0 {s}" for s in SETTINGS]
    assert SETTINGS == ("default", "1x1", "2x8", "4x4", "8x2")
    lan, overlay = jobs[0], jobs[-1]
    args = lan.train_args(check_plan(1, NODES), 256, 2)
    # The data path on the site network: NCCL (exact name) and gloo pinned to eth0 through --env, which wins
    # over what `meshrun train` sets; the pair is one site's.
    assert args[:6] == ["--nodes", "s1-a,s1-b", "--env", "NCCL_SOCKET_IFNAME==eth0", "--env", "GLOO_SOCKET_IFNAME=eth0"]
    assert "NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH" in args
    script = args[args.index("nccl_bench.py") :]
    assert script[-8:] == ["--sockets", "default", "--mib", "256", "--rounds", "2", "--pairs", "same"]
    assert "--hostid-per-node" in script
    args = overlay.train_args(check_plan(1, NODES), 256, 2)
    assert args[:2] == ["--nodes", "s1-a,s1-b,s2-a"] and "NCCL_SOCKET_IFNAME==eth0" not in args
    assert args[-7:] == ["8x2", "--mib", "256", "--rounds", "2", "--pairs", "same,cross"]
    assert overlay.train_args(check_plan(1, NODES), 256, 2, backward=True)[-1] == "cross,same"


def test_with_a_trusted_site_the_bench_also_measures_its_pair_on_the_site_lan_path():
    jobs = bench_jobs(check_plan(1, NODES), ("default",), lan_path=True)
    assert [j.label for j in jobs] == ["lan default", "meshrun0 default", "lanpath default"]
    args = jobs[-1].train_args(check_plan(1, NODES), 256, 2)
    # Nothing pins it off the overlay: meshrun0's address, the trusted site's routes take it onto the LAN path.
    assert args[:2] == ["--nodes", "s2-a,s2-b"] and "NCCL_SOCKET_IFNAME==eth0" not in args
    assert args[-2:] == ["--pairs", "same"]


def test_on_gloo_the_bench_has_one_setting_per_path():
    jobs = bench_jobs(check_plan(0, NODES))
    assert [j.label for j in jobs] == ["lan default", "meshrun0 default"]
    args = jobs[1].train_args(check_plan(0, NODES), 16, 1)
    assert "CUDA_VISIBLE_DEVICES=" in args and "--gpu-map" not in args


BENCH_OUT = (
    """\
[s1-a r0] s1-a:1:2 [0] NCCL INFO NET/Socket : Using [0]meshrun0:10.213.0.2<0>
[s1-a r0] s1-a:1:2 [0] NCCL INFO NET/Socket : Using 2 threads and 8 sockets per thread
[s1-b r1] s1-b:3:4 [0] NCCL INFO NET/Socket : Using 2 threads and 8 sockets per thread
[s1-a r0] s1-a:1:2 [0] NCCL INFO Pattern 4, crossNic 0, nChannels 2, bw 1.200000/1.200000, type LOC/PIX
[s1-a r0] s1-a:1:2 [0] NCCL INFO comm 0x55d0a1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0
[s1-a r0] s1-a:1:2 [0] NCCL INFO cudaDriverVersion 13000
[s1-a r0] NCCL_BENCH {"ifname": "meshrun0", "nodes": [{"node": "s1-a", "speed": "10"}], """
    """"pairs": {"same": {"rounds": [0.3, 0.32]}, "cross": {"rounds": [0.25]}}}
"""
)


def test_a_bench_job_s_result_and_nccl_s_lines_about_the_network_fill_the_table():
    result = bench_result(BENCH_OUT)
    assert result is not None and result["pairs"]["same"]["rounds"] == [0.3, 0.32]
    lines = nccl_net_lines(BENCH_OUT)
    assert lines == [
        "NET/Socket : Using [0]meshrun0:10.213.0.2<0>",
        "NET/Socket : Using 2 threads and 8 sockets per thread",
        "Pattern 4, crossNic 0, nChannels 2, bw 1.200000/1.200000, type LOC/PIX",
        "comm 0x.. rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0",
    ]
    table = BenchTable("nccl", 256, {"gpu": "H200"})
    job = BenchJob("meshrun0", "2x8", ("s1-a", "s1-b", "s2-a"))
    table.add(job, result, BENCH_OUT, 0, 0, 12.0)
    table.add(job, {"pairs": {"same": {"rounds": [0.34]}}}, "", 0, 1, 11.0)
    table.add(BenchJob("lan", "default", ("s1-a", "s1-b")), None, "boom", 1, 1, 5.0)
    data = table.as_json()
    assert data["cells"]["meshrun0 same-site 2x8"] == {
        "min": 0.3,
        "median": 0.32,
        "max": 0.34,
        "n": 3,
        "rounds": [0.3, 0.32, 0.34],
    }
    assert data["cells"]["meshrun0 cross-site 2x8"]["n"] == 1
    assert data["iface_speed_mbps"] == {"meshrun0": "10"}
    assert data["failures"] == ["pass 1: lan default: exit 1, no result"]
    assert data["nccl_lines"]["meshrun0 2x8"] == lines and data["environment"] == {"gpu": "H200"}
    assert any(row.startswith("meshrun0 same-site 2x8") for row in table.rows())


def test_a_socket_setting_is_default_or_threads_x_sockets(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--settings", "default,four"])
    assert "'four' is not 'default' or TxS" in capsys.readouterr().err
    for bad in ("4x4+FOO=1", "default+NCCL_BUFFSIZE", "+NCCL_BUFFSIZE=1"):  # only NCCL's own variables, with values
        with pytest.raises(SystemExit):
            main(["--settings", bad])
        assert repr(bad) in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--wan-only"])
    assert "--wan-only needs --wan-rtt-ms" in capsys.readouterr().err


def test_over_a_wan_the_bench_measures_the_cross_site_pair_at_every_setting_with_its_nccl_variables():
    plan = check_plan(1, NODES)
    jobs = bench_jobs(plan, ("default", "4x4+NCCL_BUFFSIZE=16777216"), lan_path=True, wan=True)
    assert [j.label for j in jobs] == ["wan default", "wan 4x4+NCCL_BUFFSIZE=16777216"]
    args = jobs[1].train_args(plan, 16, 3)
    # The setting's NCCL variables reach the job's environment; nccl_bench gets the sockets part only.
    assert args[:4] == ["--nodes", "s1-a,s1-b,s2-a", "--env", "NCCL_BUFFSIZE=16777216"]
    assert args[-8:] == ["--sockets", "4x4", "--mib", "16", "--rounds", "3", "--pairs", "cross"]
    assert jobs[1].train_args(plan, 16, 3, backward=True)[-1] == "cross"
    assert [j.label for j in bench_jobs(check_plan(0, NODES), ("default", "4x4"), wan=True)] == ["wan default"]
    table = BenchTable("nccl", 256, {})
    table.add(jobs[1], {"pairs": {"cross": {"rounds": [0.05]}}}, "", 0, 0, 30.0)
    table.wan = {"rtt_ms_added": 60.0}
    data = table.as_json()
    assert data["cells"]["wan cross-site 4x4+NCCL_BUFFSIZE=16777216"]["median"] == 0.05
    assert data["wan"] == {"rtt_ms_added": 60.0}
    assert "wan" not in BenchTable("nccl", 256, {}).as_json()
