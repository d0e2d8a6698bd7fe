"""The code a job ships, as data: a manifest (file -> content hash), its digest, and how to describe it.

Pure. meshrun.system.files.archive lists a project's files (honouring .gitignore and .meshrunignore),
packs them and hashes them; the pre-flight compares manifests with the functions here, so a node
whose copy differs is told *which* files differ, and the coordinator's reference is exactly what
was packed (never a second read of a directory that may be changing: a log written into it, a
checkpoint, a `nohup.out`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "digest",
    "differences",
    "describe_differences",
    "Entry",
    "largest",
    "human_bytes",
    "project_name",
    "PROJECT_RE",
]

PROJECT_RE = re.compile(r"^(?![.-])[A-Za-z0-9_.-]{1,64}\Z")


def digest(manifest: Mapping[str, str]) -> str:
    """SHA-256 over the sorted (name, content hash) pairs: equal for equal file sets and contents."""
    h = hashlib.sha256()
    for name in sorted(manifest):
        h.update(name.encode("utf-8", "surrogateescape") + b"\0" + bytes.fromhex(manifest[name]))
    return h.hexdigest()


def differences(reference: Mapping[str, str], other: Mapping[str, str]) -> list[str]:
    """The files in which `other` differs from `reference`, sorted: "name" (content differs),
    "name (missing)" (only in the reference), "name (extra)" (only in `other`)."""
    out = []
    for name in sorted(set(reference) | set(other)):
        if name not in other:
            out.append(f"{name} (missing)")
        elif name not in reference:
            out.append(f"{name} (extra)")
        elif reference[name] != other[name]:
            out.append(name)
    return out


def describe_differences(diffs: list[str], first: int = 5) -> str:
    """ "a.py, b.py (missing) and 3 more" for a finding."""
    if not diffs:
        return "no file differs"
    shown = ", ".join(diffs[:first])
    return shown + (f" and {len(diffs) - first} more" if len(diffs) > first else "")


@dataclass(frozen=True)
class Entry:
    """A top-level entry of a project (a file, or a directory with everything under it)."""

    name: str
    bytes: int
    files: int
    is_dir: bool

    def describe(self) -> str:
        return f"{self.name}{'/' if self.is_dir else ''} {human_bytes(self.bytes)}" + (
            f" ({self.files} files)" if self.is_dir else ""
        )


def largest(files: Iterable[tuple[str, int]], n: int = 5) -> list[Entry]:
    """The `n` largest top-level entries of a list of (relative path, size), largest first."""
    sizes: dict[str, list[int]] = {}
    dirs: set[str] = set()
    for rel, size in files:
        top, sep, _ = rel.partition("/")
        if sep:
            dirs.add(top)
        acc = sizes.setdefault(top, [0, 0])
        acc[0] += size
        acc[1] += 1
    ranked = sorted(sizes.items(), key=lambda kv: (-kv[1][0], kv[0]))[:n]
    return [Entry(name, b, f, name in dirs) for name, (b, f) in ranked]


def human_bytes(n: int) -> str:
    """1536 -> "1.5 KiB"; binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - the loop returns


def project_name(directory_name: str) -> str:
    """A default project name from a directory's name: A-Za-z0-9_.- only, at most 64, never empty."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", directory_name).lstrip(".-")[:64]
    return name or "project"
