"""meshrun.core.firewall: the nftables scripts for job guards and the forward guard (pure)."""

from __future__ import annotations

import pytest

from meshrun.core import firewall, lanpath
from meshrun.errors import CommandError, UsageError
from meshrun.system.kernel.fakefirewall import FakeFirewall
from meshrun.system.kernel.firewall import cgroup2_root


def test_a_job_guard_admits_only_the_jobs_nodes_on_the_overlay():
    table = firewall.job_table("exp7", "dc1-a")
    assert table.startswith("meshrun_job_") and table != firewall.job_table("exp7", "dc2-a")
    script = firewall.job_guard(
        table, "meshrun job exp7 on dc1-a", "meshrun0", ["10.213.0.3", "10.213.0.2", "10.213.0.3"]
    )
    assert script.splitlines() == [
        f"table inet {table} {{}}",
        f"delete table inet {table}",  # re-created whole: idempotent, and atomic in one nft -f
        f"table inet {table} {{",
        '  comment "meshrun job exp7 on dc1-a"',
        "  set nodes { type ipv4_addr; elements = { 10.213.0.2, 10.213.0.3 }; }",
        "  chain input {",
        "    type filter hook input priority filter - 1; policy accept;",
        # The overlay arrives on the WireGuard interface, and on the site LAN path's device (core/lanpath).
        '    iifname { "meshrun0", "meshrun0-lan" } tcp flags & (syn | ack) == syn ip saddr != @nodes jump outsider',
        '    iifname { "meshrun0", "meshrun0-lan" } meta l4proto udp ip saddr != @nodes jump outsider',
        '    iifname { "meshrun0", "meshrun0-lan" } meta nfproto ipv6 jump outsider',
        '    iifname != "lo" ip daddr @nodes tcp flags & (syn | ack) == syn ip saddr != @nodes jump outsider',
        '    iifname != "lo" ip daddr @nodes meta l4proto udp ip saddr != @nodes jump outsider',
        "  }",
        "  chain outsider {",
        # One rule per level the job's cgroup may be at (a container's cgroup namespace puts it deeper).
        *(f'    socket cgroupv2 level {n} "meshrun/{table}" drop' for n in range(2, 17)),
        "  }",
        "}",
    ]
    assert firewall.add_allowed(table, ["10.213.0.9"]) == f"add element inet {table} nodes {{ 10.213.0.9 }}\n"
    assert firewall.add_allowed(table, []) == ""
    assert "set nodes { type ipv4_addr; }" in firewall.job_guard(table, "x", "meshrun0", [])
    # A long interface name: its LAN device is the name the LAN path makes (15 characters at most).
    long = firewall.job_guard(table, "x", "meshrun-lab-7", [])
    assert f'iifname {{ "meshrun-lab-7", "{lanpath.interface_name("meshrun-lab-7")}" }} ' in long
    assert lanpath.interface_name("meshrun-lab-7") == "meshrun-lab-lan"
    assert firewall.delete_guard(table) == f"delete table inet {table}\n"


