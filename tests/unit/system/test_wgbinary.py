"""Which wireguard-go binary a results file records: the bundled one behind an offline install's wrapper."""

from __future__ import annotations

import gzip
from pathlib import Path

from meshrun.system.machine import wgbinary

# What tools/offline_install.sh writes for a program the machine lacks (prefix /opt/meshrun).
WRAPPER = (
    "#!/bin/sh\n"
    "# meshrun-offline: wireguard-go from Debian's wireguard-go, bundled because this machine has none; written by "
    "install.sh.\n"
    'exec /opt/meshrun/root/usr/bin/wireguard-go "$@"\n'
)


def test_the_wrapper_names_the_bundled_binary(tmp_path):
    w = tmp_path / "wireguard-go"
    w.write_text(WRAPPER)
    assert wgbinary.offline_target(w) == Path("/opt/meshrun/root/usr/bin/wireguard-go")


def test_a_binary_or_another_script_is_no_wrapper(tmp_path):
    elf = tmp_path / "elf"
    elf.write_bytes(b"\x7fELF" + bytes(100))
    other = tmp_path / "script"
    other.write_text('#!/bin/sh\nexec /usr/lib/x/root/usr/bin/wireguard-go "$@"\n')  # not install.sh's
    assert wgbinary.offline_target(elf) is None and wgbinary.offline_target(other) is None
    assert wgbinary.offline_target(tmp_path / "missing") is None


def test_the_package_version_comes_from_the_changelog_beside_the_binary(tmp_path):
    binary = tmp_path / "root/usr/bin/wireguard-go"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"\x7fELF")
    assert wgbinary.changelog_version(binary) is None  # no changelog: unknown, not guessed
    doc = tmp_path / "root/usr/share/doc/wireguard-go"
    doc.mkdir(parents=True)
    with gzip.open(doc / "changelog.Debian.gz", "wt") as f:
        f.write("wireguard-go (0.0.20231211-1~bpo12+1) bookworm-backports; urgency=medium\n\n  * Rebuild.\n")
    assert wgbinary.changelog_version(binary) == "0.0.20231211-1~bpo12+1"
