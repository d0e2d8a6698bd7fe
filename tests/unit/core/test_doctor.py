"""The doctor's judgement (meshrun.core.doctor) on crafted facts, the MTU search, and the parsers it uses."""

from __future__ import annotations

import copy

import pytest

from meshrun.core import doctor, netparse
from meshrun.core.doctor import FAIL, OK, SKIP, WARN

HEALTHY = {
    "role": "node",
    "name": "gpu-b",
    "network": "lab",
    "overlay_ip": "10.9.0.3",
    "prefixlen": 16,
    "interface_name": "meshrun0",
    "listen_port": 51820,
    "daemon_pid": 4242,
    "trains": False,
    "interface": {"exists": True, "up": True, "mtu": 1420},
    "backend": {"kind": "kernel", "kernel_module": True},
    "coordinator_name": "coordinator",
    "peers": [
        {
            "name": "coordinator",
            "overlay_ip": "10.9.0.1",
            "endpoint": "198.51.100.1:51820",
            "path": "direct (public)",
            "handshake_age_s": 20,
        },
        {
            "name": "gpu-c",
            "overlay_ip": "10.9.0.4",
            "endpoint": "198.51.100.7:51820",
            "path": "direct (public)",
            "handshake_age_s": 40,
        },
    ],
    "mtu_probe": {"target": "10.9.0.1", "size": 1420, "full": True},
    "coordinator": {"ip": "10.9.0.1", "reachable": True, "rtt_ms": 21.0},
    "clock_offset_s": 0.03,
    "udp_probe": {"endpoint": "203.0.113.5:51820", "sent": 3, "arrived": 3},
    "jobs_dir": "/var/lib/meshrun/jobs",
    "environment": {
        "python": "/opt/venv/bin/python",
        "python_version": "3.11.7",
        "torch": "2.13.0+cu128",
        "cuda": "12.8",
        "nccl": "2.27.3",
        "gloo": True,
        "gpus": 8,
        "gpu_names": ["NVIDIA H100"],
        "free_bytes": 500 << 30,
    },
    "shell_env": {},
    "daemon_env": {},
    "reverse_dns_s": 0.002,
}


def facts(**changes) -> dict:
    f = copy.deepcopy(HEALTHY)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(f.get(key), dict):
            f[key].update(value)
        else:
            f[key] = value
    return f


def levels(f: dict) -> dict[str, str]:
    """{check name: worst level} (several lines may share a name)."""
    order = [SKIP, OK, WARN, FAIL]
    out: dict[str, str] = {}
    for c in doctor.judge(f):
        out[c.name] = max(out.get(c.name, SKIP), c.level, key=order.index)
    return out


def only(f: dict, name: str) -> doctor.Check:
    (c,) = [c for c in doctor.judge(f) if c.name == name]
    return c


def test_healthy_facts_are_all_ok_and_do_not_block():
    checks = doctor.judge(HEALTHY)
    assert {c.level for c in checks} == {OK}, [c for c in checks if c.level != OK]
    assert {
        "daemon",
        "interface",
        "wireguard",
        "mtu",
        "coordinator",
        "peer coordinator",
        "peer gpu-c",
        "udp/51820",
        "clock",
        "disk",
        "torch",
        "environment",
        "resolver",
    } == {c.name for c in checks}
    assert not doctor.blocking(checks)
    assert "NCCL 2.27.3" in only(HEALTHY, "torch").detail and "8 GPU(s) NVIDIA H100" in only(HEALTHY, "torch").detail


def test_no_daemon_blocks():
    c = only(facts(daemon_pid=None), "daemon")
    assert c.level == FAIL and "meshrun up" in c.fix


def test_interface_missing_or_down_blocks_and_skips_the_overlay_probes():
    gone = facts(interface={"exists": False, "up": False, "mtu": None})
    assert levels(gone)["interface"] == FAIL
    assert "mtu" not in levels(gone) and "coordinator" not in levels(gone)
    down = facts(interface={"up": False})
    c = only(down, "interface")
    assert c.level == FAIL and "meshrun0 exists but is down" in c.detail and "ip link set meshrun0 up" in c.fix
    assert doctor.blocking(doctor.judge(down))


