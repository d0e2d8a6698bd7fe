"""meshrun.core.metrics: a member's status and its jobs in Prometheus' text format, read back with Prometheus'
own parser (prometheus_client), as a scraper would read it."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshrun.core import metrics

NOW = 1_790_000_000.0

STATUS = {
    "network": "lab",
    "role": "coordinator",
    "name": "hq-a",
    "overlay_ip": "10.213.0.1",
    "interface": "meshrun0",
    "interface_up": True,
    "daemon_pid": 4242,
    "peers": [
        {"name": "dc1-a", "overlay_ip": "10.213.0.2", "coordinator": False, "path": "direct (public)",
         "public_key": "SECRET-SHAPED", "endpoint": "203.0.113.9:51820",
         "latest_handshake": NOW - 20, "rx_bytes": 1234, "tx_bytes": 5678, "mtu": 1420, "tunnels": 1},
        # A peer never heard from: no handshake, no sample for it (a missing series, not a zero).
        {"name": 'odd"name\\x', "overlay_ip": "10.213.0.3", "coordinator": False, "path": "relayed via dc1-a",
         "latest_handshake": None, "rx_bytes": 0, "tx_bytes": 92, "mtu": 1420, "tunnels": 1},
    ],
    "pairs": [{"a": "dc1-a", "b": "dc2-a", "path": "relayed", "relay": "dc1-a"}],
}  # fmt: skip

JOBS = [
    {"job_id": "run-1", "state": "running", "nodes": ["dc1-a", "dc2-a"], "ranks": 2, "started": NOW - 600,
     "ended": None, "exit_code": None, "workers": "warm", "rank0": "dc1-a", "last_output": NOW - 3, "regroups": 1,
     "progress": {"step": 120, "total": 1000, "rate": 0.5, "at": NOW - 3, "numbers": {"loss": 2.25, "lr": 3e-4}}},
    {"job_id": "failed-lately", "state": "failed", "nodes": ["dc1-a"], "ranks": 1, "started": NOW - 900,
     "ended": NOW - 60, "exit_code": 1, "workers": "cold", "rank0": "dc1-a", "last_output": NOW - 60,
     "regroups": 0, "progress": {}},
    {"job_id": "old", "state": "succeeded", "nodes": ["dc1-a"], "ranks": 1, "started": NOW - 90000,
     "ended": NOW - 86400, "exit_code": 0, "progress": {}},
]  # fmt: skip


def parsed(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples, metric: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (metric, labels, samples)
    return found[0]


def test_a_coordinators_status_and_jobs_read_back_as_prometheus_reads_them():
    text = metrics.exposition(metrics.member_families(STATUS, "0.1.0+abc") + metrics.job_families(JOBS, NOW))
    fams = parsed(text)
    info = fams["meshrun_member_info"]
    assert value(info, "meshrun_member_info", name="hq-a", role="coordinator", version="0.1.0+abc") == 1
    assert value(fams["meshrun_peers"], "meshrun_peers") == 2
    # Counters are read as counters: the parser strips _total from the family, keeps it on the sample.
    rx = fams["meshrun_peer_receive_bytes"]
    assert value(rx, "meshrun_peer_receive_bytes_total", peer="dc1-a", overlay_ip="10.213.0.2") == 1234
    # A label value with a quote and a backslash survives the round trip.
    assert value(fams["meshrun_peer_transmit_bytes"], "meshrun_peer_transmit_bytes_total", peer='odd"name\\x') == 92
    hs = fams["meshrun_peer_last_handshake_timestamp_seconds"]
    assert [s.labels["peer"] for s in hs] == ["dc1-a"] and hs[0].value == NOW - 20
    assert value(fams["meshrun_peer_info"], "meshrun_peer_info", peer='odd"name\\x', path="relayed via dc1-a") == 1
    assert value(fams["meshrun_pair_info"], "meshrun_pair_info", a="dc1-a", b="dc2-a", relay="dc1-a") == 1
    # Jobs: the running one and the one that failed a minute ago; the one that ended a day ago is left out.
    assert {s.labels["job"]: s.labels["state"] for s in fams["meshrun_job_info"]} == {
        "run-1": "running",
        "failed-lately": "failed",
    }
    assert value(fams["meshrun_job_step"], "meshrun_job_step", job="run-1") == 120
    assert value(fams["meshrun_job_steps"], "meshrun_job_steps", job="run-1") == 1000
    assert value(fams["meshrun_job_steps_per_second"], "meshrun_job_steps_per_second", job="run-1") == 0.5
    assert value(fams["meshrun_job_regroups"], "meshrun_job_regroups_total", job="run-1") == 1
    assert value(fams["meshrun_job_reported"], "meshrun_job_reported", job="run-1", name="loss") == 2.25
    assert value(fams["meshrun_job_exit_code"], "meshrun_job_exit_code", job="failed-lately") == 1
    assert [s.labels["job"] for s in fams["meshrun_job_step"]] == ["run-1"]  # no step known: no sample
    # Nothing that is not the overlay's: no key, no public endpoint.
    assert "SECRET-SHAPED" not in text and "203.0.113.9" not in text


def test_a_node_has_no_pairs_and_no_jobs_and_a_stopped_member_says_so():
    node = {**STATUS, "role": "node", "interface_up": False, "daemon_pid": None, "peers": []}
    del node["pairs"]
    fams = parsed(metrics.exposition(metrics.member_families(node, "0.1.0")))
    assert "meshrun_pair_info" not in fams and "meshrun_job_info" not in fams
    assert value(fams["meshrun_interface_up"], "meshrun_interface_up", interface="meshrun0") == 0
    assert value(fams["meshrun_daemon_running"], "meshrun_daemon_running") == 0
    assert value(fams["meshrun_peers"], "meshrun_peers") == 0


def test_numbers_are_written_as_the_format_spells_them():
    f = metrics.Family("meshrun_x", "gauge", "x")
    for v in (3, 2.5, float("inf"), float("-inf"), float("nan"), True, 1e20):
        f.add(v, i=str(len(f.samples)))
    lines = metrics.exposition([f]).splitlines()[2:]
    assert [line.split()[-1] for line in lines] == ["3", "2.5", "+Inf", "-Inf", "NaN", "1", "1e+20"]
    back = [s.value for s in parsed(metrics.exposition([f]))["meshrun_x"]]
    assert back[:4] == [3, 2.5, math.inf, -math.inf] and math.isnan(back[4])


@pytest.mark.parametrize(
    "family", [metrics.Family("bad-name", "gauge", "x"), metrics.Family("meshrun_x", "histogram", "x")]
)
def test_a_name_or_type_the_format_does_not_allow_is_refused(family):
    with pytest.raises(ValueError):
        metrics.exposition([family])


def test_a_label_name_the_format_does_not_allow_is_refused():
    f = metrics.Family("meshrun_x", "gauge", "x")
    f.add(1, **{"__reserved": "y"})
    with pytest.raises(ValueError):
        metrics.exposition([f])
