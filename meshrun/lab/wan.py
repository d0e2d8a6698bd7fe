"""A WAN between two nodes of a testbed on a kernel without sch_netem: latency and loss on their public path.

`delayed` queues every packet between the two nodes' public addresses, both ways, in the testbed's internet
namespace (iptables NFQUEUE in its FORWARD chain) to meshrun.system.kernel.delayline, which drops each with the
loss probability and releases the rest after half the round trip. Overlay traffic between the pair (WireGuard's
datagrams) then sees the WAN; nothing else does. The rules and the process go when the block ends, whatever
happened inside it. Where the kernel has sch_netem, DatacenterSpec.delay_ms shapes whole datacenters instead.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Iterator

from meshrun.errors import NetworkError
from meshrun.lab.testbed import Node, World, sh
from meshrun.system.machine import procs

QUEUE = 7  # NFQUEUE number in the internet namespace


@contextlib.contextmanager
def delayed(world: World, a: str, b: str, rtt_ms: float, loss_pct: float = 0.0, queue: int = QUEUE) -> Iterator[dict]:
    """Give the public path between nodes `a` and `b` a round trip of `rtt_ms` more and `loss_pct` % loss each way.

    Yields a dict that holds, once the block has ended, the delay line's counters (packets, dropped, its CPU
    seconds; ``error`` if it printed none). Raises NetworkError if the delay line does not start.
    """
    an, bn = world.node(a), world.node(b)
    if not (an.public_ip and bn.public_ip):
        raise NetworkError(f"{a} and {b} need public addresses for a WAN between them", "pick nodes behind NAT")
    ipt = ["ip", "netns", "exec", world.inet, "iptables", "-w"]
    rules = [
        ["FORWARD", "-s", src, "-d", dst, "-j", "NFQUEUE", "--queue-num", str(queue)]
        for src, dst in ((an.public_ip, bn.public_ip), (bn.public_ip, an.public_ip))
    ]
    argv = ["ip", "netns", "exec", world.inet, sys.executable, "-m", "meshrun.system.kernel.delayline"]
    argv += ["--queue", str(queue), "--delay-ms", f"{rtt_ms / 2:g}", "--loss-pct", f"{loss_pct:g}"]
    line = procs.popen(argv, stdout=procs.PIPE, stderr=procs.PIPE, text=True)
    stats: dict = {}
    added: list[list[str]] = []
    try:
        if line.stdout.readline().strip() != "READY":
            line.wait(timeout=10)
            raise NetworkError(
                f"the WAN's delay line did not start: {line.stderr.read().strip()[-500:]}",
                "the kernel needs NFQUEUE (CONFIG_NETFILTER_NETLINK_QUEUE) and iptables its NFQUEUE target",
            )
        for rule in rules:
            sh([*ipt, "-A", *rule])
            added.append(rule)
        yield stats
    finally:
        for rule in added:
            sh([*ipt, "-D", *rule], check=False)
        if line.poll() is None:
            line.terminate()
        try:
            out, err = line.communicate(timeout=10)
        except procs.TimeoutExpired:
            line.kill()
            out, err = line.communicate()
        m = re.search(r"^STATS (\{.*\})$", out or "", re.M)
        stats.update(json.loads(m.group(1)) if m else {"error": (err or "")[-1000:]})


def rtt_ms(node: Node, dst: str, count: int = 5) -> float | None:
    """The mean ping round trip from `node` to `dst` in ms (`count` pings 0.2 s apart); None if nothing answered."""
    res = node.run("ping", "-c", str(count), "-i", "0.2", "-W", "2", "-q", dst, check=False, timeout=count + 20)
    m = re.search(r"= [\d.]+/([\d.]+)/", res.stdout)
    return float(m.group(1)) if m else None