@pytest.mark.parametrize(
    "backend,level,phrase",
    [
        (
            {"kind": "wireguard-go", "version": "0.0.20230223", "kernel_module": False},
            OK,
            "this kernel has no WireGuard",
        ),
        (
            {"kind": "wireguard-go", "version": "0.0.20220316", "kernel_module": False, "warning": "no batched I/O"},
            WARN,
            "no batched I/O",
        ),
        ({"kind": "wireguard-go", "version": "0.0.20230223", "kernel_module": True}, WARN, "module is present"),
        ({"kind": "wireguard-go", "version": None, "kernel_module": None}, OK, "could not be looked for"),
    ],
)
def test_the_backend_line_says_why_userspace(backend, level, phrase):
    c = only(facts(backend=backend), "wireguard")
    assert c.level == level and phrase in c.detail


def test_a_black_holed_full_size_packet_blocks_with_the_size_that_passes():
    c = only(facts(mtu_probe={"full": False, "small": True, "largest": 1336}), "mtu")
    assert c.level == FAIL and "1336 bytes get through" in c.detail and "--mtu 1336" in c.fix
    assert only(facts(mtu_probe={"full": False, "small": False}), "mtu").level == FAIL
    assert only(facts(mtu_probe={"full": None, "error": "no CAP_NET_RAW"}), "mtu").level == SKIP
    no_target = facts()
    no_target["mtu_probe"] = {}
    assert only(no_target, "mtu").level == SKIP


def test_an_unreachable_coordinator_blocks_on_a_node():
    c = only(facts(coordinator={"reachable": False, "error": "timed out"}), "coordinator")
    assert c.level == FAIL and "timed out" in c.detail


def test_stale_peers_warn_but_a_stale_coordinator_blocks():
    f = facts()
    f["peers"][1]["handshake_age_s"] = 3600
    assert levels(f)["peer gpu-c"] == WARN and not doctor.blocking(doctor.judge(f))
    f["peers"][1]["handshake_age_s"] = None
    assert "no handshake yet" in only(f, "peer gpu-c").detail
    f["peers"][0]["handshake_age_s"] = 900
    assert levels(f)["peer coordinator"] == FAIL


def test_many_healthy_peers_fold_into_one_line():
    f = facts(
        peers=[
            {"name": f"n{i}", "overlay_ip": f"10.9.1.{i}", "endpoint": None, "path": "relayed", "handshake_age_s": 5}
            for i in range(50)
        ]
    )
    f["peers"][7]["handshake_age_s"] = None
    names = [c.name for c in doctor.judge(f)]
    assert names.count("peers") == 1 and "peer n7" in names and "peer n8" not in names


def test_udp_not_reachable_from_outside_is_a_warning_with_the_fix():
    c = only(facts(udp_probe={"endpoint": "203.0.113.5:40001", "sent": 3, "arrived": 0}), "udp/51820")
    assert c.level == WARN and "forward UDP 51820" in c.fix
    untested = facts()
    untested["udp_probe"] = {"error": "iptables missing"}
    assert only(untested, "udp/51820").level == SKIP


def test_the_site_lan_path_is_checked_only_where_one_is_planned():
    assert "site LAN path" not in levels(facts())  # no trusted site: no line
    up = {"device": "meshrun0-lan", "planned": ["b", "c"], "active": ["b", "c"], "error": ""}
    assert only(facts(lan=up), "site LAN path").level == OK
    c = only(facts(lan=dict(up, active=["b"])), "site LAN path")
    assert c.level == WARN and "c" in c.detail and "UDP 51819" in c.fix
    c = only(facts(lan={"planned": [], "active": [], "error": "this kernel has no VXLAN"}), "site LAN path")
    assert c.level == WARN and "VXLAN" in c.detail and "untrust" in c.fix
    routed = {"device": "eth0", "routed": True, "planned": ["b", "c"], "active": ["b", "c"], "error": ""}
    c = only(facts(lan=routed), "site LAN path")
    assert c.level == OK and "routed, no encapsulation, eth0" in c.detail
    c = only(facts(lan=dict(routed, active=["b"])), "site LAN path")
    assert c.level == WARN and "layer-2" in c.fix and "--encapsulation vxlan" in c.fix and "51819" not in c.fix


def test_job_guards_say_which_cgroup_hierarchy_and_why_jobs_cannot_start():
    assert "job guards" not in levels(facts())  # facts without the key (older gather): no line
    v1 = {"cgroup": "none mounted (cgroup v1 only): meshrun mounts one at /run/meshrun/cgroup2", "problem": None}
    c = only(facts(job_guards=v1), "job guards")
    assert c.level == OK and "/run/meshrun/cgroup2" in c.detail
    bad = {"cgroup": "cgroup v2 at /sys/fs/cgroup", "problem": ["Linux 5.14 with cgroup v1 net_cls mounted", "unmount"]}
    c = only(facts(job_guards=bad), "job guards")
    assert c.level == FAIL and "net_cls" in c.detail and c.fix == "unmount"


