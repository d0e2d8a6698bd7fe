"""meshrun.core.firewall: the nftables scripts for job guards and the forward guard (pure)."""

from __future__ import annotations

import pytest

from meshrun.core import firewall
from meshrun.errors import UsageError
from meshrun.system.firewall import cgroup2_root


def test_a_job_guard_admits_only_the_jobs_nodes_on_the_overlay():
    table = firewall.job_table("exp7", "dc1-a")
    assert table.startswith("meshrun_job_") and table != firewall.job_table("exp7", "dc2-a")
    script = firewall.job_guard(table, "meshrun job exp7 on dc1-a", "meshrun0", ["10.213.0.3", "10.213.0.2",
                                                                                   "10.213.0.3"])
    cg = f'socket cgroupv2 level 2 "meshrun/{table}"'
    assert script.splitlines() == [
        f"table inet {table} {{}}",
        f"delete table inet {table}",          # re-created whole: idempotent, and atomic in one nft -f
        f"table inet {table} {{",
        '  comment "meshrun job exp7 on dc1-a"',
        "  set nodes { type ipv4_addr; elements = { 10.213.0.2, 10.213.0.3 }; }",
        "  chain input {",
        "    type filter hook input priority filter - 1; policy accept;",
        f'    iifname "meshrun0" tcp flags & (syn | ack) == syn {cg} ip saddr != @nodes drop',
        f'    iifname "meshrun0" meta l4proto udp {cg} ip saddr != @nodes drop',
        f'    iifname "meshrun0" meta nfproto ipv6 {cg} drop',
        "  }",
        "}",
    ]
    assert firewall.add_allowed(table, ["10.213.0.9"]) == f"add element inet {table} nodes {{ 10.213.0.9 }}\n"
    assert firewall.add_allowed(table, []) == ""
    assert "set nodes { type ipv4_addr; }" in firewall.job_guard(table, "x", "meshrun0", [])


def test_the_forward_guard_keeps_member_traffic_on_the_overlay():
    script = firewall.forward_guard("meshrun0")
    assert 'iifname "meshrun0" oifname != "meshrun0" drop' in script
    assert "hook forward" in script and "policy accept" in script


@pytest.mark.parametrize("bad", [
    lambda: firewall.job_guard("meshrun_job_x", "c", "meshrun0", []),                 # not a table we make
    lambda: firewall.job_guard(firewall.job_table("j", "n"), "c", 'eth0"; flush ruleset', []),
    lambda: firewall.job_guard(firewall.job_table("j", "n"), "c", "meshrun0", ["10.0.0.1; flush ruleset"]),
    lambda: firewall.add_allowed(firewall.job_table("j", "n"), ["fd00::1"]),
    lambda: firewall.forward_guard(""),
])
def test_nothing_unchecked_reaches_a_script(bad):
    with pytest.raises(UsageError):
        bad()


def test_a_comment_cannot_break_out():
    script = firewall.job_guard(firewall.job_table("j", "n"), 'job "x"; flush ruleset', "meshrun0", [])
    assert 'comment "job -x-- flush ruleset"' in script


def test_the_cgroup2_root_is_found_where_it_is_mounted():
    hybrid = ("33 25 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
              "40 33 0:35 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    unified = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    nested = "30 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"   # not the hierarchy's root
    assert str(cgroup2_root(hybrid)) == "/sys/fs/cgroup/unified"
    assert str(cgroup2_root(unified)) == "/sys/fs/cgroup"
    assert cgroup2_root(nested) is None and cgroup2_root("") is None
