"""Which userspace WireGuard binary a measurement ran with: what every results file records.

0.0.20231211 and 0.0.20230223 both print v0.0.20230223, so the record is the binary's SHA-256 and its Debian
package version. An offline install (tools/offline_install.sh) puts a shell wrapper on PATH that starts the bundled
binary; the record is then of that binary, its version read from the package's changelog beside it.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import re
import shutil
from pathlib import Path

from meshrun.errors import MeshrunError
from meshrun.system.machine.cmd import run

WRAPPER_MARK = "# meshrun-offline:"  # the first comment of every wrapper install.sh writes
CHANGELOG_TOP = re.compile(r"^wireguard-go \(([^)]+)\)")


def wg_version() -> str:
    """The first line `wireguard-go --version` prints, or "?"."""
    try:
        out = run(["wireguard-go", "--version"], check=False, quiet=True, timeout=5).stdout
    except MeshrunError:
        return "?"
    return out.strip().splitlines()[0] if out.strip() else "?"


def offline_target(path: Path) -> Path | None:
    """The bundled binary an offline install's wrapper at `path` starts; None if `path` is not such a wrapper."""
    try:
        head = path.read_bytes()[:4096]
    except OSError:
        return None
    if not head.startswith(b"#!") or WRAPPER_MARK.encode() not in head:
        return None
    found = re.search(r"^exec .*?(/\S+/root/\S*/wireguard-go)\b", head.decode(errors="replace"), re.M)
    return Path(found.group(1)) if found else None


def changelog_version(binary: Path) -> str | None:
    """The Debian version at the top of the wireguard-go changelog unpacked beside `binary` (.../usr/bin/X)."""
    log = binary.parent.parent / "share" / "doc" / "wireguard-go" / "changelog.Debian.gz"
    with contextlib.suppress(OSError, EOFError):
        with gzip.open(log, "rt") as f:
            found = CHANGELOG_TOP.match(f.readline())
            return found.group(1) if found else None
    return None


def wireguard_binary() -> dict:
    """The wireguard-go meshrun starts here: path, what it prints, Debian package version, SHA-256 (None each
    where unknown); `wrapper`: the offline install's wrapper on PATH, when the binary is run through one."""
    from meshrun.system.kernel.device import WIREGUARD_GO

    found = shutil.which(WIREGUARD_GO)
    out: dict = {"backend": "wireguard-go", "path": found, "prints": wg_version(), "package": None, "sha256": None}
    if not found:
        return out
    binary = Path(found)
    bundled = offline_target(binary)
    if bundled is not None:
        out.update(wrapper=found, path=str(bundled), package=changelog_version(bundled))
        binary = bundled
    with contextlib.suppress(OSError):
        out["sha256"] = hashlib.sha256(binary.read_bytes()).hexdigest()
    if out["package"] is None:
        with contextlib.suppress(MeshrunError):
            res = run(["dpkg-query", "-W", "-f=${Version}", "wireguard-go"], check=False, quiet=True, timeout=5)
            out["package"] = (res.stdout.strip() or None) if res.returncode == 0 else None
    return out