def test_a_lost_coordinator_and_a_pair_of_them_are_warned_about_on_nodes_and_coordinators():
    coord = lambda name, age: {"name": name, "coordinator": True, "handshake_age_s": age}  # noqa: E731
    node = {"name": "gpu-c", "coordinator": False, "handshake_age_s": None}
    three = [coord("c1", 20), coord("c2", 40), coord("c3", 900), node]
    (lost,) = doctor.control_warnings("node", three, [])
    assert "coordinator c3 not heard from" in lost and "2 of 3" in lost and "remove c3 --force" in lost
    assert doctor.control_warnings("node", three[:2] + [coord("c3", 30)], []) == []
    assert doctor.control_warnings("node", [coord("c1", None), node], []) == []  # a lone coordinator: its own check
    assert "etcd needs both" in doctor.control_warnings("node", three[:2], [])[0]
    # Asked now, an answer counts over an old handshake, and silence over a fresh one.
    asked = [dict(coord("c1", 20), answered=False), dict(coord("c2", 900), answered=True), coord("c3", 10)]
    (lost,) = doctor.control_warnings("node", asked, [])
    assert "coordinator c1 not heard from" in lost
    rows = [{"name": "c1", "etcd": "ok"}, {"name": "c2", "etcd": "unreachable"}, {"name": "c3", "etcd": "ok"}]
    assert "coordinator c2 not heard from" in doctor.control_warnings("coordinator", [], rows)[0]
    # Two of three lost: no majority, so no removal can be decided anywhere; the warning says what can be done.
    (lost,) = doctor.control_warnings("node", [coord("c1", 20), coord("c2", 900), coord("c3", 900)], [])
    assert "1 of 3" in lost and "no majority" in lost and "remove" not in lost and "--force-new-cluster" in lost
    # In doctor: on a node, one line for the coordinators; on a coordinator, the control check says it.
    c = only(facts(peers=three), "coordinators")
    assert c.level == WARN and "c3" in c.detail
    # Doctor asks them too: an answer now is what it reports, a fresh handshake without one is a loss.
    answering = [dict(coord(n, 20), answered=True) for n in ("c1", "c2", "c3")]
    assert only(facts(peers=answering), "coordinators").detail == "all 3 coordinators answer now"
    answering[2]["answered"] = False
    assert "coordinator c3 not heard from" in only(facts(peers=answering), "coordinators").detail
    two = {
        "coordinators": [{"name": "c1", "etcd": "ok", "role": "leader"}, {"name": "c2", "etcd": "ok"}],
        "etcd_pid": 7,
    }
    c = only(facts(role="coordinator", control=two), "control")
    assert c.level == WARN and "etcd needs both" in c.detail


def test_a_relay_forwarding_in_userspace_is_a_warning_with_the_fix():
    assert "relay" not in levels(facts())  # relays nothing: no line
    kernel = {"pairs": 2, "forwarding": "kernel (nftables netdev fwd)"}
    assert only(facts(relaying=kernel), "relay").level == OK
    c = only(facts(relaying={"pairs": 1, "forwarding": "userspace (the relay's sockets)"}), "relay")
    assert c.level == WARN and "nftables" in c.fix


@pytest.mark.parametrize(
    "took,level,phrase", [(0.002, OK, "2 ms"), (5.0, WARN, "took 5.0 s"), (None, WARN, "after 6 s")]
)
def test_a_slow_reverse_lookup_warns_that_every_rank_waits_for_it(took, level, phrase):
    c = only(facts(reverse_dns_s=took), "resolver")
    assert c.level == level and phrase in c.detail and "10." in c.detail, c
    assert level == OK or ("/etc/resolv.conf" in c.fix and "/etc/hosts" in c.fix)


@pytest.mark.parametrize("offset,level", [(0.4, OK), (-9.0, WARN), (600.0, FAIL)])
def test_clock_offsets(offset, level):
    assert only(facts(clock_offset_s=offset), "clock").level == level


def test_disk_and_torch_follow_the_preflight_rules():
    assert levels(facts(environment={"free_bytes": 10 << 20}))["disk"] == FAIL
    assert levels(facts(environment={"free_bytes": 500 << 20}))["disk"] == WARN
    c = only(facts(environment={"torch": None, "cuda": None, "nccl": None}), "torch")
    assert c.level == FAIL and "/opt/venv/bin/python" in c.detail
    assert levels(facts(environment={"gpus": 0, "gpu_names": []}))["torch"] == WARN  # CUDA build, no GPU


