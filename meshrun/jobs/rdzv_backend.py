"""torchrun's rendezvous backend `meshrun`: c10d rendezvous at the coordinator, with every store on the overlay.

Registered for torchrun through the `torchrun.handlers` entry point (pyproject.toml), so a node's
torchrun runs ``--rdzv-backend meshrun``. It is torch's own c10d dynamic rendezvous
(`DynamicRendezvousHandler` over the c10d backend, the coordinator's store as its client) with one
change, in two parts: the store the rank-0 node's torchrun agent serves for its workers
(`_create_tcp_store_server`, which torch binds to the wildcard) listens on this node's overlay
address and WireGuard device only ($MESHRUN_INTERFACE, set by meshrun's launch plan), and it is
made anew for every rendezvous round, so workers restarted after a membership change never read
the previous round's addresses. Workers reach it as before, at the address torchrun announces
(`--local-addr`, the overlay IP).
"""

from __future__ import annotations

import os

BACKEND = "meshrun"


def handler_factory():
    """The `torchrun.handlers` entry point: torch calls it and registers what it returns."""
    return create_handler


def create_handler(params):
    """torch.distributed.elastic's c10d rendezvous handler, with an overlay-bound agent store."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from meshrun.system.tcpstore import serve_store

    class OverlayRendezvousHandler(dr.DynamicRendezvousHandler):
        def get_backend(self) -> str:
            return BACKEND

        def _create_tcp_store_server(self, master_addr, master_port):
            return serve_store(master_addr, master_port or 0, os.environ.get("MESHRUN_INTERFACE"), multi_tenant=True)

        def next_rendezvous(self):
            # torch keeps the first round's agent store for every later round (pytorch/pytorch#135712):
            # after a restart the workers read the previous attempt's addresses from it, and when the
            # rank-0 node was the one lost, every survivor still points at it. A store per round, its
            # address published under that round's prefix, avoids both; the old one closes with it.
            self._shared_tcp_store_server = None
            self._bootstrap_store_info = None
            return super().next_rendezvous()

    backend, store = c10d_rendezvous_backend.create_backend(params)
    # What dynamic_rendezvous.create_handler does, building our subclass instead.
    timeout = dr.RendezvousTimeout(
        dr._get_timeout(params, "join"),
        dr._get_timeout(params, "last_call"),
        dr._get_timeout(params, "close"),
        dr._get_timeout(params, "heartbeat"),
    )
    return OverlayRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )
