"""torch.distributed TCPStore servers that answer on the overlay only.

`TCPStore(..., is_master=True)` binds the wildcard whatever host it is given, so anyone who can
reach the port from the internet could read and write the rendezvous state that every torchrun
agent unpickles. meshrun binds the listening socket itself, to the overlay address and the
WireGuard device, and hands it to the store through `master_listen_fd`.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable

from meshrun.system.kernel import lanlink


def listener(ip: str, port: int = 0, device: str | None = None, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on ip:port (0: a free port), bound to `device` when given (to the address alone
    where this host has a site LAN path beside `device`: meshrun.system.kernel.lanlink.bind_device)."""
    device = lanlink.bind_device(device)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if device:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
        sock.bind((ip, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def import_torch_early() -> threading.Thread:
    """Start importing what `serve_store` needs (torch.distributed, about 2-3 s on a 2-core machine) in a thread,
    so that a caller who will host a store later waits for less of it then; returns the thread (not a daemon:
    an interpreter ending mid-import would be torn down under it)."""

    def load() -> None:
        try:
            import torch.distributed  # noqa: F401
        except Exception:  # noqa: BLE001 - serve_store imports it again and raises there, where it matters
            pass

    t = threading.Thread(target=load, name="import-torch", daemon=False)
    t.start()
    return t


def serve_store(ip: str, port: int = 0, device: str | None = None, multi_tenant: bool = False):
    """A TCPStore server listening on ip:port (bound to `device`) only; read its port from `.port`.

    Raises OSError if the address cannot be bound. Imports torch (slow): call it where torch is used.
    """
    from torch.distributed import TCPStore

    sock = listener(ip, port, device)
    bound = sock.getsockname()[1]
    # The store takes the descriptor over (it closes it when the store goes).
    return TCPStore(
        ip, bound, is_master=True, wait_for_workers=False, multi_tenant=multi_tenant, master_listen_fd=sock.detach()
    )


def serve_store_in(ip: str, ports: Iterable[int], device: str | None = None, multi_tenant: bool = False):
    """`serve_store` at the first of `ports` that is free on `ip`; None when none is (or `ports` is empty)."""
    for port in ports:
        try:
            return serve_store(ip, port, device, multi_tenant)
        except (OSError, RuntimeError):  # taken (torch reports some bind failures as RuntimeError)
            continue
    return None