def test_torch_missing_on_a_coordinator_that_does_not_train_is_not_a_problem():
    f = facts(role="coordinator", environment={"torch": None, "cuda": None, "nccl": None})
    assert levels(f)["torch"] == SKIP
    assert levels(dict(f, trains=True))["torch"] == FAIL


def test_a_coordinator_is_not_asked_about_itself():
    f = facts(role="coordinator", coordinator_name=None)
    names = levels(f)
    assert "coordinator" not in names and "clock" not in names and names["udp/51820"] == OK


def test_pinning_overridden_in_the_shell_blocks_and_in_the_daemon_warns():
    shell = doctor.judge(facts(shell_env={"NCCL_SOCKET_IFNAME": "eth0"}))
    (c,) = [c for c in shell if c.name == "environment"]
    assert (
        c.level == FAIL and "NCCL_SOCKET_IFNAME=eth0 in this shell overrides meshrun's pinning (=meshrun0)" in c.detail
    )
    (c,) = [c for c in doctor.judge(facts(daemon_env={"NCCL_SOCKET_IFNAME": "eth0"})) if c.name == "environment"]
    assert c.level == WARN and "in the daemon's environment (pid 4242)" in c.detail


def test_meshrun_s_own_values_are_not_overrides():
    f = facts(shell_env={"NCCL_SOCKET_IFNAME": "=meshrun0", "GLOO_SOCKET_IFNAME": "meshrun0"})
    assert levels(f)["environment"] == OK


@pytest.mark.parametrize(
    "where,key,level",
    [
        ("shell_env", "MASTER_ADDR", WARN),
        ("daemon_env", "MASTER_ADDR", OK),
        ("shell_env", "NCCL_COMM_ID", FAIL),
        ("daemon_env", "NCCL_COMM_ID", FAIL),
        ("daemon_env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", FAIL),
    ],
)
def test_steering_variables(where, key, level):
    assert levels(facts(**{where: {key: "1"}}))["environment"] == level


def test_render_puts_the_fix_under_problems_and_ends_with_a_verdict():
    text = doctor.render(doctor.judge(facts(daemon_pid=None)), "head")
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("FAIL  daemon"))
    assert lines[i + 1].strip().startswith("fix: meshrun up")
    assert lines[-1] == "1 problem(s) that block training, 0 warning(s)"
    assert doctor.render(doctor.judge(HEALTHY), "head").splitlines()[-1] == "everything meshrun checks is fine"


def test_link_and_rule_counter_parsers():
    text = '[{"ifindex":5,"ifname":"meshrun0","flags":["POINTOPOINT","NOARP","UP","LOWER_UP"],"mtu":1420}]'
    assert netparse.link(text) == {"exists": True, "up": True, "mtu": 1420}
    assert netparse.link('[{"ifname":"meshrun0","flags":["POINTOPOINT","NOARP"],"mtu":1420}]')["up"] is False
    assert netparse.link("")["exists"] is False
    listing = (
        "Chain PREROUTING (policy ACCEPT 12 packets, 900 bytes)\n"
        "    pkts      bytes target     prot opt in     out     source               destination\n"
        "       3      159            udp  --  *      *       198.51.100.1         0.0.0.0/0            "
        "udp spt:!51820 dpt:51820 /* meshrun-doctor-ab12 */\n"
    )
    assert netparse.rule_packets(listing, "meshrun-doctor-ab12") == 3
    assert netparse.rule_packets(listing, "meshrun-doctor-ffff") == 0


def test_disk_use_of_jobs_and_projects_is_shown_with_how_to_free_it():
    f = facts(disk_use={"jobs": 3 << 20, "projects": {"charlm": 900 << 20, "ddp": 1 << 20}})
    check = next(c for c in doctor.judge(f) if c.name == "job files")
    assert check.level == OK
    assert check.detail == "jobs 3.0 MiB, 2 project(s) 901.0 MiB (charlm 900.0 MiB, ddp 1.0 MiB)"
    assert "meshrun jobs --prune" in check.fix and "--prune-project" in check.fix
    empty = next(c for c in doctor.judge(facts(disk_use={"jobs": 0, "projects": {}})) if c.name == "job files")
    assert empty.detail == "jobs 0.0 MiB, 0 project(s) 0.0 MiB" and empty.fix == ""


def _control(etcd: list[str], pid: int | None = 4242) -> dict:
    rows = [
        {
            "name": f"c{i}",
            "overlay_ip": f"10.0.0.{i}",
            "endpoint": "-",
            "etcd": e,
            "role": "leader" if i == 0 else "follower",
        }
        for i, e in enumerate(etcd)
    ]
    return {"coordinators": rows, "etcd_pid": pid}