def test_a_gated_guard_lets_only_the_jobs_processes_reach_its_ports_from_the_member():
    """Every process on a job's node sends with the node's overlay address: the gate tags the job's own new
    connections (by the sending socket's cgroup) and stamps those leaving for the overlay, judges loopback
    arrivals by the tag and overlay arrivals from the job's nodes by the stamp, and refuses connections no job
    tagged to the job's nodes' job ports where no stamp is read (the overlay API's port exempt)."""
    table = firewall.job_table("exp7", "hq-a/store")
    gate = firewall.job_gate("exp7", 29400, 100, 51821, (32768, 60999))
    mark = firewall.job_mark("exp7")
    assert gate == firewall.ProcessGate(mark, ((29401, 29499), (32768, 60999)), (51821,), ((29401, 29499),))
    assert firewall.ProcessGate.from_record(gate.record()) == gate and firewall.ProcessGate.from_record(None) is None
    lines = firewall.job_guard(table, "c", "meshrun0", ["10.213.0.2"], gate).splitlines()
    untagged = f"ct mark & 0xfff00000 != {mark:#010x}"
    # Loopback (the member's own addresses, 127.0.0.1, ::1): only the job's tag passes to the job's sockets.
    assert f'    iifname "lo" tcp flags & (syn | ack) == syn {untagged} jump outsider' in lines
    assert f'    iifname "lo" meta l4proto udp ct state new {untagged} jump outsider' in lines
    tag = lines.index("  chain tag_own {")
    assert lines[tag + 1 : tag + 16] == [
        f'    socket cgroupv2 level {n} "meshrun/{table}" ct mark set ct mark & 0x000fffff | {mark:#010x}'
        for n in range(2, 17)
    ]
    # Tagged before any table's output judge runs (another cgroup of the same job may hold the sender).
    assert "    type filter hook output priority filter - 2; policy accept;" in lines
    # Over the overlay from the job's nodes: only what carries the stamp a job's process there was given. The
    # overlay travels sealed in WireGuard, its extra tunnels (core/tunnels) and VXLAN: the stamp arrives as sent.
    tunnels = ", ".join(f'"meshrun0-t{i}"' for i in range(1, 8))
    overlay = f'{{ "meshrun0", "meshrun0-lan", {tunnels} }}'
    assert (
        f"    iifname {overlay} tcp flags & (syn | ack) == syn ip saddr @nodes ip dscp != 0x2b jump outsider"
    ) in lines
    assert f"    iifname {overlay} meta l4proto udp ct state new ip saddr @nodes ip dscp != 0x2b jump outsider" in lines
    stamp = lines.index("  chain stamp_new {")
    assert lines[stamp + 1 : stamp + 4] == [
        f"    iifname {overlay} return",  # a relaying member's forwards keep their sender's stamp
        "    ct mark & 0xfff00000 != 0 ip dscp set 0x2b return",  # any job's process
        "    ip dscp 0x2b ip dscp set cs0",  # anything else that claims it (a user's IP_TOS, a container)
    ]
    assert "    type filter hook postrouting priority filter; policy accept;" in lines
    # On the way out where no stamp is read, a connection no job tagged: over loopback to the stores (bound to
    # the overlay device, which nft's loopback lookup misses), across a routed site LAN to any job port.
    refused = "ip daddr @nodes tcp flags & (syn | ack) == syn ct mark & 0xfff00000 == 0 tcp dport != { 51821 }"
    assert f'    oifname "lo" {refused} tcp dport {{ 29401-29499 }} reject with tcp reset' in lines
    not_sealed = f'oifname != {overlay[:-2]}, "lo" }}'
    assert f"    {not_sealed} {refused} tcp dport {{ 29401-29499, 32768-60999 }} reject with tcp reset" in lines
    # A spec written before loopback ranges were kept: loopback refuses all of the gate's ports, as it did.
    old = {"mark": mark, "ports": [[29401, 29499], [32768, 60999]], "exempt": [51821]}
    assert firewall.ProcessGate.from_record(old) == firewall.ProcessGate(mark, gate.ports, (51821,))
    older = firewall.job_guard(table, "c", "meshrun0", ["10.213.0.2"], firewall.ProcessGate.from_record(old))
    assert f'    oifname "lo" {refused} tcp dport {{ 29401-29499, 32768-60999 }} reject with tcp reset' in older
    # Without a gate (etcd's guard, whose clients hold certificates) nothing local is judged.
    plain = firewall.job_guard(table, "c", "meshrun0", ["10.213.0.2"])
    assert "ct mark" not in plain and "hook output" not in plain and 'iifname "lo" tcp' not in plain
    assert "dscp" not in plain and "postrouting" not in plain


def test_a_jobs_mark_is_stable_within_its_bits_and_tells_jobs_apart():
    marks = {firewall.job_mark(f"job{i}") for i in range(200)}
    assert firewall.job_mark("exp7") == firewall.job_mark("exp7")
    assert all(m and m & ~firewall.MARK_MASK == 0 for m in marks) and len(marks) > 190
    with pytest.raises(UsageError, match="0x1"):
        firewall.job_guard(firewall.job_table("j", "n"), "c", "meshrun0", [], firewall.ProcessGate(0x1))
    with pytest.raises(UsageError, match="69901-70099"):
        firewall.job_gate("j", 69900, 200, 51821, (32768, 60999))


def test_a_job_table_name_is_stable_and_unique_per_job_and_member():
    assert firewall.job_table("exp7", "dc1-a") == firewall.job_table("exp7", "dc1-a")
    names = {firewall.job_table(j, n) for j in ("exp7", "exp8") for n in ("dc1-a", "dc1-b", "dc1-a/store")}
    assert len(names) == 6 and all(firewall.is_job_table(n) for n in names)
    assert not firewall.is_job_table("meshrun_forward") and not firewall.is_job_table("filter")


