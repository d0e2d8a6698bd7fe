"""A cgroup-v1 datacenter of the testbed (meshrun.lab.testbed._cgroup_mounts): its nodes see v1 hierarchies only,
and only controllers the host already keeps in v1 are mounted (one on the v2 hierarchy would move host-wide)."""

from __future__ import annotations

import pytest

from meshrun.errors import UsageError
from meshrun.lab.testbed import DatacenterSpec, _cgroup_mounts

HYBRID = """#subsys_name	hierarchy	num_cgroups	enabled
cpu	1	1	1
memory	4	32	1
net_cls	0	2	1
pids	8	1	1
"""
PURE_V2 = "\n".join(
    line.replace("\t1\t1\t1", "\t0\t1\t1").replace("\t4\t", "\t0\t").replace("\t8\t", "\t0\t")
    for line in HYBRID.splitlines()
)


def test_a_v1_node_gets_a_tmpfs_with_the_hosts_v1_controllers_and_no_cgroup2():
    script = _cgroup_mounts(HYBRID)
    assert script.startswith("mount -t tmpfs cgroup /sys/fs/cgroup")
    for c in ("cpu", "memory", "pids"):
        assert f"mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}" in script
    assert "cgroup2" not in script and "net_cls" not in script
    # A host whose controllers are all on v2: none is taken from it, a named hierarchy stands in.
    bare = _cgroup_mounts(PURE_V2)
    assert "-o cpu" not in bare and "-o memory" not in bare and "-o none,name=meshrun-lab" in bare


def test_the_cgroup_kind_is_checked():
    DatacenterSpec("dc1", cgroup="v1").validate()
    with pytest.raises(UsageError, match="cgroup 'v3'"):
        DatacenterSpec("dc1", cgroup="v3").validate()
