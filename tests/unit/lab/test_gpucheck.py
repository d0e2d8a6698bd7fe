"""meshrun.lab.gpucheck: which backend and GPUs the check uses, and its reading of a job's output (NCCL's
transport lines, by the group they came after)."""

from __future__ import annotations

from meshrun.lab.gpucheck import check_plan, summarize

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
