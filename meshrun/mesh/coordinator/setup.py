"""`meshrun init` and `meshrun down`: create the network on the coordinator, or take it down.

`plan_network` is pure (options + the machine's routes -> Network); `init` computes everything
first, then applies, and undoes what it applied if a step fails.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from meshrun.core import ipam, keys
from meshrun.core.model import (
    DEFAULT_IFACE,
    DEFAULT_MTU,
    DEFAULT_PORT,
    Network,
    check_interface,
    check_mtu,
    check_name,
    check_port,
    parse_endpoint,
    refuse_ipv6,
)
from meshrun.core.token import new_token, parse_duration
from meshrun.errors import NetworkError, StateError, UsageError
from meshrun.mesh import iface, process
from meshrun.system.control.coordinatordb import CoordinatorDB
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import net
from meshrun.system.kernel.device import Device

DEFAULT_TTL = "12h"


@dataclass(frozen=True)
class InitOptions:
    endpoint: str | None = None
    cidr: str = ipam.DEFAULT_CIDR
    port: int = DEFAULT_PORT
    interface: str = DEFAULT_IFACE
    mtu: int = DEFAULT_MTU
    name: str = "meshrun"
    token_ttl: str = DEFAULT_TTL
    token_uses: int | None = None
    train: bool = False  # the coordinator takes a share of every job
    coordinator_name: str = "coordinator"  # this member's name (`meshrun init --name`), as nodes and jobs show it


@dataclass(frozen=True)
class InitResult:
    network: Network
    token: str
    backend: str
    state_dir: Path
    daemon_pid: int | None
    warning: str | None = None  # what the interface costs (an old wireguard-go), with the fix


def check_token_uses(uses: int | None) -> None:
    if uses is not None and uses < 1:
        raise UsageError(f"--uses {uses} must be at least 1", "leave it out for unlimited uses until expiry")


def check_init_options(opts: InitOptions) -> None:
    """Raise UsageError for any init option that is wrong on its own (no system needed)."""
    check_name(opts.name, "--network")
    check_name(opts.coordinator_name, "--name")
    check_interface(opts.interface)
    check_port(opts.port)
    check_mtu(opts.mtu)
    parse_duration(opts.token_ttl)
    check_token_uses(opts.token_uses)
    ipam.parse_cidr(opts.cidr)
    if opts.endpoint:
        _endpoint(opts.endpoint, opts.port)


def _endpoint(host: str, port: int) -> str:
    refuse_ipv6(host)
    try:
        return parse_endpoint(host, default_port=port)
    except ValueError as exc:
        raise UsageError(
            f"--endpoint {host!r} is not HOST or HOST:PORT ({exc})",
            "e.g. --endpoint 203.0.113.1 or --endpoint vpn.example.com:51820",
        ) from None


def plan_network(
    opts: InitOptions, routes: list[tuple[str, str]], fallback_host: str | None, public_key: str, fingerprint: str
) -> Network:
    """Validate init options against the machine's routes and return the Network (pure)."""
    check_init_options(opts)
    cidr = ipam.parse_cidr(opts.cidr)
    ipam.check_overlap(cidr, [(d, dev) for d, dev in routes if dev != opts.interface])
    host = opts.endpoint or fallback_host
    if not host:
        raise UsageError(
            "no --endpoint given and this machine has no default route to guess one from",
            "pass the address nodes reach this machine at, e.g. --endpoint 203.0.113.1",
        )
    endpoint = _endpoint(host, opts.port)
    return Network(
        name=opts.name,
        cidr=str(cidr),
        interface=opts.interface,
        listen_port=opts.port,
        mtu=opts.mtu,
        coordinator_ip=str(ipam.coordinator_address(cidr)),
        coordinator_public_key=public_key,
        endpoints=(endpoint,),
        fingerprint=fingerprint,
        api_port=opts.port + 1,
    )


def init(opts: InitOptions, state: StateDir, start: bool = True, device: Device | None = None) -> InitResult:
    """Create the network: state, keys, certificate, interface, daemon, first token.

    Computes everything first, then applies; if any step fails, what was applied is undone
    (interface removed, state files deleted) before the error propagates.
    """
    if state.exists:
        role = state.read_json("member.json").get("role")
        raise StateError(
            f"{state.path} already holds a meshrun {role}",
            "start it with `meshrun up`, or remove it with `meshrun down --purge` first",
        )
    # Bad options are reported before missing privileges: the user fixes one thing at a time.
    check_init_options(opts)
    if device is None:  # an injected (test) device needs no privileges
        net.require_admin()
        net.require_tools("ip", "wg")
    private_key = keys.generate_private_key()
    # A common name that tells an internet scanner nothing about the network.
    cert_pem, tls_key_pem = keys.generate_tls_identity("meshrun")
    fallback = None if opts.endpoint else net.default_route_address()
    network = plan_network(
        opts, net.local_routes(), fallback, keys.public_key(private_key), keys.cert_fingerprint(cert_pem)
    )
    device = device or iface.device_for(state, network)
    if device.exists():
        raise NetworkError(
            f"network interface {network.interface} already exists",
            "run `meshrun down` if it is a leftover of meshrun, or pick another --interface",
        )
    ttl = parse_duration(opts.token_ttl)

    created_dir = state.create()
    undo: list = []
    try:
        state.write("private.key", private_key + "\n", secret=True)
        undo.append(lambda: state.remove("private.key"))
        state.write("tls.key", tls_key_pem, secret=True)
        state.write("tls.crt", cert_pem)
        undo.append(lambda: state.remove("tls.key", "tls.crt"))
        db = CoordinatorDB.create(state / "coordinator.db")
        undo.append(lambda: state.remove("coordinator.db", "coordinator.db-wal", "coordinator.db-shm"))
        db.set_meta(network=json.dumps(network.to_dict()))
        db.add_coordinator(opts.coordinator_name, network.coordinator_public_key, network.coordinator_ip)
        tok = new_token(network.name, network.endpoints, network.fingerprint, network.coordinator_public_key)
        db.add_token(tok.token_id, tok.secret, ttl, opts.token_uses)
        db.close()
        backend = iface.bring_up(device, state, network, network.coordinator_ip)
        undo.append(device.delete)
        state.write_json(
            "member.json",
            {
                "role": "coordinator",
                "name": opts.coordinator_name,
                "network": network.to_dict(),
                "overlay_ip": network.coordinator_ip,
                "backend": backend,
                "wg_pid": device.pid,
                "train": opts.train,
            },
        )
        undo.append(lambda: state.remove("member.json"))
        daemon_pid = process.spawn(state) if start else None
    except BaseException:
        for step in reversed(undo):
            with contextlib.suppress(Exception):
                step()
        state.remove(f"{network.interface}.conf", *process.FILES)
        if created_dir:
            state.delete()
        raise
    return InitResult(network, tok.encode(), backend, state.path, daemon_pid, device.warning())
