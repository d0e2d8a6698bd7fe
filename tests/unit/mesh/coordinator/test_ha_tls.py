"""The etcd members' certificates over time (meshrun.mesh.coordinator.ha): the CA record's rotation steps,
what makes a coordinator issue its certificate again, and whole rotations and renewals run by the
coordinators' TlsKeepers on an etcd in memory (no etcd process: a "restart" is recorded, not done)."""

from __future__ import annotations

import datetime
import threading
import time
from types import SimpleNamespace

import pytest

from meshrun.core import keys
from meshrun.mesh.coordinator import ha
from meshrun.mesh.coordinator.ha import CaRecord
from meshrun.system.control.fakeetcd import FakeEtcd
from meshrun.system.files.statedir import StateDir


@pytest.fixture(scope="module")
def cas():
    return keys.new_ca("old"), keys.new_ca("new"), keys.new_ca("newer")


def leaf(ca: tuple[str, str], ip: str, days: int = keys.LEAF_DAYS) -> str:
    return keys.sign_csr(*ca, keys.new_csr("m", ip)[1], ip, days=days)


def test_the_record_reads_what_older_versions_wrote(cas):
    (old, old_key), _, _ = cas
    rec = CaRecord.from_json(f'{{"cert": {old!r}, "key": {old_key!r}}}'.replace("'", '"').replace("\n", "\\n").encode())
    assert rec == CaRecord(old, old_key, (old,)) and not rec.rotating and rec.bundle == old
    assert CaRecord.from_json(rec.to_json()) == rec


def test_a_rotation_trusts_both_then_signs_with_the_new_then_trusts_it_alone(cas):
    (old, old_key), (new, new_key), _ = cas
    names = ["a", "b"]
    rec = CaRecord(old, old_key, (old,))
    trusting = ha.begin_rotation(rec, new)
    assert trusting == CaRecord(old, old_key, (old, new), new) and trusting.rotating
    assert old in trusting.bundle and new in trusting.bundle
    assert "key" not in trusting.next and new_key not in trusting.to_json().decode(), "no new key in etcd yet"
    acks = {n: ha.ack_of(trusting, trusting.bundle, leaf((old, old_key), "10.0.0.1")) for n in names}
    assert ha.trusted_by_all(trusting, acks, names)
    assert not ha.trusted_by_all(trusting, {"a": acks["a"]}, names), "b has not restarted on the bundle"
    assert ha.next_step(trusting, acks, names) is None, "the last step waits for the new CA to sign"
    signing = ha.sign_with(trusting, new, new_key)
    assert signing == CaRecord(new, new_key, (old, new))
    assert ha.sign_with(ha.begin_rotation(trusting, cas[2][0]), new, new_key) is None, "superseded"
    # a has its new certificate, b not yet: the old CA stays trusted
    acks = {
        "a": ha.ack_of(signing, signing.bundle, leaf((new, new_key), "10.0.0.1")),
        "b": ha.ack_of(signing, signing.bundle, leaf((old, old_key), "10.0.0.2")),
    }
    assert ha.next_step(signing, acks, names) is None
    acks["b"] = ha.ack_of(signing, signing.bundle, leaf((new, new_key), "10.0.0.2"))
    done = ha.next_step(signing, acks, names)
    assert done == CaRecord(new, new_key, (new,)) and not done.rotating
    assert ha.next_step(done, acks, names) is None, "nothing rotates"


def test_a_rotation_begun_during_another_drops_the_new_ca_that_never_signed(cas):
    (old, old_key), (new, _), (newer, _) = cas
    trusting = ha.begin_rotation(CaRecord(old, old_key, (old,)), new)
    again = ha.begin_rotation(trusting, newer)
    assert again.trust == (old, newer) and again.next == newer and again.cert == old


def test_a_rotation_begun_while_the_new_ca_signs_keeps_both(cas):
    (old, old_key), (new, new_key), (newer, _) = cas
    signing = CaRecord(new, new_key, (old, new))
    again = ha.begin_rotation(signing, newer)
    assert again.trust == (old, new, newer) and again.cert == new, "members hold certificates of both"


def test_what_makes_a_coordinator_issue_its_certificate_again(cas):
    ca = CaRecord(*cas[0], (cas[0][0],))
    fresh = leaf(cas[0], "10.0.0.1")
    assert ha.leaf_due(fresh, ca, "10.0.0.1") == ""
    assert "renewal" in ha.leaf_due(
        fresh, ca, "10.0.0.1", datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=61)
    )
    assert "CA" in ha.leaf_due(leaf(cas[1], "10.0.0.1"), ca, "10.0.0.1")
    assert "10.0.0.2" in ha.leaf_due(fresh, ca, "10.0.0.2")
    assert "renewal" in ha.leaf_due("", ca, "10.0.0.1")


# --------------------------------------------------------------------------- keepers on an etcd in memory


