"""Run this member's daemon in this process: the coordinator service or the node agent, by role."""

from __future__ import annotations

from collections.abc import Sequence

from meshrun.errors import MeshrunError
from meshrun.mesh import member, process
from meshrun.mesh.node.daemon import AgentService
from meshrun.mesh.process import ExtensionFactory
from meshrun.system.files.statedir import StateDir


def serve(
    state: StateDir,
    foreground: bool = False,
    node_extensions: Sequence[ExtensionFactory] = (),
    coordinator_extensions: Sequence[ExtensionFactory] = (),
) -> None:
    """Set up the daemon's log and run its service until SIGTERM/SIGINT (or its role changed: then the service
    of its new role).

    `foreground` (systemd, `--foreground`) also logs to stderr; `node_extensions` run beside a
    node's agent and `coordinator_extensions` beside the coordinator (the caller, which knows the
    layers above mesh, passes the job API and job control). An error
    before the service runs is reported to whoever spawned us (`meshrun init`/`join`/`up` show it)
    and re-raised.
    """
    process.setup_logging(state, foreground)
    # The lock first: building a service may take a while (a coordinator waits there for a majority of the
    # coordinators after a power cut), and another `meshrun up` meanwhile must find this daemon running.
    with process.running(state):
        process.done_waiting(state)  # a daemon killed while it waited left its note
        while True:
            try:
                rec, _ = member.load(state)
                if rec["role"] == "coordinator":
                    from meshrun.mesh.coordinator.daemon import CoordinatorService

                    svc = CoordinatorService(state, extensions=coordinator_extensions)
                else:
                    svc = AgentService(state, extensions=node_extensions)
            except MeshrunError as err:
                process.failed(err)
                raise
            svc.run()
            # A node made a coordinator (`meshrun coordinator add`), or a coordinator made a node again
            # (`remove`), stops its service after rewriting member.json: the daemon goes on in its new role,
            # same process.
            if not svc.role_changed:
                return
