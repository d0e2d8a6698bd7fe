"""`meshrun metrics`: a member's status and its coordinator's jobs in Prometheus' text format. Pure.

Built from what `meshrun status --json` and `meshrun jobs --json` hold (meshrun.jobs.metrics gathers them), so
the figures are the ones those commands show. Written for node_exporter's textfile collector (a timer runs
``meshrun metrics --textfile /var/lib/node_exporter/textfile_collector/meshrun.prom``) or any scraper that
reads a file: nothing listens for it, so it adds no port to a member.

Conventions (prometheus.io/docs/practices/naming): base units (seconds, bytes), times as unix timestamps
(``*_timestamp_seconds``, so an age is ``time() - x`` in a query), counters end in ``_total``, text as labels of
an ``*_info`` gauge whose value is 1. No key, endpoint or address outside the overlay is exported.

Jobs: every job that has not ended, and those that ended within JOB_ENDED_KEEP_S (an alert on a failed job
sees it at least one scrape); older ones are in `meshrun jobs`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

JOB_ENDED_KEEP_S = 3600
_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*\Z")
_TYPES = ("gauge", "counter")


@dataclass
class Family:
    """One metric: its name, type (gauge or counter), help text and samples ({label: value}, number)."""

    name: str
    type: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float | int | bool | None, **labels: str) -> None:
        """A sample; a value of None (not known) is left out, as a missing series is in Prometheus."""
        if value is not None:
            self.samples.append((labels, float(value)))


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def exposition(families: Iterable[Family]) -> str:
    """The text format (version 0.0.4) of `families`, each with its HELP and TYPE, in the order given. ValueError
    for a name, type or label name the format does not allow (they are ours, never a user's)."""
    out = []
    for f in families:
        if not _NAME_RE.match(f.name) or f.type not in _TYPES:
            raise ValueError(f"metric {f.name!r} of type {f.type!r}")
        out.append(f"# HELP {f.name} {f.help.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        out.append(f"# TYPE {f.name} {f.type}")
        for labels, value in f.samples:
            for k in labels:
                if not _LABEL_RE.match(k) or k.startswith("__"):
                    raise ValueError(f"label {k!r} of {f.name}")
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            out.append(f"{f.name}{{{text}}} {_number(value)}" if text else f"{f.name} {_number(value)}")
    return "\n".join(out) + "\n"


def member_families(st: dict, version: str) -> list[Family]:
    """The member and its WireGuard peers, from `meshrun status --json`'s dict `st` (gathered without
    measuring latency); `version`: meshrun's."""
    info = Family("meshrun_member_info", "gauge", "This member: network, name, role, overlay address, meshrun version.")
    info.add(
        1,
        network=st.get("network", ""),
        name=st.get("name", ""),
        role=st.get("role", ""),
        overlay_ip=st.get("overlay_ip", ""),
        version=version,
    )
    up = Family("meshrun_interface_up", "gauge", "Whether the overlay's WireGuard interface exists.")
    up.add(bool(st.get("interface_up")), interface=st.get("interface", ""))
    daemon = Family("meshrun_daemon_running", "gauge", "Whether the member's daemon (agent or coordinator) runs.")
    daemon.add(st.get("daemon_pid") is not None)
    peers = st.get("peers") or []
    count = Family("meshrun_peers", "gauge", "WireGuard peers on the overlay interface.")
    count.add(len(peers))
    path = Family(
        "meshrun_peer_info", "gauge", "Each peer: its overlay address, whether it is a coordinator, the path it takes."
    )
    handshake = Family(
        "meshrun_peer_last_handshake_timestamp_seconds", "gauge", "When the peer's latest WireGuard handshake was."
    )
    rx = Family("meshrun_peer_receive_bytes_total", "counter", "Bytes received from the peer on the overlay interface.")
    tx = Family("meshrun_peer_transmit_bytes_total", "counter", "Bytes sent to the peer on the overlay interface.")
    mtu = Family("meshrun_peer_mtu_bytes", "gauge", "The MTU of the route to the peer.")
    tunnels = Family("meshrun_peer_tunnels", "gauge", "WireGuard tunnels carrying the pair's flows now.")
    for p in peers:
        peer = {"peer": str(p.get("name", "?")), "overlay_ip": str(p.get("overlay_ip", ""))}
        path.add(1, **peer, coordinator=str(bool(p.get("coordinator"))).lower(), path=str(p.get("path", "")))
        handshake.add(p.get("latest_handshake"), **peer)
        rx.add(p.get("rx_bytes"), **peer)
        tx.add(p.get("tx_bytes"), **peer)
        mtu.add(p.get("mtu"), **peer)
        tunnels.add(p.get("tunnels"), **peer)
    out = [info, up, daemon, count, path, handshake, rx, tx, mtu, tunnels]
    pairs = st.get("pairs")
    if pairs is not None:  # a coordinator: every pair of nodes and the path it decided
        pair = Family("meshrun_pair_info", "gauge", "Each pair of nodes and the path the coordinator decided for it.")
        for q in pairs:
            pair.add(1, a=str(q.get("a", "")), b=str(q.get("b", "")), path=str(q.get("path", "")),
                     relay=str(q.get("relay") or ""))  # fmt: skip
        out.append(pair)
    return out


def job_families(jobs: Sequence[dict], now: float) -> list[Family]:
    """This coordinator's jobs, from `meshrun jobs --json`'s records: those not ended, and those that ended
    within JOB_ENDED_KEEP_S of `now`."""
    info = Family("meshrun_job_info", "gauge", "Each job: its state, its workers' kind, the node with rank 0.")
    ranks = Family("meshrun_job_ranks", "gauge", "The job's ranks (workers in all).")
    nodes = Family("meshrun_job_nodes", "gauge", "The job's nodes.")
    started = Family("meshrun_job_start_timestamp_seconds", "gauge", "When the job's ranks started.")
    ended = Family("meshrun_job_end_timestamp_seconds", "gauge", "When the job ended.")
    exit_code = Family("meshrun_job_exit_code", "gauge", "The job's exit code, once it ended.")
    step = Family("meshrun_job_step", "gauge", "Rank 0's latest step (meshrun.train.report or a tqdm bar).")
    total = Family("meshrun_job_steps", "gauge", "The steps rank 0 said it will take.")
    rate = Family("meshrun_job_steps_per_second", "gauge", "Rank 0's steps a second lately.")
    last = Family("meshrun_job_last_output_timestamp_seconds", "gauge", "When the job's newest output line arrived.")
    regroups = Family("meshrun_job_regroups_total", "counter", "How often the job's group re-formed (a lost node).")
    reported = Family(
        "meshrun_job_reported", "gauge", "The numbers rank 0 last reported with meshrun.train.report, by name."
    )
    for r in jobs:
        if r.get("ended") is not None and now - float(r["ended"]) > JOB_ENDED_KEEP_S:
            continue
        job = {"job": str(r.get("job_id", ""))}
        info.add(1, **job, state=str(r.get("state", "")), workers=str(r.get("workers") or ""),
                 rank0=str(r.get("rank0") or ""))  # fmt: skip
        ranks.add(r.get("ranks"), **job)
        nodes.add(len(r.get("nodes") or []), **job)
        started.add(r.get("started"), **job)
        ended.add(r.get("ended"), **job)
        exit_code.add(r.get("exit_code"), **job)
        progress = r.get("progress") or {}
        step.add(progress.get("step"), **job)
        total.add(progress.get("total"), **job)
        rate.add(progress.get("rate"), **job)
        last.add(r.get("last_output"), **job)
        regroups.add(r.get("regroups", 0), **job)
        for name, value in sorted((progress.get("numbers") or {}).items()):
            reported.add(value, **job, name=str(name))
    return [info, ranks, nodes, started, ended, exit_code, step, total, rate, last, regroups, reported]
