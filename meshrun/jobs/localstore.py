"""The rendezvous store for `meshrun train --local` shares: opt-in, its own process, its memory capped.

Jobs that `meshrun train` runs get a store of their own from their supervisor, reachable only from
their nodes. Shares started by hand or by a batch scheduler on every node (`--local`) meet at a
store on the coordinator's overlay address, port rdzv_port, which every member can reach (meshrun
does not know which nodes such a job has). It is therefore not started unless the operator asks
(`meshrun local-store start`), it never runs inside the coordinator daemon, and its data is capped
(RLIMIT_DATA: a member that floods it gets refused writes, nobody else's memory is at risk).

``python -m meshrun.jobs.localstore STATE_DIR MAX_MB`` is the process; `start`, `stop` and
`status` drive it from the command line.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading

from meshrun.errors import MeshrunError, NetworkError, StateError
from meshrun.mesh import member
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine import host, procs
from meshrun.system.sockets import tcpstore

__all__ = ["start", "stop", "status", "DEFAULT_MAX_MB"]

log = logging.getLogger("meshrun.jobs.localstore")

DEFAULT_MAX_MB = 256
LOCK = "local-store.lock"


def _coordinator(state: StateDir):
    rec, network = member.load(state)
    if rec.get("role") != "coordinator":
        raise StateError(
            f"{state.path} belongs to a node; the local store runs on the coordinator",
            "run `meshrun local-store start` on the coordinator",
        )
    # With several coordinators, this one's own address (the network's names the first one).
    return dataclasses.replace(network, coordinator_ip=str(rec.get("overlay_ip") or network.coordinator_ip))


def start(state: StateDir, max_mb: int = DEFAULT_MAX_MB) -> int:
    """Start the store process (StateError if it runs already); its PID once it listens."""
    network = _coordinator(state)
    lock = procs.DaemonLock(state / LOCK)
    if lock.held():
        raise StateError(
            f"the local store already runs (pid {lock.holder() or '?'})", "`meshrun local-store stop` first"
        )
    return procs.spawn_daemon(
        [sys.executable, "-m", "meshrun.jobs.localstore", str(state.path), str(max_mb)],
        state / "local-store.out",
        timeout=90,
        what=f"the local rendezvous store on {network.coordinator_ip}:{network.rdzv_port}",
    )


def stop(state: StateDir) -> bool:
    """Stop the store; False if it was not running."""
    return procs.DaemonLock(state / LOCK).stop(timeout=10)


def status(state: StateDir) -> int | None:
    """The store's PID, or None when it does not run."""
    return procs.DaemonLock(state / LOCK).holder()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not args[1].isdigit():
        sys.stderr.write("usage: python -m meshrun.jobs.localstore STATE_DIR MAX_MB\n")
        return 2
    state, max_mb = StateDir(args[0]), int(args[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        lock = procs.DaemonLock(state / LOCK).acquire("the local rendezvous store")
        network = _coordinator(state)
        store = tcpstore.serve_store(network.coordinator_ip, network.rdzv_port, network.interface, multi_tenant=True)
        # After torch and the store are up: what the store holds from now on is what the cap bounds.
        host.cap_data(max_mb << 20)
    except (MeshrunError, OSError, RuntimeError) as exc:
        procs.notify_error(
            exc
            if isinstance(exc, MeshrunError)
            else NetworkError(
                f"cannot host the local rendezvous store: {exc}", "free the port, or check the overlay interface"
            )
        )
        return 1
    stopping = threading.Event()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stopping.set())
    log.info(
        "local rendezvous store on %s:%d (data capped at %d MiB)", network.coordinator_ip, network.rdzv_port, max_mb
    )
    procs.notify_ready()
    stopping.wait()
    del store
    lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
