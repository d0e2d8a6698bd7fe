"""A job's code on disk: which files a project ships, packing them, and unpacking them on a node.

`select_files` decides what a project ships, as SkyPilot's workdir sync does: in a git work tree
what git would track (`git ls-files --cached --others --exclude-standard`: .gitignore,
.git/info/exclude and the user's global excludes), submodules and nested repositories included (each
listed by its own git, with its own ignore rules), and everywhere a `.meshrunignore` at the
project's root (gitignore syntax, meshrun.core.ignore); never caches and virtualenvs
(`ALWAYS_IGNORED`), meshrun's own state directories, files `meshrun pull` brought back
(`PULLED_DIR` at the root), or symbolic links. `pack` reads each file once,
through a descriptor opened without following symbolic links at any component (a link swapped in
between the listing and the read is refused, not followed), and hashes exactly the bytes it packs:
the pre-flight's reference is what was shipped. `unpack_into` lays a shipment over a node's
persistent project directory: shipped files are replaced, files the previous shipment had and this
one lacks are removed, everything else (checkpoints, logs the job wrote) stays.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import shutil
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from meshrun.core import codeset, ignore
from meshrun.errors import LaunchError, UsageError
from meshrun.system.files.statedir import disk_use
from meshrun.system.machine.cmd import run

__all__ = [
    "ALWAYS_IGNORED",
    "IGNORE_FILE",
    "PULLED_DIR",
    "Selection",
    "Packed",
    "select_files",
    "pack",
    "hash_files",
    "unpack_into",
    "pack_paths",
    "unpack_pulled",
]

# Never shipped, whatever the ignore files say: version control, caches, virtual environments.
ALWAYS_IGNORED = {
    ".git",
    "__pycache__",
    ".venv",
    "venv",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "node_modules",
    ".ipynb_checkpoints",
}
IGNORE_FILE = ".meshrunignore"
# Where `meshrun pull` puts what it fetches by default, under the project it is run from: never shipped
# back (checkpoints pulled from the nodes would otherwise travel with the next job).
PULLED_DIR = "meshrun-pulled"
HASH_MAX_FILES = 5000
HASH_MAX_BYTES = 200 * 1024 * 1024
DU_MAX_ENTRIES = 20000  # how far `select_files` counts an ignored directory's size
# git config for listing an untrusted work tree as root: no fsmonitor hook runs (a repository's config
# could name any command there), and another user's repository is listed (git refuses "dubious ownership").
_GIT = ["git", "-c", "core.fsmonitor=false", "-c", "safe.directory=*"]


@dataclass
class Selection:
    """What a project ships: files (relative "/"-paths, sizes at listing) and what was left out."""

    root: Path
    files: list[tuple[str, int]] = field(default_factory=list)
    ignored: list[codeset.Entry] = field(default_factory=list)  # largest first
    links: list[str] = field(default_factory=list)  # symbolic links, never shipped
    rules: str = ""  # which rules applied, for people

    @property
    def names(self) -> list[str]:
        return [rel for rel, _ in self.files]

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)

    def summary(self, limit_mb: int | None = None, top: int = 5) -> list[str]:
        """Lines for `meshrun train --dry-run`: what is shipped, the largest entries, what is not."""
        head = f"ships {len(self.files)} file(s), {codeset.human_bytes(self.bytes)} from {self.root} ({self.rules})"
        if limit_mb is not None:
            head += f"; --sync-limit {limit_mb} MiB"
        lines = [head]
        big = codeset.largest(self.files, top)
        if big:
            lines.append("largest: " + ", ".join(e.describe() for e in big))
        if self.ignored:
            shown = ", ".join(e.describe() for e in self.ignored[:top])
            more = len(self.ignored) - top
            lines.append("not shipped: " + shown + (f" and {more} more" if more > 0 else ""))
        if self.links:
            lines.append(
                f"not shipped (symbolic links): {', '.join(self.links[:top])}"
                + (f" and {len(self.links) - top} more" if len(self.links) > top else "")
            )
        return lines


@dataclass
class Packed:
    """A packed shipment: the archive, and the content hash of every file exactly as packed."""

    blob: bytes
    manifest: dict[str, str]
    bytes: int

    @property
    def digest(self) -> str:
        return codeset.digest(self.manifest)


# --------------------------------------------------------------------------- choosing the files


def _is_state_dir(path: Path) -> bool:
    """A meshrun state directory (it holds a member's keys): never shipped, wherever it sits."""
    return (path / "member.json").exists() and (path / "private.key").exists()


def _git_root(directory: Path) -> bool:
    """True when `directory` is inside a git work tree and git is installed."""
    try:
        res = run([*_GIT, "-C", str(directory), "rev-parse", "--is-inside-work-tree"], check=False, quiet=True)
    except Exception:  # noqa: BLE001 -- no git binary: the caller falls back to reading .gitignore itself
        return False
    return res.returncode == 0 and res.stdout.strip() == "true"


def _git_list(directory: Path, *extra: str) -> list[str]:
    res = run([*_GIT, "-C", str(directory), "ls-files", "-z", *extra], quiet=True, timeout=120)
    return [p for p in res.stdout.split("\0") if p]


def _git_tree(root: Path, prefix: str = "") -> tuple[list[str], list[tuple[str, bool]]]:
    """(files git would track, entries its ignore rules leave out as (rel, is_dir)) under root/prefix,
    recursing into submodules and nested repositories: the parent's git lists one of those as a single
    entry and never its files, which a user expects to be shipped."""
    here = root / prefix if prefix else root
    pre = f"{prefix}/" if prefix else ""
    files: list[str] = []
    ignored = [
        (pre + rel.rstrip("/"), rel.endswith("/"))
        for rel in _git_list(here, "--others", "--ignored", "--exclude-standard", "--directory")
    ]
    for rel in _git_list(here, "--cached", "--others", "--exclude-standard"):
        rel = pre + rel.rstrip("/")
        path = root / rel
        if path.is_dir() and not path.is_symlink():
            if (path / ".git").exists():  # an initialised submodule or a nested repository: its own listing
                sub_files, sub_ignored = _git_tree(root, rel)
                files += sub_files
                ignored += sub_ignored
            continue  # an empty (uninitialised) submodule: nothing to ship
        files.append(rel)
    return files, ignored


def _read_rules(path: Path, base: str) -> ignore.IgnoreRules:
    try:
        return ignore.parse(path.read_text(encoding="utf-8", errors="replace"), base)
    except OSError:
        return ignore.IgnoreRules(base)


def _excluded(rel: str, matcher: ignore.Matcher) -> bool:
    """Is `rel` (a file) left out by the always-ignored names or by `matcher`, itself or a parent directory?"""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        d = "/".join(parts[:i])
        if parts[i - 1] in ALWAYS_IGNORED or matcher.ignored(d, is_dir=True):
            return True
    return matcher.ignored(rel)


def select_files(directory: Path | str, exclude: Iterable[Path | str] = (), use_git: bool = True) -> Selection:
    """The files a job ships from `directory` (see the module docstring), in a stable order.

    `exclude` names directories never to ship (the caller's meshrun state directory, if it lies
    inside the project). `use_git=False` reads a work tree's ignore files without git, as meshrun
    does where git is not installed (tests compare the two). UsageError when `directory` is not a
    directory.
    """
    root = Path(directory).absolute()
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory", "run `meshrun train` from your project's directory")
    excluded = {Path(p).absolute() for p in exclude}
    matcher = ignore.Matcher()
    if (root / IGNORE_FILE).is_file():
        matcher.add(_read_rules(root / IGNORE_FILE, ""))
    sel = Selection(root)
    ignored: list[tuple[str, bool]] = []  # (rel, is_dir) left out by a rule

    def keep_dir(rel: str, path: Path) -> bool:
        return not (path.name in ALWAYS_IGNORED or path in excluded or _is_state_dir(path))

    if (root / PULLED_DIR).is_dir() and not (root / PULLED_DIR).is_symlink():
        ignored.append((PULLED_DIR, True))  # named in the summary, as what the ignore rules leave out

    if use_git and _git_root(root):
        sel.rules = "git's ignore rules" + (f" and {IGNORE_FILE}" if matcher.rules else "")
        candidates, left_out = _git_tree(root)
        ignored += [(rel, is_dir) for rel, is_dir in left_out if rel != PULLED_DIR]
        dir_ok: dict[str, bool] = {}
        for rel in sorted(set(candidates)):
            if rel.startswith(f"{PULLED_DIR}/"):
                continue
            parent = rel.rpartition("/")[0]
            if parent and parent not in dir_ok:
                dir_ok[parent] = all(keep_dir(p, root / p) for p in _ancestors(parent))
            if parent and not dir_ok[parent]:
                continue
            if _excluded(rel, matcher):
                ignored.append((rel, False))
                continue
            _add_file(sel, root, rel)
    else:
        git_dir = (root / ".git").exists()
        if git_dir:  # a git work tree, but no git binary: read its ignore files ourselves
            for extra in (root / ".git" / "info" / "exclude",):
                if extra.is_file():
                    matcher.add(_read_rules(extra, ""))
        sel.rules = (".gitignore files" if git_dir else "no git work tree") + (
            f" and {IGNORE_FILE}" if any(r.base == "" for r in matcher.rules) else ""
        )
        for cur, dirs, names in os.walk(root):
            here = Path(cur)
            base = here.relative_to(root).as_posix()
            base = "" if base == "." else base
            if git_dir and ".gitignore" in names:
                matcher.add(_read_rules(here / ".gitignore", base))
            keep = []
            for d in sorted(dirs):
                rel = f"{base}/{d}" if base else d
                path = here / d
                if path.is_symlink():
                    sel.links.append(rel)
                elif not keep_dir(rel, path) or rel == PULLED_DIR:
                    continue
                elif matcher.ignored(rel, is_dir=True):
                    ignored.append((rel, True))
                else:
                    keep.append(d)
            dirs[:] = keep
            for n in sorted(names):
                rel = f"{base}/{n}" if base else n
                if n in ALWAYS_IGNORED:  # a submodule's `.git` file, pointing at its repository
                    continue
                if matcher.ignored(rel):
                    ignored.append((rel, False))
                else:
                    _add_file(sel, root, rel)
    sel.files.sort()
    entries = []
    for rel, is_dir in ignored:
        path = root / rel
        if is_dir:
            b, f = disk_use(path, DU_MAX_ENTRIES)
            entries.append(codeset.Entry(rel, b, f, True))
        else:
            try:
                entries.append(codeset.Entry(rel, path.lstat().st_size, 1, False))
            except OSError:
                continue
    sel.ignored = sorted(entries, key=lambda e: (-e.bytes, e.name))
    return sel


def _ancestors(rel: str) -> list[str]:
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _add_file(sel: Selection, root: Path, rel: str) -> None:
    try:
        st = (root / rel).lstat()
    except OSError:  # listed by git but deleted since: nothing to ship
        return
    if stat.S_ISLNK(st.st_mode):
        sel.links.append(rel)
    elif stat.S_ISREG(st.st_mode):
        sel.files.append((rel, st.st_size))


# --------------------------------------------------------------------------- reading without following links


def _open_beneath(root_fd: int, rel: str) -> int | None:
    """A read-only descriptor of the regular file `rel` under the directory `root_fd`, refusing a symbolic
    link at any component (O_NOFOLLOW at every step); None when it is not a regular file any more."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None
    fd = os.dup(root_fd)
    try:
        for p in parts[:-1]:
            nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        try:
            f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            return None
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(f).st_mode):
        os.close(f)
        return None
    return f


def _read_fd(fd: int, limit: int) -> bytes:
    """At most `limit` bytes from `fd` (a file still being written is read as it was at its listed size)."""
    chunks, left = [], limit
    while left > 0:
        b = os.read(fd, min(left, 1 << 20))
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _too_big(sel: Selection, limit_mb: int) -> LaunchError:
    big = ", ".join(e.describe() for e in codeset.largest(sel.files, 5))
    return LaunchError(
        f"the code to ship from {sel.root} is {codeset.human_bytes(sel.bytes)}, over --sync-limit "
        f"{limit_mb} MiB; largest: {big}",
        f"list what the job does not need in {IGNORE_FILE} (gitignore syntax) or .gitignore, raise "
        "--sync-limit, or put the code on every node and use --no-sync",
    )


def pack(sel: Selection, limit_mb: int) -> Packed:
    """tar.gz of the selected files, each read once without following links, and their hashes.

    LaunchError listing the largest entries when the files exceed `limit_mb` MiB.
    """
    limit = limit_mb * 1024 * 1024
    if sel.bytes > limit:
        raise _too_big(sel, limit_mb)
    buf = io.BytesIO()
    manifest: dict[str, str] = {}
    total = 0
    root_fd = os.open(sel.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for rel, listed in sel.files:
                fd = _open_beneath(root_fd, rel)
                if fd is None:  # deleted, or swapped for a link or a device since the listing
                    continue
                try:
                    st = os.fstat(fd)
                    data = _read_fd(fd, max(listed, 0) if st.st_size >= listed else st.st_size)
                finally:
                    os.close(fd)
                total += len(data)
                if total > limit:
                    raise _too_big(sel, limit_mb)
                info = tarfile.TarInfo(rel)
                info.size, info.mtime = len(data), int(st.st_mtime)
                info.mode = 0o755 if st.st_mode & 0o111 else 0o644
                tar.addfile(info, io.BytesIO(data))
                manifest[rel] = hashlib.sha256(data).hexdigest()
    finally:
        os.close(root_fd)
    return Packed(buf.getvalue(), manifest, total)


def hash_files(
    directory: Path | str, names: Iterable[str], max_files: int = HASH_MAX_FILES, max_bytes: int = HASH_MAX_BYTES
) -> dict[str, str] | None:
    """{name: sha256} of the files `names` under `directory` as they are now (links not followed;
    a missing file is left out). None when there are more than `max_files` files or `max_bytes`
    bytes (a --no-sync directory may hold a dataset: the pre-flight then does not compare code)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    names = list(names)
    if len(names) > max_files:
        return None
    out: dict[str, str] = {}
    total = 0
    root_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for rel in names:
            fd = _open_beneath(root_fd, rel)
            if fd is None:
                continue
            try:
                h = hashlib.sha256()
                while chunk := os.read(fd, 1 << 20):
                    total += len(chunk)
                    if total > max_bytes:
                        return None
                    h.update(chunk)
            finally:
                os.close(fd)
            out[rel] = h.hexdigest()
    finally:
        os.close(root_fd)
    return out


# --------------------------------------------------------------------------- unpacking on a node


def _check_member(m: tarfile.TarInfo) -> None:
    """What tarfile's "data" filter refuses, for interpreters without it (before 3.10.12 / 3.11.4)."""
    parts = Path(m.name).parts
    if m.name.startswith("/") or ".." in parts or not parts:
        raise tarfile.TarError(f"member {m.name!r} points outside the archive")
    if not (m.isfile() or m.isdir()):
        raise tarfile.TarError(f"member {m.name!r} is not a plain file or directory")


def _extract(blob: bytes | BinaryIO, dest: Path) -> None:
    """Extract a tar.gz (bytes or a file) into the new directory `dest`, refusing absolute paths, `..`,
    links and devices."""
    dest.mkdir(parents=True, mode=0o700)
    try:
        with tarfile.open(fileobj=io.BytesIO(blob) if isinstance(blob, bytes) else blob, mode="r:gz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:  # pragma: no cover - exercised on old 3.10 patch releases only
                members = tar.getmembers()
                for m in members:
                    _check_member(m)
                    m.mode &= 0o755
                tar.extractall(dest, members=members)
    except (tarfile.TarError, OSError, EOFError, KeyError, ValueError) as exc:  # KeyError: a hard link to nothing
        shutil.rmtree(dest, ignore_errors=True)
        raise UsageError(f"the archive cannot be unpacked ({exc})", "retry; meshrun builds it itself") from None


def _files_under(root: Path) -> list[str]:
    out = []
    for cur, _dirs, names in os.walk(root):
        for n in names:
            out.append((Path(cur) / n).relative_to(root).as_posix())
    return sorted(out)


def _make_parents(workdir: Path, rel: str) -> None:
    """Create the directories of `rel` under `workdir`; a link or a file in the way is replaced (a job
    that left `model -> /etc` behind must not send the next shipment elsewhere)."""
    cur = workdir
    for part in rel.split("/")[:-1]:
        cur = cur / part
        if cur.is_symlink() or (cur.exists() and not cur.is_dir()):
            cur.unlink()
        if not cur.exists():
            cur.mkdir(mode=0o755)


def unpack_into(blob: bytes | BinaryIO, workdir: Path | str, previous: Iterable[str] = ()) -> list[str]:
    """Lay a shipment over the persistent `workdir`; returns the shipped names.

    Shipped files replace what is there; files in `previous` (the last shipment's names) that this
    one lacks are removed; everything else in `workdir` stays. UsageError when the archive is bad
    or a shipped file would replace a directory the job made.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True, mode=0o755)
    staging = workdir.parent / f".incoming-{secrets.token_hex(4)}"
    _extract(blob, staging)
    try:
        names = _files_under(staging)
        for rel in names:
            target = workdir / rel
            if target.is_dir() and not target.is_symlink():
                raise UsageError(
                    f"the shipped file {rel!r} would replace the directory {target} on this node",
                    "rename one of them, or start a new project with --project",
                )
            _make_parents(workdir, rel)
            os.replace(staging / rel, target)
        for rel in sorted(set(previous) - set(names)):
            target = workdir / rel
            if target.is_symlink() or target.is_file():
                target.unlink()
            parent = target.parent
            while parent != workdir and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return names


# --------------------------------------------------------------------------- files back from a node


def pack_paths(root: Path | str, rel: str, max_bytes: int) -> tuple[bytes, int]:
    """tar.gz of `rel` (a file or a directory tree) under `root`, links not followed; (blob, files).

    UsageError when `rel` leaves `root`, does not exist, or holds more than `max_bytes`.
    """
    root = Path(root)
    clean = Path(rel)
    if clean.is_absolute() or ".." in clean.parts:
        raise UsageError(f"path {rel!r} is not inside the job's directory", "give a path relative to it, without '..'")
    rel = clean.as_posix()
    target = root / rel
    if rel in (".", ""):
        target, rel = root, ""
    if target.is_symlink() or not target.exists():
        raise UsageError(
            f"{rel or '.'} does not exist in the job's directory on this node",
            "check the path (it is relative to the job's working directory)",
        )
    names = [rel] if target.is_file() else [f"{rel}/{n}" if rel else n for n in _files_under(target)]
    buf = io.BytesIO()
    total = count = 0
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for name in names:
                fd = _open_beneath(root_fd, name)
                if fd is None:
                    continue
                try:
                    st = os.fstat(fd)
                    if total + st.st_size > max_bytes:
                        raise UsageError(
                            f"{rel or '.'} holds more than {codeset.human_bytes(max_bytes)}",
                            "pull a smaller path, or raise --max-mb",
                        )
                    data = _read_fd(fd, st.st_size)
                finally:
                    os.close(fd)
                total += len(data)
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), int(st.st_mtime), st.st_mode & 0o755
                tar.addfile(info, io.BytesIO(data))
                count += 1
    finally:
        os.close(root_fd)
    return buf.getvalue(), count


def unpack_pulled(blob: bytes, dest: Path | str) -> list[str]:
    """Extract files pulled from a node into `dest` (created; existing files there are replaced)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".pull-{secrets.token_hex(4)}"
    _extract(blob, staging)
    try:
        names = _files_under(staging)
        for rel in names:
            _make_parents(dest, rel)
            os.replace(staging / rel, dest / rel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return names