def test_only_inet_tables_are_listed():
    listing = "table ip filter\ntable inet meshrun_job_0123456789abcdef\ntable inet meshrun_forward\ntable ip6 x\n"
    assert firewall.inet_tables(listing) == ["meshrun_job_0123456789abcdef", "meshrun_forward"]
    assert firewall.inet_tables("") == []
    assert firewall.job_tables_in(listing) == ["meshrun_job_0123456789abcdef"]


def test_the_forward_guard_keeps_member_traffic_on_the_overlay():
    script = firewall.forward_guard("meshrun0")
    assert 'add rule inet meshrun_forward guard_meshrun0 iifname "meshrun0" oifname != "meshrun0" drop' in script
    assert "hook forward" in script and "policy accept" in script
    assert "delete table" not in script  # another interface's guard (a member of another network) stays


def test_a_relay_forwards_only_the_pairs_it_was_given_both_ways():
    nothing = firewall.forward_guard("meshrun0")
    assert nothing.rstrip().splitlines()[-1] == (
        'add rule inet meshrun_forward guard_meshrun0 iifname "meshrun0" oifname "meshrun0" drop'
    )
    script = firewall.forward_guard("meshrun0", [("10.213.0.3", "10.213.0.2")])
    rules = [line for line in script.splitlines() if line.startswith("add rule")]
    assert rules == [
        'add rule inet meshrun_forward guard_meshrun0 iifname "meshrun0" oifname != "meshrun0" drop',
        'add rule inet meshrun_forward guard_meshrun0 iifname "meshrun0" oifname "meshrun0" '
        "ip saddr . ip daddr { 10.213.0.2 . 10.213.0.3, 10.213.0.3 . 10.213.0.2 } accept",
        'add rule inet meshrun_forward guard_meshrun0 iifname "meshrun0" oifname "meshrun0" drop',
    ]


def test_each_interface_has_its_own_forward_guard_and_removing_one_leaves_the_others():
    assert firewall.forward_chain("meshrun0") == "guard_meshrun0"
    assert firewall.forward_chain("wg-b.1") == "guard_wg-b.1"
    script = firewall.forward_unguard("meshrun0")
    assert "delete chain inet meshrun_forward guard_meshrun0" in script and "guard_wg" not in script
    assert "table" in script.splitlines()[0] and "add chain inet meshrun_forward guard_meshrun0" in script
    listing = (
        "table inet meshrun_forward {\n\tchain guard_wg-b.1 {\n\t\ttype filter hook forward priority filter - 1;"
        ' policy accept;\n\t\tiifname "wg-b.1" oifname != "wg-b.1" drop\n\t}\n}\n'
    )
    assert firewall.forward_chains(listing) == ["guard_wg-b.1"]
    assert firewall.forward_chains("table inet meshrun_forward {\n}\n") == []


def test_a_guard_made_by_an_older_meshrun_is_replaced():
    """Older releases kept one chain, `forward`, for the whole host: installing a guard takes it away."""
    lines = firewall.forward_guard("meshrun0").splitlines()
    assert lines.index("delete chain inet meshrun_forward forward") < lines.index(
        "flush chain inet meshrun_forward guard_meshrun0"
    )


@pytest.mark.parametrize(
    "bad",
    [
        lambda: firewall.job_guard("meshrun_job_x", "c", "meshrun0", []),  # not a table we make
        lambda: firewall.job_guard(firewall.job_table("j", "n"), "c", 'eth0"; flush ruleset', []),
        lambda: firewall.job_guard(firewall.job_table("j", "n"), "c", "meshrun0", ["10.0.0.1; flush ruleset"]),
        lambda: firewall.add_allowed(firewall.job_table("j", "n"), ["fd00::1"]),
        lambda: firewall.forward_guard(""),
        lambda: firewall.forward_guard("meshrun0 accept"),
        lambda: firewall.forward_guard("a-very-long-interface-name"),
        lambda: firewall.forward_guard("meshrun0", [("10.213.0.2", "10.213.0.3 } accept; flush ruleset")]),
        lambda: firewall.forward_unguard("meshrun0; flush ruleset"),
        lambda: firewall.job_table("job; flush ruleset", "n"),  # job id charset
        lambda: firewall.job_table("", "n"),
        lambda: firewall.job_table("j", 'n" drop'),
        lambda: firewall.job_table("j", "../../etc"),
        lambda: firewall.delete_guard("filter"),  # never the host's tables
        lambda: firewall.add_allowed(firewall.job_table("j", "n"), ["10.0.0.300"]),
        lambda: firewall.add_allowed(firewall.job_table("j", "n"), ["10.0.0.0/24"]),
    ],
)
def test_nothing_unchecked_reaches_a_script(bad):
    with pytest.raises(UsageError):
        bad()


