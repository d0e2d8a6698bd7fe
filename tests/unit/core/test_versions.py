"""meshrun.core.versions: which wireguard-go runs, and the warning an old one earns (pure)."""

from __future__ import annotations

from meshrun.core import versions

OLD = "wireguard-go v0.0.20220316\n\nUserspace WireGuard daemon for linux-amd64.\n"
NEW = "wireguard-go v0.0.20230223\n\nUserspace WireGuard daemon for linux-amd64.\n"


def test_parse_what_wireguard_go_prints():
    assert versions.parse(OLD) == (0, 0, 20220316)
    assert versions.parse(NEW) == (0, 0, 20230223)
    assert versions.parse("wireguard-go 0.0.20250522-dev") == (0, 0, 20250522)
    assert versions.parse("") is None and versions.parse("command not found") is None


def test_only_a_release_without_batched_io_is_warned_about_with_the_cost_and_the_fix():
    warning = versions.wireguard_go_warning(versions.parse(OLD))
    assert warning.startswith("wireguard-go 0.0.20220316 has no batched I/O")
    assert "184-291 Mbit/s" in warning and "4-6x" in warning
    assert "apt-get install -t bookworm-backports wireguard-go" in warning and "kernel WireGuard" in warning
    assert versions.wireguard_go_warning(versions.parse(NEW)) is None
    assert versions.wireguard_go_warning((0, 0, 20231211)) is None
    assert versions.wireguard_go_warning(None) is None  # unknown: say nothing rather than guess
