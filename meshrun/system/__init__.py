"""Side effects: the only code that runs processes or touches the kernel, sockets and disk.

Grouped by what it touches, one concern per module, fakes beside what they fake:

- `machine/`: running programs (the one subprocess wrapper), processes and daemons, what the host has.
- `kernel/`: the kernel's network: WireGuard devices, nftables and job cgroups, routes, the site LAN path's
  VXLAN device, a relay's kernel fast path.
- `sockets/`: sockets and the servers on them: HTTP transport, the event-loop servers, the public TLS port,
  probes, a relay's UDP ports, the bench's TCP tests, overlay-bound TCPStores.
- `files/`: a member's state directory and the files jobs leave: logs, projects, what ships, tensors.
- `control/`: the coordinator's control state (`ControlState`), kept in SQLite for one coordinator or in etcd
  for several, and the etcd client and member process behind the latter.

Every module above this layer reaches the system only through these.
"""
