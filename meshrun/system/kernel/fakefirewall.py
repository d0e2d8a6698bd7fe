"""An in-memory stand-in for meshrun.system.kernel.firewall, for tests that must not touch the kernel.

`FakeFirewall` has the module's calls as methods (pass it where a caller takes the module, e.g.
`JobAPI(guards=FakeFirewall())`), and `FakeFirewall.JobGuard(...)` makes `FakeJobGuard`s with the real
class's methods. Every call checks its arguments as the real one does (the same pure renderer, so a bad job
id, interface or address raises the same UsageError), keeps the state the kernel would (tables in this
"namespace", members of each job's cgroup) and is recorded in `calls` as (name, args...) in call order.

The protocol, as the callers follow it:

- `JobGuard(job_id, node, interface, gate=None)`: no effect; names the guard of one job on one member (`gate`:
  its processes alone reach its ports from the member, `job_gate(job_id, network)`).
- `guard.create(allowed)`: before anything of the job listens (the share before torchrun, the supervisor
  before its store); the table exists afterwards, its set is `allowed`.
- `guard.join(pid=0)`: right after `create`, moving the share (or the supervisor) into the job's cgroup so
  that everything it starts is guarded.
- `guard.allow(ips)` / `allow(job_id, node, ips)`: when an elastic job admits a node, in the process that
  holds the guard / in the agent on the member that runs the share. Raises like nft when the table is gone.
- `guard.remove()`: after the job's processes ended, or after a failed start; safe to repeat.
- `sweep()`: when the agent starts (and now and then): removes guards whose cgroup has no process left.
- `job_tables()`: the job guards' tables present (what a sweep would look at).
- `install_forward_guard(interface)` / `remove_forward_guard()`: before a member turns forwarding on /
  when it stops forwarding.
- `remove_job_cgroups(tables)`: the testbed, after tearing its namespaces down.
- `available()`: None here (guards can always be made).
"""

from __future__ import annotations

from collections.abc import Iterable

from meshrun.core import firewall as rules
from meshrun.core.model import STORE_PORTS, Network
from meshrun.errors import CommandError
from meshrun.system.kernel.firewall import DEFAULT_LOCAL_PORTS


class FakeJobGuard:
    """`meshrun.system.kernel.firewall.JobGuard` on a FakeFirewall."""

    def __init__(
        self, fw: FakeFirewall, job_id: str, node: str, interface: str, gate: rules.ProcessGate | None = None
    ) -> None:
        self.fw = fw
        self.table = rules.job_table(job_id, node)
        self.comment = f"meshrun job {job_id} on {node}"
        self.interface = rules.check_interface(interface)
        self.gate = gate

    def create(self, allowed: Iterable[str]) -> FakeJobGuard:
        allowed = list(allowed)
        rules.job_guard(self.table, self.comment, self.interface, allowed, self.gate)  # the real checks
        self.fw.calls.append(("create", self.table, self.interface, allowed))
        self.fw.tables[self.table] = set(allowed)
        self.fw.cgroups.setdefault(self.table, set())
        return self

    def join(self, pid: int = 0) -> None:
        self.fw.calls.append(("join", self.table, pid))
        if self.table not in self.fw.cgroups:
            raise FileNotFoundError(f"no cgroup for {self.table}")  # the real one's OSError
        self.fw.cgroups[self.table].add(pid)

    def allow(self, ips: Iterable[str]) -> None:
        self.fw._allow(self.table, list(ips))

    def remove(self) -> None:
        self.fw.calls.append(("remove", self.table))
        self.fw.tables.pop(self.table, None)
        self.fw.cgroups.pop(self.table, None)


class FakeFirewall:
    """Records calls and keeps tables and cgroup members in memory (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.tables: dict[str, set[str]] = {}  # job guard table -> admitted addresses
        self.cgroups: dict[str, set[int]] = {}  # job guard table -> pids that joined (0: the caller)
        self.forward: str | None = None  # the forward guard's interface, when installed
        self.allowed: list[tuple[str, str, list[str]]] = []  # every module-level allow(job_id, node, ips)
        self.sweeps = 0

    def JobGuard(  # named as the real module's class
        self, job_id: str, node: str, interface: str, gate: rules.ProcessGate | None = None
    ) -> FakeJobGuard:
        return FakeJobGuard(self, job_id, node, interface, gate)

    def job_gate(self, job_id: str, network: Network) -> rules.ProcessGate:
        return rules.job_gate(job_id, network.rdzv_port, STORE_PORTS, network.api_port, DEFAULT_LOCAL_PORTS)

    def _allow(self, table: str, ips: list[str]) -> None:
        rules.add_allowed(table, ips)  # the same checks as the real one
        self.calls.append(("allow", table, ips))
        if table not in self.tables:
            raise CommandError(f"`nft -f -` failed: no table inet {table}", "see the command's error above")
        self.tables[table].update(ips)

    def allow(self, job_id: str, node: str, ips: Iterable[str]) -> None:
        ips = list(ips)
        table = rules.job_table(job_id, node)
        rules.add_allowed(table, ips)
        self.allowed.append((job_id, node, ips))
        if table in self.tables:  # a guard made through this fake: extend it
            self._allow(table, ips)
        else:  # made by a share this fake never saw: recorded only
            self.calls.append(("allow", table, ips))

    def job_tables(self) -> list[str]:
        return sorted(self.tables)

    def sweep(self) -> list[str]:
        """Removes the guards whose cgroup no process joined (the real one also keeps young ones)."""
        self.sweeps += 1
        gone = sorted(t for t in self.tables if not self.cgroups.get(t))
        for t in gone:
            self.tables.pop(t)
            self.cgroups.pop(t, None)
        self.calls.append(("sweep", gone))
        return gone

    def remove_job_cgroups(self, tables: Iterable[str]) -> None:
        tables = [t for t in tables if rules.is_job_table(t)]
        self.calls.append(("remove_job_cgroups", tables))
        for t in tables:
            self.cgroups.pop(t, None)

    def install_forward_guard(self, interface: str) -> None:
        rules.forward_guard(interface)
        self.calls.append(("install_forward_guard", interface))
        self.forward = interface

    def remove_forward_guard(self, interface: str | None = None) -> None:
        if interface is not None:
            rules.forward_unguard(interface)
        self.calls.append(("remove_forward_guard",))
        if interface is None or interface == self.forward:
            self.forward = None

    def available(self) -> str | None:
        return None