def test_several_coordinators_with_every_etcd_member_answering_are_ok():
    c = only(facts(role="coordinator", control=_control(["ok", "ok", "ok"])), "control")
    assert c.level == OK and "3 of 3" in c.detail and "c0 leads" in c.detail


def test_one_coordinator_lost_of_three_warns_naming_it_and_the_way_out():
    c = only(facts(role="coordinator", control=_control(["ok", "unreachable", "ok"])), "control")
    assert c.level == WARN and "2 of 3" in c.detail and "c1" in c.detail
    assert "meshrun coordinator remove c1" in c.fix


def test_a_coordinator_without_a_majority_blocks_and_explains_quorum():
    c = only(facts(role="coordinator", control=_control(["ok", "unreachable", "unreachable"])), "control")
    assert c.level == FAIL and "no majority" in c.detail and "1 of 3" in c.detail and "2 are needed" in c.detail
    assert "--force-new-cluster" in c.fix and "c1, c2" in c.fix
    assert doctor.blocking(doctor.judge(facts(role="coordinator", control=_control(["ok", "unreachable", "x"]))))


def test_without_a_majority_the_way_out_names_the_others_never_this_coordinator():
    """Its own member answers nothing without a majority, and the rows are named by overlay address then: the
    advice once said to bring back this coordinator's own address with `meshrun up` there."""
    control = _control(["unreachable", "unreachable", "unreachable"])
    for row in control["coordinators"]:
        row["name"] = row["overlay_ip"]
    c = only(facts(role="coordinator", name="c0", overlay_ip="10.0.0.0", control=control), "control")
    assert c.level == FAIL and "bring back 10.0.0.1, 10.0.0.2 (" in c.fix, c.fix
    assert "10.0.0.0" not in c.fix


def test_a_coordinator_whose_etcd_member_is_down_blocks():
    c = only(facts(role="coordinator", control=_control(["ok", "ok", "ok"], pid=None)), "control")
    assert c.level == FAIL and "not running" in c.detail


def test_extra_tunnels_are_checked_only_where_a_node_asked_for_them():
    assert "tunnels" not in levels(facts(tunnels={"count": 1}))
    up = {
        "count": 3,
        "ports": [51811, 51812],
        "peers": {"b": {"live": [1, 2], "count": 3}, "c": {"live": [1], "count": 2}},  # c runs two
        "error": "",
    }
    c = only(facts(tunnels=up), "tunnels")
    assert c.level == OK and "2 of 2 same-site peers with extra tunnels on all of them" in c.detail
    c = only(
        facts(tunnels=dict(up, peers={"b": {"live": [1, 2], "count": 3}, "c": {"live": [], "count": 3}})), "tunnels"
    )
    assert c.level == OK and "1 answer on none" in c.detail and "(c)" in c.detail
    c = only(facts(tunnels=dict(up, peers={"b": {"live": [], "count": 3}})), "tunnels")
    assert c.level == WARN and "UDP 51811-51812" in c.fix
    c = only(facts(tunnels=dict(up, peers={})), "tunnels")
    assert c.level == OK and "no same-site peer on the private path runs extra tunnels yet" in c.detail
    c = only(facts(tunnels={"count": 3, "error": "wireguard-go exited", "peers": {}}), "tunnels")
    assert c.level == WARN and "wireguard-go exited" in c.detail and "--tunnels 1" in c.fix


@pytest.mark.parametrize("role", ["coordinator", "node"])
def test_a_removed_member_is_told_so_and_only_what_works_there(role):
    """It gets one check, a FAIL that names who removed it (a coordinator: the one that told it) and the way out;
    never `meshrun up` (which refuses there) nor another member to bring back or remove."""
    facts = {"role": role, "name": "dca-a", "removed": True, "removed_by": "hq-a" if role == "coordinator" else None}
    (check,) = doctor.judge(facts)
    assert (check.name, check.level) == ("membership", doctor.FAIL)
    assert "dca-a" in check.detail and "removed from the network for good" in check.detail
    assert ("hq-a says this coordinator" in check.detail) == (role == "coordinator")
    purge = "meshrun down --purge" if role == "coordinator" else "meshrun leave --purge"
    assert purge in check.fix and "meshrun token create" in check.fix
    assert "meshrun up" not in check.fix and "coordinator remove" not in check.fix
    assert ("coordinator add" in check.fix) == (role == "coordinator")
