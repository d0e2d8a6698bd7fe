"""Which commit of meshrun this is, for `meshrun --version`: an upgrade is checked by it.

Run from a git checkout (an editable install, `./dev.sh`): the checkout's HEAD now, "+changes" when files
differ from it. Installed from a wheel: the commit its build recorded in the package (STAMP, written by
tools/build_backend.py and tools/offline_bundle.sh from the checkout they built). None when neither is known
(a wheel built from files outside any checkout, or git missing).
"""

from __future__ import annotations

from pathlib import Path

from meshrun.errors import MeshrunError
from meshrun.system.machine.cmd import run

STAMP = "_commit"  # in the package directory of a built wheel: "1e21bf8" or "1e21bf8+changes"
PACKAGE = Path(__file__).resolve().parents[2]  # meshrun's package directory, this module in meshrun/system/files
_GIT = ["git", "-c", "core.fsmonitor=false", "-c", "safe.directory=*"]


def describe(package_dir: Path) -> str | None:
    """The commit `package_dir` (meshrun's package) comes from: "1e21bf8", "1e21bf8+changes", or None."""
    checkout = package_dir.parent
    if (checkout / ".git").exists():
        return checkout_commit(checkout)
    try:
        text = (package_dir / STAMP).read_text().strip()
    except OSError:
        return None
    return text or None


def checkout_commit(checkout: Path) -> str | None:
    """`git rev-parse --short HEAD` of `checkout`, with "+changes" when its tracked files differ from it; None
    without git or a commit."""
    try:
        head = run([*_GIT, "-C", str(checkout), "rev-parse", "--short", "HEAD"], check=False, quiet=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        diff = run([*_GIT, "-C", str(checkout), "diff", "--quiet", "HEAD", "--", "."], check=False, quiet=True)
    except MeshrunError:  # git is not installed, or it hung
        return None
    return head.stdout.strip() + ("+changes" if diff.returncode == 1 else "")
