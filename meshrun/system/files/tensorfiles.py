"""Tensors on disk: saving a state atomically and reading it back without running code from the file.

DiLoCo's node-local snapshots go through here (meshrun.train.diloco): `save` writes torch's format to a
temporary file and renames it over the old one (a crash leaves the previous snapshot), `load` reads with
``weights_only=True`` (tensors and plain containers only: a tampered file cannot run code).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from meshrun.errors import StateError
from meshrun.system.files.statedir import atomic_write

__all__ = ["save", "load"]


def save(path: Path | str, obj: Any) -> None:
    """Write `obj` (tensors, numbers, lists, dicts) to `path` atomically (0600)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(path, buf.getvalue())


def load(path: Path | str, map_location: Any = None) -> Any:
    """What `save` wrote; StateError naming the file when it cannot be read (corrupt, not torch's format,
    or holding anything but tensors and plain containers)."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location=map_location)
    except Exception as exc:  # torch.load raises many types (pickle, zip, EOF) for a bad file
        raise StateError(f"cannot read {path}: {exc}", f"delete {path}") from None
