"""Side effects: the only code that runs processes or touches the kernel, sockets and disk.

Each concern lives in one module (device, net, probe, statedir, coordinatordb, transport, procs, ...), and
every module above this layer reaches the system only through them.
"""
