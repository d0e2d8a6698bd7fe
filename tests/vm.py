"""The test VM: Debian's kernel under QEMU (virtme-ng, TCG), for what this host's kernel lacks.

This project's machines run a kernel with neither WireGuard nor netem. `vng` (PyPI virtme-ng) boots
Debian's packaged kernel (linux-image-amd64: both built as modules) over this machine's own root
filesystem, read-only over 9p, and runs one command as root. What the verified set-up needs
(docs: ../shared/design-brief.md):

- TCG, not KVM (the guest hangs under KVM here): boot ~40 s, Python ~15x slower than the host.
- Python over 9p is slow enough (`import meshrun.cli` 15-24 s) to trip meshrun's 45 s daemon
  readiness limit, so the interpreter, the venv (without torch: nothing in the scenario needs it)
  and the meshrun package go onto an ext4 image (`mke2fs -d`) attached as a virtio disk and
  bind-mounted over their own paths inside the guest (the import then takes ~6 s).
- /tmp and /run are writable in the guest (an overlay and a tmpfs): state lives there, never on a
  9p mount (SQLite fails there with "disk I/O error"). Results come back through an --rwdir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)
BASE = Path(sys.base_prefix)
# Left out of the image: torch and its big companions (the scenario does not train), the stdlib's tests.
SKIP_PACKAGES = ("torch", "sympy", "networkx", "nvidia", "triton")


def kernel() -> Path | None:
    """Debian's packaged kernel with its modules installed (newest first), or None."""
    for k in sorted(Path("/boot").glob("vmlinuz-*-amd64"), reverse=True):
        if (Path("/lib/modules") / k.name.removeprefix("vmlinuz-") / "modules.dep").exists():
            return k
    return None


def unavailable() -> str | None:
    """Why the VM cannot start here (what to install), or None when it can."""
    if os.geteuid() != 0:
        return "the VM needs root (it mounts its image inside the guest as root; vng runs as the host user)"
    if not (VENV / "bin" / "vng").exists():
        return "virtme-ng is not installed in this venv: pip install virtme-ng (./dev.sh test does)"
    if not shutil.which("qemu-system-x86_64"):
        return "qemu-system-x86_64 not found: apt-get install qemu-system-x86 (./dev.sh test does, as root)"
    if kernel() is None:
        return "no Debian kernel with modules in /boot: apt-get install linux-image-amd64 (./dev.sh test does)"
    if not any(shutil.which(b) for b in ("busybox-static", "busybox.static", "busybox")):
        # virtme-ng builds an initramfs for a modular kernel around the host's static busybox.
        return "no busybox for the VM's initramfs: apt-get install busybox-static (./dev.sh test does)"
    if VENV == BASE:
        return "the VM needs the project venv (./dev.sh test runs the suite in .venv)"
    return None


def _link_tree(src: Path, dst: Path, skip: set[Path]) -> None:
    """Copy a tree as hard links (copies across file systems), leaving out `skip`."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(
        src, dst, symlinks=True, copy_function=link, ignore=lambda d, names: [n for n in names if Path(d, n) in skip]
    )


def build_image(workdir: Path) -> Path:
    """An ext4 image holding the interpreter, the venv and the meshrun package (hard-link staged)."""
    stage = workdir / "stage"
    stdlib = Path(sysconfig.get_paths(vars={"base": str(BASE), "installed_base": str(BASE)})["stdlib"])
    _link_tree(BASE, stage / "py", {stdlib / "site-packages", stdlib / "test", *stdlib.glob("config-*")})
    (stage / "py" / stdlib.relative_to(BASE) / "site-packages").mkdir(exist_ok=True)
    site = Path(sysconfig.get_paths()["purelib"])
    _link_tree(VENV, stage / "venv", {p for name in SKIP_PACKAGES for p in site.glob(name + "*")})
    _link_tree(REPO / "meshrun", stage / "src", set())
    image = workdir / "python.ext4"
    subprocess.run(
        ["mke2fs", "-q", "-F", "-t", "ext4", "-d", str(stage), str(image), "3G"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    shutil.rmtree(stage)
    return image


def run(script: Path, workdir: Path, timeout: float) -> dict:
    """Boot the VM, run `python SCRIPT OUTDIR` in it as root; returns its checks, log and exit.

    {"rc": script exit (None when it did not end), "checks": [one dict per JSONL line],
     "done": True when the script reached its end, "log": the guest's output, "vng": vng's output}
    """
    out = workdir / "out"
    out.mkdir(parents=True)
    image = build_image(workdir)
    guest = workdir / "guest.sh"
    guest.write_text(f"""#!/bin/sh
exec > {out}/guest.log 2>&1
set -e
mkdir -p /run/meshrun-image
mount -o ro /dev/vda /run/meshrun-image
mount --bind /run/meshrun-image/py {BASE}
mount --bind /run/meshrun-image/venv {VENV}
mount --bind /run/meshrun-image/src {REPO / "meshrun"}
set +e
{VENV / "bin" / "python"} -u {script} {out}
echo $? > {out}/rc
""")
    guest.chmod(0o755)
    argv = [
        str(VENV / "bin" / "vng"),
        "--disable-kvm",
        "--disable-microvm",
        "--run",
        str(kernel()),
        "--cpus",
        "2",
        "--memory",
        "3G",
        "--rwdir",
        str(out),
        "--disk",
        f"{image}",
        "--exec",
        str(guest),
    ]
    env = dict(os.environ, PATH=f"{VENV / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    # Its own session: on a timeout the whole group goes (vng's qemu child included), by the pgid we made.
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        vng, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        vng = f"vng timed out after {timeout} s\n" + proc.communicate()[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        image.unlink(missing_ok=True)
    rc_file, checks = out / "rc", out / "checks.jsonl"
    return {
        "rc": int(rc_file.read_text()) if rc_file.exists() else None,
        "checks": [json.loads(x) for x in checks.read_text().splitlines()] if checks.exists() else [],
        "done": (out / "done").exists(),
        "log": (out / "guest.log").read_text(errors="replace") if (out / "guest.log").exists() else "",
        "vng": vng,
    }
