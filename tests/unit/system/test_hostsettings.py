"""meshrun.system.kernel.hostsettings: the value a host setting had before meshrun, recorded before the change,
survives a crash and a restart, and is what leave, down and untrust put back. /proc/sys is a temporary tree."""

from __future__ import annotations

import stat

import pytest

from meshrun.errors import StateError
from meshrun.system.kernel.hostsettings import HostSettings

RP = "net/ipv4/conf/eth0/rp_filter"


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc-sys"
    (root / "net/ipv4/conf/eth0").mkdir(parents=True)
    (root / RP).write_text("1\n")
    return root


def test_the_first_value_is_recorded_before_the_change_and_kept_over_later_ones(tmp_path, proc):
    record = tmp_path / "state" / "host-settings.json"
    record.parent.mkdir()
    HostSettings(record, proc).change(RP, "2")
    assert (proc / RP).read_text() == "2"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    # The agent crashed and was restarted: it finds its own 2, changes it again; the record still says 1.
    again = HostSettings(record, proc)
    assert again.read(RP) == "2"
    again.change(RP, "2")
    assert again.originals() == {RP: "1"}
    assert HostSettings(record, proc).restore() == {RP: "1"}
    assert (proc / RP).read_text() == "1"
    assert not record.exists()  # nothing left to put back: no record


def test_a_change_that_cannot_be_recorded_is_not_made(tmp_path, proc):
    with pytest.raises(StateError, match="cannot write"):
        HostSettings(tmp_path / "missing-dir" / "host-settings.json", proc).change(RP, "2")
    assert (proc / RP).read_text() == "1\n"


def test_restore_takes_only_the_named_settings_and_forgets_a_vanished_interface(tmp_path, proc):
    (proc / "net/ipv4/conf/eth1").mkdir()
    (proc / "net/ipv4/conf/eth1/rp_filter").write_text("1")
    (proc / "net/ipv4/ip_forward").write_text("0")
    s = HostSettings(tmp_path / "host-settings.json", proc)
    for setting in (RP, "net/ipv4/conf/eth1/rp_filter", "net/ipv4/ip_forward"):
        s.change(setting, "2")
    (proc / "net/ipv4/conf/eth1/rp_filter").unlink()  # eth1 went away
    (proc / "net/ipv4/conf/eth1").rmdir()
    assert s.restore("net/ipv4/conf/") == {RP: "1"}
    assert s.originals() == {"net/ipv4/ip_forward": "0"}
    assert (proc / "net/ipv4/ip_forward").read_text() == "2"


def test_adopt_keeps_a_recorded_value(tmp_path, proc):
    s = HostSettings(tmp_path / "host-settings.json", proc)
    s.adopt(RP, "0")
    s.adopt(RP, "2")
    s.change(RP, "2")
    assert s.originals() == {RP: "0"}


@pytest.mark.parametrize("text", ["not json", '["a"]', '{"net/ipv4/conf/eth0/rp_filter": 1}'])
def test_a_corrupt_record_names_itself_and_the_fix(tmp_path, proc, text):
    record = tmp_path / "host-settings.json"
    record.write_text(text)
    with pytest.raises(StateError) as err:
        HostSettings(record, proc).change(RP, "2")
    assert str(record) in str(err.value) and "sysctl" in err.value.fix
    assert (proc / RP).read_text() == "1\n"
