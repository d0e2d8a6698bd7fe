"""End-to-end: a rank's progress bars (hundreds of KiB of carriage-return redraws) never stall a job.

The bug ("First contact", part 3): 256 KiB of output without a newline (a tqdm bar redrawing with "\\r")
left the share's output unread for ever, and the job with it. Real meshrun, wireguard-go and
torch.distributed (gloo) in a NAT'd namespace world: hq (coordinator) and two datacenters.
"""

from __future__ import annotations

import re
import textwrap
import time

import pytest
from support import hang_guard, joined_mesh

from meshrun.lab.testbed import DatacenterSpec

# Rank 0 draws two bars on stderr: tqdm's own (when installed; it ends its line at the end), then one
# written as tqdm writes ("\r" + bar, flush) that never ends its line at all; each over 256 KiB. Then
# every rank prints one normal line after a collective, so the job only ends if both ranks get there.
SCRIPT = textwrap.dedent("""\
    import sys

    import torch
    import torch.distributed as dist

    N = 5000
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            for _ in tqdm(range(N), mininterval=0, miniters=1, ncols=100, desc="tqdm bar"):
                pass
        for i in range(N):
            done = (i + 1) * 40 // N
            sys.stderr.write(f"\\rraw bar |{'#' * done}{' ' * (40 - done)}| {i + 1}/{N} " + "." * 20)
            sys.stderr.flush()
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {rank} last line, world {int(total.item())}", flush=True)
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with joined_mesh(
        tmp_path_factory, [DatacenterSpec(n) for n in ("hq", "dc1", "dc2")], "hq-a", ("dc1-a", "dc2-a")
    ) as m:
        yield m


def test_progress_bars_of_hundreds_of_kib_end_with_the_job_and_few_lines(mesh, tmp_path):
    (tmp_path / "bars.py").write_text(SCRIPT)
    t0 = time.monotonic()
    res = mesh.meshrun(mesh.coordinator, "train", "bars.py", check=False, timeout=300, cwd=tmp_path)
    took = time.monotonic() - t0
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    assert took < hang_guard(80), took  # 10-20 s here
    # every rank's last line, attributed to its node
    lasts = dict(re.findall(r"^\[(dc\d-a) r(\d)\] rank \2 last line, world 2$", res.stdout, re.M))
    assert sorted(lasts.values()) == ["0", "1"] and set(lasts) == {"dc1-a", "dc2-a"}, res.stdout[-3000:]
    # the bars' final states came through, and not thousands of redraws (stdout is a pipe here)
    assert re.search(r"^\[dc\d-a r0\] raw bar \|#{40}\| 5000/5000 \.{20}$", res.stdout, re.M), res.stdout[-3000:]
    if re.search(r"tqdm bar", res.stdout):
        assert re.search(r"^\[dc\d-a r0\] tqdm bar: 100%.*5000/5000", res.stdout, re.M), res.stdout[-3000:]
    assert len(out.splitlines()) < 200, len(out.splitlines())
    assert "\x1b" not in out  # no cursor movement or colours in a pipe
    # the job's stored logs replay the same way: bounded, the final states there
    job = re.search(r"meshrun: job (\S+) submitted", res.stderr).group(1)
    logs = mesh.meshrun(mesh.coordinator, "logs", job, check=False, timeout=60)
    assert logs.returncode == 0, logs.stderr
    assert re.search(r"raw bar \|#{40}\| 5000/5000", logs.stdout) and len(logs.stdout.splitlines()) < 200
    assert sorted(re.findall(r"rank (\d) last line", logs.stdout)) == ["0", "1"]
