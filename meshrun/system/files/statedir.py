"""State on disk: a member's state directory and the only functions that write meshrun's files.

A state directory (0700) holds, per member:
  member.json    role, name, network description, overlay IP, backend (no secrets)
  private.key    the WireGuard private key (0600, never leaves the machine; job keys are derived from it)
  <iface>.conf   wg-quick file for operators (0600: it embeds the private key)
  peers.json     the last member list from the coordinator (nodes; for status and restarts)
  daemon.lock / daemon.log (rotated) / daemon.out
  host-settings.json  host settings meshrun changed and their values before (meshrun.system.kernel.hostsettings)
  jobs/, projects/  jobs' files and projects' working directories (meshrun.system.files.joblogs, .projects)
and on the coordinator also tls.key (0600), tls.crt and coordinator.db (meshrun.system.control.coordinatordb).

Every file is replaced atomically (temp file, fsync, rename), so a crash or a full disk
leaves the previous good version. A file that cannot be parsed raises StateError naming it;
nothing is ever silently reset.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from meshrun.errors import StateError, UsageError


def default_state_dir() -> Path:
    """$MESHRUN_STATE_DIR, else /var/lib/meshrun for root, else $XDG_STATE_HOME/meshrun."""
    env = os.environ.get("MESHRUN_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/meshrun")
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "meshrun"


def _cannot_write(target: Path, exc: OSError) -> StateError:
    return StateError(
        f"cannot write {target}: {exc.strerror}; the previous version is unchanged",
        "free disk space or fix permissions, then run the command again",
    )


def atomic_write(target: Path | str, data: bytes | str, mode: int = 0o600) -> Path:
    """Replace `target` with `data` atomically (temp file in the same directory, fsync, rename).

    A crash or a full disk leaves the previous version; StateError names the file otherwise.
    """
    if isinstance(data, str):
        data = data.encode()
    target = Path(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:  # no such directory, no space for an inode, not writable
        raise _cannot_write(target, exc) from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise _cannot_write(target, exc) from None
    dfd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return target


def make_dir(path: Path | str, mode: int = 0o755) -> None:
    """mkdir -p; StateError naming the directory if it cannot be made."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True, mode=mode)
    except OSError as exc:
        raise StateError(f"cannot create {path}: {exc.strerror}", "fix permissions, or pick another place") from None


def remove_tree(path: Path | str) -> None:
    """rm -rf: no error if it is gone already."""
    shutil.rmtree(path, ignore_errors=True)


def disk_use(path: Path | str, max_entries: int = 200_000) -> tuple[int, int]:
    """(bytes, regular files) under `path`, (0, 0) when it does not exist. Links are not followed. Counting
    stops after `max_entries` entries (a dataset may hold millions), so the answer may then be short."""
    total = files = seen = 0
    stack = [os.fspath(path)]
    while stack and seen < max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    seen += 1
                    if seen > max_entries:
                        break
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_size
                        files += 1
                    elif stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
        except OSError:  # gone, or not a directory
            continue
    return total, files


def temp_root() -> Path:
    """The system's temporary directory (TMPDIR, else /tmp)."""
    return Path(tempfile.gettempdir())


def make_temp_dir(prefix: str) -> Path:
    """A new private directory under the system's temporary directory."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def read_user_file(path: Path | str, what: str, option: str) -> str:
    """The text of a file the user named with `option` (UsageError naming it if it cannot be read)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{what} {str(path)!r} not found", f"check the path given to {option}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} {str(path)!r}: {exc}", "pass a readable UTF-8 file") from None


def read_json_files(directory: Path, pattern: str) -> list[dict]:
    """The JSON objects in `directory`'s files matching `pattern`, sorted by name; unreadable ones skipped."""
    out = []
    for f in sorted(Path(directory).glob(pattern)):
        try:
            obj = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


class StateDir:
    """A member's state directory. Paths are attributes; writes are atomic."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).absolute()

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def exists(self) -> bool:
        return (self.path / "member.json").exists()

    def create(self) -> bool:
        """Make the directory with mode 0700; return True if this call created it."""
        created = not self.path.exists()
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path, 0o700)
        except OSError as exc:
            raise StateError(
                f"cannot create state directory {self.path}: {exc.strerror}",
                "pick a writable place with --state-dir or MESHRUN_STATE_DIR",
            ) from None
        return created

    def write(self, name: str, data: bytes | str, secret: bool = False) -> Path:
        """Atomically replace `name` with `data` (mode 0600 if secret, else 0644)."""
        return atomic_write(self.path / name, data, 0o600 if secret else 0o644)

    def write_json(self, name: str, obj: object, secret: bool = False) -> Path:
        return self.write(name, json.dumps(obj, indent=2, sort_keys=True) + "\n", secret)

    def read(self, name: str) -> bytes:
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            raise StateError(
                f"{self.path / name} is missing",
                "run `meshrun init` or `meshrun join` first, or point --state-dir at the right place",
            ) from None
        except OSError as exc:
            raise StateError(f"cannot read {self.path / name}: {exc.strerror}", "check its permissions") from None

    def read_json(self, name: str) -> dict:
        raw = self.read(name)
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise StateError(
                f"{self.path / name} is corrupt ({exc})",
                "restore it from a backup, or remove the state directory and join again",
            ) from None
        return obj

    def delete(self) -> None:
        """Delete the whole state directory (`--purge`, or undoing a failed init/join)."""
        remove_tree(self.path)

    def remove(self, *names: str) -> None:
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                (self.path / n).unlink()