class Coordinators:
    """Coordinators a..: each with its etcd files and a TlsKeeper; restarts are recorded (and must never overlap)."""

    def __init__(self, tmp_path, monkeypatch, names: list[str]) -> None:
        self.etcd = FakeEtcd()
        self.ca = keys.new_ca("meshrun t etcd")
        self.etcd.put(ha.K_CA, CaRecord(*self.ca, (self.ca[0],)).to_json())
        self.infos = [SimpleNamespace(name=n, overlay_ip=f"10.0.0.{i + 1}") for i, n in enumerate(names)]
        self.db = SimpleNamespace(client=self.etcd, coordinators=lambda: list(self.infos))
        self.restarts: list[str] = []
        self.restarting: set[str] = set()
        net = None  # the network is only for a real restart
        self.keepers = {}
        for info in self.infos:
            state = StateDir(tmp_path / info.name)
            state.create()
            key_pem, cert = ha._issue(*self.ca, info.name, info.overlay_ip)
            ha._write_tls(state, self.ca[0], cert, key_pem)
            self.keepers[info.name] = ha.TlsKeeper(state, {"name": info.name, "overlay_ip": info.overlay_ip}, net)
        monkeypatch.setattr(ha, "TLS_CHECK_S", 0.0)
        monkeypatch.setattr(ha, "etcd_pid", lambda state: 1)
        monkeypatch.setattr(ha, "restart_member", self._restart)

    def _restart(self, state, rec, network, ips) -> int:
        assert not self.restarting, f"{rec['name']} restarts while {self.restarting} does"
        assert self.etcd.get(ha.K_TLS_RESTART).value == rec["name"].encode()
        self.restarting.add(rec["name"])
        self.restarts.append(rec["name"])
        self.restarting.discard(rec["name"])
        return 1

    def tick(self) -> None:
        for k in self.keepers.values():
            k.tick(self.db)

    def files(self, name: str) -> tuple[str, str]:
        d = ha.etcd_dir(self.keepers[name].state)
        return d.read("ca.crt").decode(), d.read("etcd.crt").decode()


def test_a_rotation_run_by_the_keepers_ends_with_every_member_on_the_new_ca_alone(tmp_path, monkeypatch):
    world = Coordinators(tmp_path, monkeypatch, ["a", "b", "c"])
    world.tick()
    assert world.restarts == [], "nothing to do at rest"
    result: list[str] = []
    rotation = threading.Thread(target=lambda: result.append(ha.rotate_ca(world.db, "t", timeout=30)))
    rotation.start()
    deadline = time.monotonic() + 30
    while rotation.is_alive() and time.monotonic() < deadline:
        world.tick()
        time.sleep(0.05)
    rotation.join(1)
    assert result == [""]
    rec = CaRecord.from_json(world.etcd.get(ha.K_CA).value)
    assert not rec.rotating and rec.cert != world.ca[0]
    for info in world.infos:
        trusted, cert = world.files(info.name)
        assert trusted == rec.bundle and world.ca[0] not in trusted
        assert keys.cert_issued_by(cert, rec.cert) and keys.cert_ips(cert) == [info.overlay_ip]
        key = ha.etcd_dir(world.keepers[info.name].state).read("etcd.key").decode()
        assert keys.cert_matches_key(cert, key), "the member keeps its key"
    assert sorted(world.restarts) == ["a", "a", "b", "b", "c", "c"], "two restarts each: trust both, trust the new"
    assert world.etcd.get(ha.K_TLS_RESTART) is None, "the restart lock is given back"


def test_a_rotation_waits_for_a_coordinator_that_does_not_restart_and_says_so(tmp_path, monkeypatch):
    world = Coordinators(tmp_path, monkeypatch, ["a", "b"])
    result: list[str] = []
    rotation = threading.Thread(target=lambda: result.append(ha.rotate_ca(world.db, "t", timeout=1.5)))
    rotation.start()
    while rotation.is_alive():
        world.keepers["a"].tick(world.db)  # b's daemon is down
        time.sleep(0.05)
    assert "b did not restart" in result[0] and "rotate-ca" in result[0]
    rec = CaRecord.from_json(world.etcd.get(ha.K_CA).value)
    assert rec.cert == world.ca[0] and rec.next and world.ca[0] in rec.trust, "the old CA still signs and is trusted"
    assert world.files("b")[0] == world.ca[0]


def test_a_certificate_due_for_renewal_is_renewed_without_a_restart(tmp_path, monkeypatch):
    world = Coordinators(tmp_path, monkeypatch, ["a"])
    d = ha.etcd_dir(world.keepers["a"].state)
    key = d.read("etcd.key").decode()
    short = keys.sign_csr(*world.ca, keys.csr_for_key(key, "a", "10.0.0.1"), "10.0.0.1", days=3)
    d.write("etcd.crt", short)
    future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=2.5)
    assert keys.renew_due(short, future) and not keys.renew_due(short)
    world.tick()
    assert world.files("a")[1] == short, "not due yet"
    monkeypatch.setattr(keys, "renew_due", lambda cert, now=None, renew_days=keys.RENEW_DAYS: cert == short)
    world.tick()
    renewed = world.files("a")[1]
    assert renewed != short and keys.cert_matches_key(renewed, key) and keys.cert_ips(renewed) == ["10.0.0.1"]
    assert world.restarts == []


def test_a_wait_says_it_still_waits_at_most_every_five_seconds():
    """An operator's command that waits (a new coordinator's service, its enrolment port, a CA rotation) is
    never silent longer than PROGRESS_S: `coordinator add` once waited 14-20 s without a line."""
    now = [100.0]
    said: list[str] = []
    progress = ha.Progress(said.append, "waiting for dc6-a", clock=lambda: now[0])
    for _ in range(40):  # 20 s in half-second steps, as the wait loops tick
        now[0] += 0.5
        progress.tick()
    assert said == [f"  still waiting for dc6-a ({s} s) ..." for s in (5, 10, 15, 20)]
