"""meshrun.core.etcdconf: the etcd flags of a coordinator's member (overlay only, TLS both ways, WAN timing).

tests/unit/system/test_etcd.py starts a real etcd with these flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.core.etcdconf import client_url, peer_url, server_argv, url_host
from meshrun.errors import UsageError

CLUSTER = {
    "coord-b": "https://10.7.0.3:2380",
    "coord-a": "https://10.7.0.2:2380",
    "coord-c": "https://10.7.0.4:2380",
}
TLS = Path("/var/lib/meshrun/etcd-tls")


def flags(argv: list[str]) -> dict[str, str]:
    """{flag: value} of `--flag value` pairs and `--flag=value`; a bare `--flag` maps to ""."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        assert name.startswith("--"), argv[i]
        if eq:
            out[name] = value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[name], i = argv[i + 1], i + 1
        else:
            out[name] = ""
        i += 1
    return out


def argv(**kw) -> list[str]:
    args = dict(
        name="coord-a",
        data_dir=Path("/var/lib/meshrun/etcd"),
        overlay_ip="10.7.0.2",
        client_port=2379,
        peer_port=2380,
        initial_cluster=CLUSTER,
        cluster_state="new",
        tls_dir=TLS,
    )
    return server_argv(**(args | kw))


def test_a_member_listens_on_its_overlay_address_only():
    f = flags(argv())
    assert f["--listen-client-urls"] == f["--advertise-client-urls"] == "https://10.7.0.2:2379"
    assert f["--listen-peer-urls"] == f["--initial-advertise-peer-urls"] == "https://10.7.0.2:2380"
    assert "--listen-metrics-urls" not in f, "metrics stay on the client URL (TLS, client certificates)"
    text = " ".join(argv())
    for nowhere in ("0.0.0.0", "localhost", "127.0.0.1", "http://", "[::]"):
        assert nowhere not in text


def test_tls_both_ways_with_client_certificates():
    f = flags(argv())
    assert f["--client-cert-auth"] == "" and f["--peer-client-cert-auth"] == ""
    assert f["--trusted-ca-file"] == f["--peer-trusted-ca-file"] == str(TLS / "ca.crt")
    assert f["--cert-file"] == f["--peer-cert-file"] == str(TLS / "etcd.crt")
    assert f["--key-file"] == f["--peer-key-file"] == str(TLS / "etcd.key")


def test_limits_compaction_timing_and_logging():
    f = flags(argv())
    assert f["--max-txn-ops"] == "10000"
    assert (f["--auto-compaction-mode"], f["--auto-compaction-retention"]) == ("revision", "10000")
    assert (f["--heartbeat-interval"], f["--election-timeout"]) == ("100", "1000")
    assert f["--quota-backend-bytes"] == str(1 << 30)
    assert (f["--logger"], f["--log-outputs"]) == ("zap", "stderr")
    assert f["--enable-v2"] == "false" and f["--enable-grpc-gateway"] == "true"
    assert f["--experimental-watch-progress-notify-interval"] == "5s"
    assert f["--name"] == "coord-a" and f["--data-dir"] == "/var/lib/meshrun/etcd"


def test_the_initial_cluster_is_sorted_and_its_token_stable():
    f = flags(argv())
    assert f["--initial-cluster"] == (
        "coord-a=https://10.7.0.2:2380,coord-b=https://10.7.0.3:2380,coord-c=https://10.7.0.4:2380"
    )
    assert f["--initial-cluster-token"] == "meshrun-coord-a"
    assert f["--initial-cluster-state"] == "new"
    reordered = dict(reversed(list(CLUSTER.items())))
    other = flags(argv(name="coord-c", overlay_ip="10.7.0.4", initial_cluster=reordered, cluster_state="existing"))
    assert other["--initial-cluster-token"] == f["--initial-cluster-token"]
    assert other["--initial-cluster"] == f["--initial-cluster"] and other["--initial-cluster-state"] == "existing"


def test_urls_bracket_ipv6():
    assert client_url("10.7.0.2", 2379) == "https://10.7.0.2:2379"
    assert peer_url("fd00::2", 2380) == "https://[fd00::2]:2380"
    f = flags(argv(overlay_ip="fd00::2", initial_cluster={"coord-a": "https://[fd00::2]:2380"}))
    assert f["--listen-client-urls"] == "https://[fd00::2]:2379"


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"name": "Coord_A"}, "member name"),
        ({"name": ""}, "member name"),
        ({"overlay_ip": "0.0.0.0"}, "may not listen"),
        ({"overlay_ip": "::"}, "may not listen"),
        ({"overlay_ip": "localhost"}, "not an IP"),
        ({"overlay_ip": "10.7.0.2:2379"}, "not an IP"),
        ({"client_port": 0}, "client port"),
        ({"peer_port": 70000}, "peer port"),
        ({"peer_port": "2380"}, "peer port"),
        ({"client_port": True}, "client port"),
        ({"peer_port": 2379}, "different ports"),
        ({"cluster_state": "join"}, "cluster state"),
        ({"initial_cluster": {}}, "empty"),
        ({"initial_cluster": {"coord-b": "https://10.7.0.3:2380"}}, "gives coord-a"),
        ({"initial_cluster": CLUSTER | {"coord-a": "https://10.7.0.2:2381"}}, "gives coord-a"),
        ({"initial_cluster": CLUSTER | {"coord-d": "http://10.7.0.5:2380"}}, "not https://IP:PORT"),
        ({"initial_cluster": CLUSTER | {"coord-d": "https://etcd.example:2380"}}, "not an IP"),
        ({"initial_cluster": CLUSTER | {"coord-d": "https://10.7.0.5"}}, "not https://IP:PORT"),
        ({"initial_cluster": CLUSTER | {"Coord-D": "https://10.7.0.5:2380"}}, "member name"),
    ],
)
def test_bad_values_are_usage_errors(kw, needle):
    with pytest.raises(UsageError, match=needle) as err:
        argv(**kw)
    assert err.value.fix


def test_the_address_a_member_url_names():
    assert url_host(client_url("10.77.0.2", 2379)) == "10.77.0.2"
    assert url_host(peer_url("10.77.0.9", 2380)) == "10.77.0.9"
    assert url_host("not a url") == ""
