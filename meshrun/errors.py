"""Typed errors. Every error carries what went wrong and how to fix it.

The CLI prints ``str(err)`` as one line and exits with ``err.exit_code``; nothing
else in meshrun prints errors. Messages must never contain a secret (private key,
token secret).
"""

from __future__ import annotations


class MeshrunError(Exception):
    """Base error: ``message`` states the rule that was broken, ``fix`` the way out."""

    exit_code = 1

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message}; {self.fix}" if self.fix else self.message


class UsageError(MeshrunError):
    """A bad option value or argument given by the user."""

    exit_code = 2


class TokenError(MeshrunError):
    """A join token is garbled, expired, revoked, used up or for another network."""


class StateError(MeshrunError):
    """State on disk is missing, corrupt, or in the wrong shape for the command."""


class SystemError_(MeshrunError):
    """The machine lacks a privilege or tool meshrun needs (root, `wg`, `ip`, ...)."""


class NetworkError(MeshrunError):
    """A network change failed or the overlay/underlay cannot be used as asked."""


class CoordinatorError(MeshrunError):
    """The coordinator could not be reached or refused the request."""


class LaunchError(MeshrunError):
    """A training launch could not be planned or started."""
