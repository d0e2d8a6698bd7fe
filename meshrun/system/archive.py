"""The code a job ships to its nodes: packed on the coordinator, unpacked (safely) on each node."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
from pathlib import Path

from meshrun.errors import LaunchError, UsageError

SYNC_EXCLUDE = {".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", "node_modules"}


def pack_code(directory: Path, limit_mb: int) -> bytes:
    """tar.gz of `directory` (VCS and cache dirs left out); LaunchError past `limit_mb`."""
    buf = io.BytesIO()
    limit = limit_mb * 1024 * 1024
    total = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in _files(directory):
            total += path.stat().st_size
            if total > limit:
                raise LaunchError(f"the script's directory {directory} holds more than {limit_mb} MiB",
                                  "move data out of it, raise --sync-limit, or put the code on every node "
                                  "and use --no-sync")
            tar.add(path, arcname=str(path.relative_to(directory)), recursive=False)
    return buf.getvalue()


def _files(directory: Path):
    """The files a job ships from `directory`, in a stable order (VCS and cache dirs left out)."""
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in SYNC_EXCLUDE)
        for f in sorted(files):
            path = Path(root) / f
            if not path.is_symlink() and path.is_file():
                yield path


HASH_MAX_FILES = 5000
HASH_MAX_BYTES = 200 * 1024 * 1024


def tree_hash(directory: Path, max_files: int = HASH_MAX_FILES, max_bytes: int = HASH_MAX_BYTES) -> str | None:
    """SHA-256 over the names and contents of the files a job would ship from `directory`.

    None when the directory is absent or holds more than `max_files` files or `max_bytes` bytes
    (a --no-sync directory may hold a dataset: pre-flight then does not compare code, rather than
    read it all). Every node and the coordinator use the same limits, so they agree on what to hash.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    h = hashlib.sha256()
    files = total = 0
    for path in _files(directory):
        files += 1
        total += path.stat().st_size
        if files > max_files or total > max_bytes:
            return None
        h.update(str(path.relative_to(directory)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _check_member(m: tarfile.TarInfo) -> None:
    """What tarfile's "data" filter refuses, for interpreters without it (before 3.10.12 / 3.11.4)."""
    parts = Path(m.name).parts
    if m.name.startswith("/") or ".." in parts or not parts:
        raise tarfile.TarError(f"member {m.name!r} points outside the archive")
    if not (m.isfile() or m.isdir()):
        raise tarfile.TarError(f"member {m.name!r} is not a plain file or directory")


def unpack_code(blob: bytes, dest: Path) -> int:
    """Replace `dest` with the archive's files; returns how many entries it holds.

    Refuses absolute paths, `..`, links, devices (tarfile's "data" filter, or the same checks on
    interpreters that lack it); UsageError when the archive cannot be unpacked.
    """
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True, mode=0o700)
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:   # pragma: no cover - exercised on old 3.10 patch releases only
                members = tar.getmembers()
                for m in members:
                    _check_member(m)
                    m.mode &= 0o755
                tar.extractall(dest, members=members)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise UsageError(f"the code archive cannot be unpacked ({exc})", "retry; meshrun train builds it itself") from None
    return sum(1 for _ in dest.rglob("*"))