def test_a_bad_value_is_named_in_the_error():
    with pytest.raises(UsageError, match="10.0.0.300"):
        firewall.add_allowed(firewall.job_table("j", "n"), ["10.0.0.1", "10.0.0.300"])
    with pytest.raises(UsageError, match="bad id"):
        firewall.job_table("bad id", "n")
    with pytest.raises(UsageError, match="eth 0"):
        firewall.forward_guard("eth 0")


def test_a_comment_cannot_break_out():
    script = firewall.job_guard(firewall.job_table("j", "n"), 'job "x"; flush ruleset', "meshrun0", [])
    assert 'comment "job -x-- flush ruleset"' in script


def test_the_cgroup2_root_is_found_where_it_is_mounted():
    hybrid = (
        "33 25 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n40 33 0:35 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    unified = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    nested = "30 23 0:26 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"  # not the hierarchy's root
    assert str(cgroup2_root(hybrid)) == "/sys/fs/cgroup/unified"
    assert str(cgroup2_root(unified)) == "/sys/fs/cgroup"
    assert cgroup2_root(nested) is None and cgroup2_root("") is None


def test_the_fake_firewall_follows_the_protocol_and_checks_like_the_real_one():
    fw = FakeFirewall()
    g = fw.JobGuard("exp7", "dc1-a", "meshrun0").create(["10.213.0.2"])
    g.join()
    fw.allow("exp7", "dc1-a", ["10.213.0.5"])  # the agent, for a node joining the elastic job
    assert fw.tables == {g.table: {"10.213.0.2", "10.213.0.5"}} and fw.job_tables() == [g.table]
    idle = fw.JobGuard("exp8", "dc1-a", "meshrun0").create([])  # made, never joined: swept
    assert fw.sweep() == [idle.table] and fw.sweeps == 1
    g.remove()
    g.remove()  # twice is fine
    with pytest.raises(CommandError):
        g.allow(["10.213.0.6"])  # like nft: the table is gone
    with pytest.raises(UsageError):
        fw.JobGuard("exp7", "dc1-a", "meshrun0").create(["not-an-ip"])
    fw.install_forward_guard("meshrun0")
    fw.remove_forward_guard("wg1")  # another interface's: this one's guard stays
    assert fw.forward == "meshrun0"
    fw.remove_forward_guard("meshrun0")
    assert [c[0] for c in fw.calls] == [
        "create",
        "join",
        "allow",
        "create",
        "sweep",
        "remove",
        "remove",
        "allow",
        "install_forward_guard",
        "remove_forward_guard",
        "remove_forward_guard",
    ]
    assert fw.allowed == [("exp7", "dc1-a", ["10.213.0.5"])] and fw.forward is None and fw.available() is None


def test_missing_requirements_are_named_with_their_fix(monkeypatch, tmp_path):
    from meshrun.errors import HostError
    from meshrun.system.kernel import firewall as fw

    monkeypatch.setattr(fw.os, "geteuid", lambda: 1000)
    with pytest.raises(HostError, match="need root") as err:
        fw.JobGuard("exp7", "dc1-a", "meshrun0").create([])
    assert "sudo" in err.value.fix
    monkeypatch.setattr(fw.os, "geteuid", lambda: 0)
    monkeypatch.setattr(fw.shutil, "which", lambda tool: None)
    with pytest.raises(HostError, match="`nft` is not installed") as err:
        fw.JobGuard("exp7", "dc1-a", "meshrun0").create([])
    assert err.value.fix == "install it: apt-get install nftables"
    monkeypatch.setattr(fw.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(fw.host, "proc_cgroups", lambda: "")  # no v1 net_cls: socket matching is trusted
    monkeypatch.setattr(fw, "cgroup2_root", lambda mountinfo=None: None)

    def refused(argv, **kw):
        raise CommandError("mount: permission denied", "run meshrun as root")

    monkeypatch.setattr(fw, "PRIVATE_CGROUP2", tmp_path / "cgroup2")
    monkeypatch.setattr(fw, "run", refused)  # the kernel refuses the mount: nothing else to try
    with pytest.raises(HostError, match="no cgroup v2 hierarchy is mounted, and mounting one") as err:
        fw.JobGuard("exp7", "dc1-a", "meshrun0").create([])
    assert "systemd.unified_cgroup_hierarchy=1" in err.value.fix


def test_a_host_without_cgroup_v2_mounted_gets_meshruns_own_and_a_distrusted_kernel_is_refused(monkeypatch, tmp_path):
    """cgroup v1 only (no v2 mount anywhere): the guard mounts the kernel's v2 hierarchy at PRIVATE_CGROUP2 and
    makes the job's cgroup there; a kernel whose v2 socket matching v1's net_cls switched off is refused first."""
    from meshrun.errors import HostError
    from meshrun.system.kernel import firewall as fw

    calls = []
    private = tmp_path / "cgroup2"
    monkeypatch.setattr(fw.os, "geteuid", lambda: 0)
    monkeypatch.setattr(fw.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(fw, "PRIVATE_CGROUP2", private)
    monkeypatch.setattr(fw, "cgroup2_root", lambda mountinfo=None: private if calls else None)
    monkeypatch.setattr(fw, "run", lambda argv, **kw: calls.append(list(argv)))
    monkeypatch.setattr(fw.host, "proc_cgroups", lambda: "")
    assert fw.available() is None  # only the mount is missing: jobs can start
    guard = fw.JobGuard("exp7", "dc1-a", "meshrun0").create(["10.213.0.2"])
    assert calls[0] == ["mount", "-t", "cgroup2", "cgroup2", str(private)]
    assert guard.cgroup.is_dir() and guard.cgroup.parent.parent == private
    assert calls[1][:1] == ["unshare"]  # nft sees the private hierarchy at /sys/fs/cgroup (as on a hybrid host)
    assert "mounted by meshrun" in fw.hierarchy()
    monkeypatch.setattr(fw.os, "uname", lambda: type("U", (), {"release": "5.14.0"})())
    monkeypatch.setattr(fw.host, "proc_cgroups", lambda: "net_cls\t3\t2\t1\n")
    with pytest.raises(HostError, match="net_cls"):
        fw.JobGuard("exp8", "dc1-a", "meshrun0").create([])
    assert fw.available()[0].startswith("Linux 5.14.0")


def test_a_sweep_that_cannot_see_cgroups_removes_nothing(monkeypatch):
    """Fail closed: without the cgroup hierarchy a live job's guard looks like a dead one's."""
    from meshrun.system.kernel import firewall as fw

    deleted = []
    monkeypatch.setattr(fw, "job_tables", lambda: [firewall.job_table("exp7", "dc1-a")])
    monkeypatch.setattr(fw, "cgroup2_root", lambda mountinfo=None: None)
    monkeypatch.setattr(fw, "_delete_table", deleted.append)
    assert fw.sweep() == [] and deleted == []


PROC_CGROUPS_V1 = """#subsys_name	hierarchy	num_cgroups	enabled
cpu	1	1	1
memory	4	32	1
net_cls	3	2	1
net_prio	3	2	1
pids	8	1	1
"""
PROC_CGROUPS_V2 = PROC_CGROUPS_V1.replace("net_cls\t3", "net_cls\t0").replace("net_prio\t3", "net_prio\t0")


def test_socket_matching_is_distrusted_only_before_5_15_with_net_cls_or_net_prio_in_a_v1_hierarchy():
    caveat = firewall.socket_match_caveat("5.14.0-70.el9.x86_64", PROC_CGROUPS_V1)
    assert caveat and "net_cls and net_prio" in caveat and "5.14.0-70" in caveat
    assert firewall.socket_match_caveat("5.15.0-91-generic", PROC_CGROUPS_V1) is None
    assert firewall.socket_match_caveat("6.18.44", PROC_CGROUPS_V1) is None
    assert firewall.socket_match_caveat("5.14.0", PROC_CGROUPS_V2) is None  # on v2 (or unmounted): no conflict
    disabled = PROC_CGROUPS_V1.replace("net_cls\t3\t2\t1", "net_cls\t3\t2\t0").replace("net_prio\t3\t2\t1", "")
    assert firewall.socket_match_caveat("5.13.0", disabled) is None
    assert firewall.socket_match_caveat("5.13.0", "") is None
