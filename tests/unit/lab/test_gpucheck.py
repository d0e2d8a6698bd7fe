"""meshrun.lab.gpucheck's reading of a job's output: NCCL's transport lines, by the group they came after."""

from __future__ import annotations

from meshrun.lab.gpucheck import summarize

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
