"""Typed errors. Every error carries what went wrong and how to fix it.

The CLI prints ``str(err)`` as one line and exits with ``err.exit_code``; nothing
else in meshrun prints errors. Messages must never contain a secret (private key,
token secret). An error crosses a process or network boundary as `to_wire` writes it and
`from_wire` reads it back, so the receiver raises the same class (and so exits with the
same code) as the sender: an HTTP answer (meshrun.system.sockets.transport) or a daemon's readiness
pipe (meshrun.system.machine.procs).
"""

from __future__ import annotations

__all__ = [
    "MeshrunError",
    "UsageError",
    "TokenError",
    "StateError",
    "HostError",
    "NetworkError",
    "CommandError",
    "CoordinatorError",
    "LaunchError",
    "AuthError",
    "ControlStateError",
    "to_wire",
    "from_wire",
]


class MeshrunError(Exception):
    """Base error: ``message`` states the rule that was broken, ``fix`` the way out.

    ``status`` is the HTTP status an answer carried when the error came from another member (None
    when it arose here): 410 from the coordinator means this node was removed.
    """

    exit_code = 1

    def __init__(self, message: str, fix: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.status = status

    def __str__(self) -> str:
        return f"{self.message}; {self.fix}" if self.fix else self.message


class UsageError(MeshrunError):
    """A bad option value or argument given by the user."""

    exit_code = 2


class TokenError(MeshrunError):
    """A join token is garbled, expired, revoked, used up or for another network."""


class StateError(MeshrunError):
    """State on disk is missing, corrupt, or in the wrong shape for the command."""


class HostError(MeshrunError):
    """The machine lacks a privilege or tool meshrun needs (root, `wg`, `ip`, nftables, cgroup v2, ...)."""


class NetworkError(MeshrunError):
    """A network change failed or the overlay/underlay cannot be used as asked."""


class CommandError(NetworkError):
    """A system command failed or hung; `result` holds the finished process (None on a timeout)."""

    def __init__(self, message: str, fix: str = "", result=None) -> None:
        super().__init__(message, fix)
        self.result = result


class CoordinatorError(MeshrunError):
    """The coordinator could not be reached or refused the request."""


class LaunchError(MeshrunError):
    """A training launch could not be planned or started."""


class AuthError(MeshrunError):
    """A request without a valid MAC (unsigned, malformed, wrong key, stale, replayed), or an enrolment
    without proof that the node holds its private key."""


class ControlStateError(MeshrunError):
    """The replicated control state (etcd) cannot be read or written: no majority of its members answers,
    a write's outcome is unknown, or etcd refused the request."""


_BY_NAME = {
    c.__name__: c
    for c in (
        MeshrunError,
        UsageError,
        TokenError,
        StateError,
        HostError,
        NetworkError,
        CommandError,
        CoordinatorError,
        LaunchError,
        AuthError,
        ControlStateError,
    )
}


def to_wire(err: MeshrunError) -> dict:
    """The error as JSON-able data: message, fix and its class name (for a subclass defined elsewhere, such as
    meshrun.system.control.etcd.Compacted, the nearest class of this module's: the class the receiver can raise)."""
    kind = next((c.__name__ for c in type(err).__mro__ if _BY_NAME.get(c.__name__) is c), "MeshrunError")
    return {"error": err.message, "fix": err.fix, "kind": kind}


def from_wire(data: object, default: type[MeshrunError] = CoordinatorError, status: int | None = None) -> MeshrunError:
    """The error `to_wire` described, as its own class (`default` for an unknown or missing kind)."""
    d = data if isinstance(data, dict) else {}
    cls = _BY_NAME.get(str(d.get("kind")), default)
    err = cls(str(d.get("error", "")), str(d.get("fix", "")))
    err.status = status
    return err
