"""Several coordinators: the etcd member each one runs, and moving between one coordinator and several.

A network starts with one coordinator and its SQLite database (`meshrun init`). `meshrun coordinator add
NODE --endpoint HOST` (`add`) turns members into coordinators: the first time, the coordinator it runs on
starts an etcd member of its own, writes its database into etcd and restarts its daemon on it; then the
node makes its own etcd key and TLS identity (they never leave it), the CA signs its etcd key's request,
it joins the etcd cluster and its agent restarts as a coordinator. `meshrun coordinator remove NAME`
(`remove`) takes one out again; the last one left moves the state back into SQLite.

Each coordinator's etcd member listens on its overlay address only (client ETCD_CLIENT_PORT, peer
ETCD_PEER_PORT), with client certificates on both (one CA, whose key the coordinators keep in etcd itself
so that any of them can sign a new member), and runs in a cgroup whose nftables guard admits only the
coordinators' overlay addresses (meshrun.system.kernel.firewall.JobGuard): a member that is no coordinator cannot
open a connection to it. It is its own process (state/etcd/etcd.pid): it outlives daemon restarts, and the
daemon starts it again if it is not running (a reboot).

Certificates (`TlsKeeper`, run by every coordinator's daemon loop): each member's certificate names its
overlay address alone (meshrun.core.keys.check_csr) and lives keys.LEAF_DAYS days; its own coordinator renews
it keys.RENEW_DAYS days before the end with its existing key (etcd reads certificate files again on every new
handshake). Taking a coordinator out replaces the CA (`rotate_ca`), because the removed one kept a copy of
its certificate and could read the CA's key: every member first trusts the old and the new CA, then gets a
certificate from the new one, then trusts the new one alone. etcd 3.4 reads its CA file only when it starts,
so each trust change restarts the members one at a time (a lock in etcd), which also cuts every connection
the removed coordinator may still hold; the new CA's key enters etcd only after that first round of restarts.

Files under <state>/etcd/: ca.crt (the trusted CAs), etcd.crt, etcd.key (0600), data/ (etcd's), etcd.log,
etcd.pid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from meshrun.core import doctor, etcdconf, keys
from meshrun.core.etcdconf import TWO_COORDINATORS
from meshrun.core.model import Member, Network, not_public, parse_endpoint, refuse_ipv6, split_endpoint
from meshrun.errors import ControlStateError, CoordinatorError, MeshrunError, NetworkError, StateError, UsageError
from meshrun.mesh import member, process
from meshrun.system.control import coordinatordb, etcd
from meshrun.system.control.coordinatordb import CoordinatorDB, CoordinatorInfo
from meshrun.system.control.etcd import Compare, EtcdClient, Put
from meshrun.system.control.etcdstate import PREFIX, EtcdCoordinatorDB, complete
from meshrun.system.files.statedir import StateDir, remove_tree
from meshrun.system.kernel import net
from meshrun.system.kernel.firewall import JobGuard
from meshrun.system.machine import procs

log = logging.getLogger("meshrun.mesh.coordinator.ha")

ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
ETCD_DIR = "etcd"
ETCD_BINARY = "etcd"  # Debian's etcd-server (dev.sh installs it), found on PATH
HEALTHY_TIMEOUT_S = 60.0
MEMBER_REMOVE_S = 60.0  # how long an etcd member removal etcd is slow to confirm is looked at and tried again
K_CA = PREFIX + b"pki/ca"  # CaRecord: the etcd members' CA, readable by coordinators only
K_TLS_ACK = PREFIX + b"pki/ack/"  # + name: what that coordinator's member trusts and who issued its certificate
K_TLS_RESTART = PREFIX + b"pki/restart"  # held (with a lease) by the one coordinator restarting its member
TLS_CHECK_S = 2.0  # a coordinator looks at the CA record this often (one read)
RESTART_LOCK_S = 90  # the restart lock's lease: a coordinator that dies while holding it frees it after this
ROTATE_TIMEOUT_S = 180.0  # how long `coordinator remove` waits for the CA rotation to finish
GUARD_JOB = "etcd"  # the etcd member's cgroup guard is job "etcd" of "<name>/etcd" (meshrun.core.firewall)


# --------------------------------------------------------------------------- which state a coordinator uses


def replicated(rec: dict) -> bool:
    """Whether this coordinator's state lives in etcd (member.json "control")."""
    return (rec.get("control") or {}).get("kind") == "etcd"


def control_ips(rec: dict) -> list[str]:
    """The coordinators' overlay addresses as member.json's etcd endpoints name them (this one's included)."""
    ips = {etcdconf.url_host(u) for u in (rec.get("control") or {}).get("endpoints") or []}
    return sorted(ip for ip in ips | {str(rec.get("overlay_ip") or "")} if ip)


def etcd_dir(state: StateDir) -> StateDir:
    return StateDir(state / ETCD_DIR)


def client_for(state: StateDir, endpoints: list[str] | None = None, timeout: float = 5.0) -> EtcdClient:
    """An etcd client with this coordinator's certificate, to the endpoints in member.json (or those given)."""
    d = etcd_dir(state)
    if endpoints is None:
        rec = state.read_json("member.json")
        endpoints = list((rec.get("control") or {}).get("endpoints") or [])
        own = own_urls(rec)[0] if rec.get("overlay_ip") else ""
        # This coordinator's own member first: it is gone only with this machine (a watch or a long read on
        # another member's connection hangs when that machine vanishes, until its idle timeout).
        endpoints.sort(key=lambda u: u != own)
    if not endpoints:
        raise StateError(
            f"{state / 'member.json'} names no etcd endpoint", "restore it, or run `meshrun coordinator add` again"
        )
    return EtcdClient(
        endpoints, ca=str(d / "ca.crt"), cert=str(d / "etcd.crt"), key=str(d / "etcd.key"), timeout=timeout
    )


def open_state(state: StateDir, rec: dict, follow: bool = False, readonly: bool = False) -> EtcdCoordinatorDB:
    """This coordinator's view of the replicated state (see meshrun.system.control.etcdstate)."""
    client = client_for(state)
    try:
        if not complete(client):
            raise StateError(
                f"etcd at {', '.join(client.endpoints)} holds no network state",
                "a `meshrun coordinator add` was interrupted: run it again",
            )
        return EtcdCoordinatorDB(client, follow=follow, readonly=readonly, what=f"etcd at {client.endpoint}")
    except BaseException:
        client.close()
        raise


# --------------------------------------------------------------------------- the local etcd member


def own_urls(rec: dict) -> tuple[str, str]:
    ip = str(rec["overlay_ip"])
    return etcdconf.client_url(ip, ETCD_CLIENT_PORT), etcdconf.peer_url(ip, ETCD_PEER_PORT)


def etcd_pid(state: StateDir) -> int | None:
    """The PID of this coordinator's etcd member, if it runs."""
    d = etcd_dir(state)
    try:
        pid = int(d.read("etcd.pid").decode().strip())
    except (StateError, ValueError, FileNotFoundError):
        return None
    args = procs.argv(pid) or []
    return pid if procs.alive(pid) and any(Path(a).name == "etcd" for a in args[:1]) else None


def guard_etcd(name: str, network: Network, coordinator_ips: list[str]) -> JobGuard:
    """The etcd member's guard: only these overlay addresses may open a connection to it (made or replaced)."""
    return JobGuard(GUARD_JOB, f"{name}/etcd", network.interface).create(coordinator_ips)


def start_member(
    state: StateDir,
    rec: dict,
    network: Network,
    initial_cluster: dict[str, str],
    cluster_state: str,
    coordinator_ips: list[str],
    wait: bool = True,
) -> int:
    """Start this coordinator's etcd member (guarded, on its overlay address) and wait until it answers (with
    `wait` False, return its PID at once: the caller waits its own way)."""
    d = etcd_dir(state)
    d.create()
    name = str(rec["name"])
    guard = guard_etcd(name, network, coordinator_ips)
    argv = [ETCD_BINARY] + etcdconf.server_argv(
        name,
        d / "data",
        str(rec["overlay_ip"]),
        ETCD_CLIENT_PORT,
        ETCD_PEER_PORT,
        initial_cluster,
        cluster_state,
        d.path,
    )
    pid = etcd.start_server(argv, d / "etcd.log", cgroup_procs=guard.cgroup / "cgroup.procs")
    d.write("etcd.pid", f"{pid}\n")
    if not wait:
        return pid
    client = client_for(state, [own_urls(rec)[0]])
    try:
        # A member that joins an existing cluster is a learner until `add` gives it its vote: it serves no reads.
        etcd.wait_healthy(
            client, HEALTHY_TIMEOUT_S, log_path=d / "etcd.log", pid=pid, learner=cluster_state == "existing"
        )
    except BaseException:
        etcd.stop_server(pid)
        raise
    finally:
        client.close()
    log.info("etcd member %s runs (pid %d) on %s", name, pid, own_urls(rec)[0])
    return pid


def ensure_member(state: StateDir, rec: dict, network: Network, coordinator_ips: list[str]) -> None:
    """At daemon start: this coordinator's etcd member runs (started again from its data after a reboot) and
    its cluster has a leader.

    Without a majority of the coordinators' members (two of three machines down, or all of them after a
    power cut) it waits as long as that takes, its member left running so that the others find it as they
    come back: a member stopped after a timeout, as before, left each later start alone too, and the first
    `meshrun up` after a site's power cut could never succeed. After MAJORITY_NOTICE_S the process that started
    the daemon is told what it waits for (`meshrun up` returns with that); the log says it every
    MAJORITY_LOG_S. ControlStateError only when the etcd process itself exits."""
    pid = etcd_pid(state)
    if pid is not None:
        guard_etcd(str(rec["name"]), network, coordinator_ips)  # the set may have changed while we were down
    else:
        if not (etcd_dir(state) / "data").exists():
            raise StateError(
                f"this coordinator's etcd member has no data in {etcd_dir(state) / 'data'}",
                "remove it with `meshrun coordinator remove` on another coordinator and add it again",
            )
        member_urls = {str(rec["name"]): own_urls(rec)[1]}
        pid = start_member(state, rec, network, member_urls, "existing", coordinator_ips, wait=False)
    await_leader(state, rec, pid)


MAJORITY_NOTICE_S = 10.0
MAJORITY_LOG_S = 5.0


def await_leader(state: StateDir, rec: dict, pid: int) -> None:
    """Wait, without a limit, until this coordinator's etcd member `pid` sees a leader (see ensure_member)."""
    d = etcd_dir(state)
    client = client_for(state, [own_urls(rec)[0]])
    started = time.monotonic()
    told = False
    try:
        while True:
            try:
                etcd.wait_healthy(client, MAJORITY_LOG_S, log_path=d / "etcd.log", pid=pid, learner=True)
                break
            except ControlStateError:
                if not procs.alive(pid):
                    raise
            message, fix = majority_wait(rec)
            waited = time.monotonic() - started
            log.warning("%s (waited %.0f s): %s", message, waited, fix)
            if not told and waited >= MAJORITY_NOTICE_S:
                process.waiting(state, message, fix)
                told = True
    finally:
        client.close()
    if told:
        process.done_waiting(state)
        log.info("a majority of the coordinators is back after %.0f s", time.monotonic() - started)


def majority_wait(rec: dict) -> tuple[str, str]:
    """What a coordinator without an etcd majority waits for, and what ends the wait (from member.json)."""
    others = [o for o in (rec.get("control") or {}).get("others") or [] if isinstance(o, dict)]
    total = len(others) + 1
    need = total // 2 + 1
    names = ", ".join(f"{o.get('name')} ({o.get('endpoint')})" for o in others) or "the other coordinators"
    return (
        f"this coordinator's etcd member runs, but a majority ({need} of {total}) of the coordinators' members "
        "is not answering yet: the network's state cannot be read",
        f"start the others (`meshrun up` on {names}); this coordinator serves as soon as {need - 1} of them "
        "answer, its daemon keeps waiting until then",
    )


def stop_member(state: StateDir) -> None:
    pid = etcd_pid(state)
    if pid is not None:
        etcd.stop_server(pid)
    with contextlib.suppress(MeshrunError):
        rec = state.read_json("member.json")
        JobGuard(GUARD_JOB, f"{rec['name']}/etcd", Network.from_dict(rec["network"]).interface).remove()


# --------------------------------------------------------------------------- the CA


@dataclasses.dataclass(frozen=True)
class CaRecord:
    """The etcd members' CA as etcd keeps it (K_CA): `cert` and `key` sign members' certificates; `trust` is
    what every member's ca.crt holds (the signing CA, plus another one while a rotation runs); `next` is a
    rotation's new CA while members are still taking it into their trust (its certificate only: its key enters
    etcd when `sign_with` makes it the signing CA).

    A rotation, each step once every coordinator reported the one before (`ack_of`): `begin_rotation` (trust
    old and new), `sign_with` (the new one signs; members get new certificates), `next_step` (trust the new
    one alone: the old CA's certificates, a removed coordinator's among them, open nothing any more)."""

    cert: str
    key: str
    trust: tuple[str, ...]
    next: str = ""

    @classmethod
    def from_json(cls, raw: bytes) -> CaRecord:
        d = json.loads(raw)
        return cls(str(d["cert"]), str(d["key"]), tuple(d.get("trust") or (d["cert"],)), str(d.get("next") or ""))

    def to_json(self) -> bytes:
        d = {"cert": self.cert, "key": self.key, "trust": list(self.trust)}
        return json.dumps(dict(d, next=self.next) if self.next else d).encode()

    @property
    def bundle(self) -> str:
        """ca.crt's contents: the trusted CAs' certificates, one after the other."""
        return "".join(t if t.endswith("\n") else t + "\n" for t in self.trust)

    @property
    def rotating(self) -> bool:
        return bool(self.next) or self.trust != (self.cert,)


def _digest(pem: str) -> str:
    return hashlib.sha256(pem.encode()).hexdigest()[:32]


def begin_rotation(rec: CaRecord, new_cert: str) -> CaRecord:
    """Members are to trust `new_cert` besides what they trust now; a rotation's earlier new CA that never
    signed anything is dropped (the coordinator removed since may have seen its key)."""
    trust = tuple(t for t in rec.trust if t != rec.next or t == rec.cert) + (new_cert,)
    return CaRecord(rec.cert, rec.key, trust, new_cert)


def sign_with(rec: CaRecord, new_cert: str, new_key: str) -> CaRecord | None:
    """The rotation's new CA signs from now on (None when another rotation took its place)."""
    return CaRecord(new_cert, new_key, rec.trust) if rec.next == new_cert else None


def ack_of(rec: CaRecord, trusted: str, leaf: str) -> dict:
    """What a coordinator reports (K_TLS_ACK): the CA bundle its member was started with, and whether the
    signing CA issued its certificate."""
    return {"trust": _digest(trusted), "issuer": _digest(rec.cert) if keys.cert_issued_by(leaf, rec.cert) else ""}


def trusted_by_all(rec: CaRecord, acks: dict[str, dict], names: list[str]) -> bool:
    """Every coordinator in `names` runs its member with the record's CA bundle."""
    return all(acks.get(n, {}).get("trust") == _digest(rec.bundle) for n in names)


def next_step(rec: CaRecord, acks: dict[str, dict], names: list[str]) -> CaRecord | None:
    """The rotation's last step, once every coordinator in `names` trusts the bundle and holds a certificate of
    the signing CA: the other CAs are dropped from the trust. None while that is not so, or nothing rotates."""
    if rec.next or rec.trust == (rec.cert,) or not names or not trusted_by_all(rec, acks, names):
        return None
    if any(acks.get(n, {}).get("issuer") != _digest(rec.cert) for n in names):
        return None
    return CaRecord(rec.cert, rec.key, (rec.cert,))


def leaf_due(leaf: str, rec: CaRecord, ip: str, now: datetime.datetime | None = None) -> str:
    """Why this coordinator's certificate must be issued again ("" when it need not): due for renewal, not
    issued by the signing CA (a rotation), or not for exactly its overlay address."""
    if keys.renew_due(leaf, now):
        return "it is due for renewal"
    if not keys.cert_issued_by(leaf, rec.cert):
        return "the CA changed"
    if keys.cert_ips(leaf) != [ip]:
        return f"it names {keys.cert_ips(leaf)}, not {ip}"
    return ""


def _ca(db: EtcdCoordinatorDB) -> CaRecord:
    kv = db.client.get(K_CA)
    if kv is None:
        raise ControlStateError("the etcd members' CA is not in etcd", "restore the coordinators' state from a backup")
    return CaRecord.from_json(kv.value)


def _update_ca(client: EtcdClient, change) -> CaRecord | None:
    """Apply `change` (CaRecord -> CaRecord or None: nothing to do) to K_CA, compare-and-swap."""
    while True:
        kv = client.get(K_CA)
        if kv is None:
            raise ControlStateError("the etcd members' CA is not in etcd", "restore the coordinators' state")
        new = change(CaRecord.from_json(kv.value))
        if new is None:
            return None
        if client.txn([Compare(K_CA, "MOD", "EQUAL", kv.mod_revision)], [Put(K_CA, new.to_json())]).succeeded:
            return new


def _acks(client: EtcdClient) -> dict[str, dict]:
    kvs, _ = client.get_prefix(K_TLS_ACK)
    out = {}
    for kv in kvs:
        with contextlib.suppress(ValueError):
            out[kv.key[len(K_TLS_ACK) :].decode()] = json.loads(kv.value)
    return out


def _issue(ca_cert: str, ca_key: str, name: str, ip: str) -> tuple[str, str]:
    """A key and a certificate for `ip` (this machine's own key: made here, kept here)."""
    key_pem, csr = keys.new_csr(name, ip)
    return key_pem, keys.sign_csr(ca_cert, ca_key, csr, ip)


def _write_tls(state: StateDir, ca_cert: str, cert: str, key_pem: str | None = None) -> None:
    d = etcd_dir(state)
    d.create()
    d.write("ca.crt", ca_cert)
    d.write("etcd.crt", cert)
    if key_pem is not None:
        d.write("etcd.key", key_pem, secret=True)


# --------------------------------------------------------------------------- certificates over time


def restart_member(state: StateDir, rec: dict, network: Network, coordinator_ips: list[str]) -> int:
    """Stop this coordinator's etcd member and start it again from its data (etcd reads its CA file only when
    it starts); returns the new PID once it answers."""
    pid = etcd_pid(state)
    if pid is not None:
        etcd.stop_server(pid)
    return start_member(state, rec, network, {str(rec["name"]): own_urls(rec)[1]}, "existing", coordinator_ips)


class TlsKeeper:
    """This coordinator's share of the etcd certificates, one `tick` per daemon loop round (at most every
    TLS_CHECK_S): its member's CA bundle is the record's (restarting the member, one coordinator at a time),
    its certificate is the signing CA's, for its overlay address, and not due for renewal (issued again with
    its own key), and it reports both (K_TLS_ACK); during a rotation it also takes the last step when it can."""

    def __init__(self, state: StateDir, rec: dict, network: Network) -> None:
        self.state, self.rec, self.network = state, rec, network
        self.name, self.ip = str(rec["name"]), str(rec["overlay_ip"])
        self.checked = float("-inf")
        self.acked: dict | None = None

    def tick(self, db: EtcdCoordinatorDB) -> None:
        """One look (at most every TLS_CHECK_S). A failure is logged, never raised: the rest of the daemon's
        loop round (peers, paths) does not wait on certificates, and the next look tries again."""
        if time.monotonic() - self.checked < TLS_CHECK_S:
            return
        self.checked = time.monotonic()
        try:
            self._look(db)
        except (MeshrunError, ValueError, OSError) as exc:
            log.warning("etcd certificates: %s", exc)

    def _look(self, db: EtcdCoordinatorDB) -> None:
        client = db.client
        kv = client.get(K_CA)
        if kv is None:
            return
        ca = CaRecord.from_json(kv.value)
        coords = db.coordinators()
        d = etcd_dir(self.state)
        if _read_text(d, etcdconf.CA_FILE) != ca.bundle and not self._restart(
            client, ca, [c.overlay_ip for c in coords]
        ):
            return  # another coordinator restarts its member now: this one's turn comes at a later tick
        leaf = _read_text(d, etcdconf.CERT_FILE)
        why = leaf_due(leaf, ca, self.ip)
        if why:
            csr = keys.csr_for_key(d.read(etcdconf.KEY_FILE).decode(), self.name, self.ip)
            leaf = keys.sign_csr(ca.cert, ca.key, csr, self.ip)
            d.write(etcdconf.CERT_FILE, leaf)  # etcd and our clients take it on their next new connection
            log.info("this coordinator's etcd certificate was issued again (%s)", why)
        ack = ack_of(ca, _read_text(d, etcdconf.CA_FILE), leaf)
        if ack != self.acked:
            client.put(K_TLS_ACK + self.name.encode(), json.dumps(ack).encode())
            self.acked = ack
        if ca.rotating:
            names = [c.name for c in coords]
            if _update_ca(client, lambda rec: next_step(rec, _acks(client), names)) is not None:
                log.info("the etcd CA rotation is complete: the old CA is trusted no more")

    def _restart(self, client: EtcdClient, ca: CaRecord, ips: list[str]) -> bool:
        """Write the record's CA bundle and restart the member with it, holding the restart lock (so the others
        keep their majority); False when another coordinator holds it, or the member is not running (the daemon
        starts it again, with the bundle written then)."""
        if etcd_pid(self.state) is None:
            return False
        lease = client.lease_grant(RESTART_LOCK_S)
        got = client.txn(
            [Compare(K_TLS_RESTART, "CREATE", "EQUAL", 0)], [Put(K_TLS_RESTART, self.name.encode(), lease)]
        ).succeeded
        if not got:
            client.lease_revoke(lease)
            return False
        try:
            etcd_dir(self.state).write(etcdconf.CA_FILE, ca.bundle)
            log.info("the etcd CAs to trust changed: restarting this coordinator's etcd member")
            restart_member(self.state, self.rec, self.network, sorted(set(ips) | {self.ip}))
        finally:
            with contextlib.suppress(MeshrunError):
                client.lease_revoke(lease)
        return True


def _read_text(d: StateDir, name: str) -> str:
    try:
        return d.read(name).decode()
    except StateError:
        return ""


def rotate_ca(
    db: EtcdCoordinatorDB, network_name: str, timeout: float = ROTATE_TIMEOUT_S, say=lambda text: None
) -> str:
    """Replace the etcd members' CA (see CaRecord) and wait until the old one is trusted no more; "" when done,
    else what is left, in words. The new CA's key enters etcd only after every coordinator restarted its member
    on the new bundle (a connection opened before, a removed coordinator's say, is cut by that restart). `say`
    hears every few seconds that it still waits."""
    client = db.client
    progress = Progress(say, "waiting for every coordinator to restart its etcd member on the new CA")
    new_cert, new_key = keys.new_ca(f"meshrun {network_name} etcd")
    _update_ca(client, lambda rec: begin_rotation(rec, new_cert))
    deadline = time.monotonic() + timeout
    signing = False
    ca: CaRecord | None = None
    names: list[str] = []
    acks: dict[str, dict] = {}
    while True:
        try:
            kv = client.get(K_CA)
            ca = CaRecord.from_json(kv.value) if kv is not None else None
            if ca is None or (ca.next != new_cert and ca.cert != new_cert):
                return "another CA rotation took this one's place"
            names = [c.name for c in db.coordinators()]
            acks = _acks(client)
            if not signing and trusted_by_all(ca, acks, names):
                signing = _update_ca(client, lambda rec: sign_with(rec, new_cert, new_key)) is not None
                if not signing:
                    return "another CA rotation took this one's place"
            elif signing:
                _update_ca(client, lambda rec: next_step(rec, _acks(client), names))
                if not ca.rotating and trusted_by_all(ca, acks, names):  # every member restarted on the new CA alone
                    return ""
        except ControlStateError as exc:
            # The members restart one after the other: with two left there is no majority for a moment, and a
            # member that just started may answer an error before it serves.
            log.info("etcd CA rotation: %s; trying again", exc.message)
        if time.monotonic() >= deadline:
            if ca is None:
                return "the etcd CA rotation could not be followed (etcd did not answer)"
            want = {"trust": _digest(ca.bundle), "issuer": _digest(ca.cert)}
            late = sorted(
                n for n in names if any(acks.get(n, {}).get(k) != v for k, v in want.items() if signing or k == "trust")
            )
            if not signing:
                return (
                    f"the etcd CA was not replaced: {', '.join(late) or 'a coordinator'} did not restart its etcd "
                    f"member within {timeout:.0f} s; the old CA is still trusted: run `meshrun coordinator rotate-ca` "
                    "once every coordinator runs"
                )
            return (
                f"the etcd CA rotation goes on without this command ({', '.join(late) or 'a coordinator'} has not "
                "caught up yet): the old CA is trusted until every coordinator has"
            )
        progress.tick()
        time.sleep(0.5)


def rotate(state: StateDir, say=lambda text: None) -> str:
    """`meshrun coordinator rotate-ca`, on a coordinator: replace the etcd members' CA (see `rotate_ca`); `say`
    hears that it still waits."""
    rec, network = member.load(state)
    if rec.get("role") != "coordinator" or not replicated(rec):
        raise UsageError("this network has one coordinator: it has no etcd CA", "run it where there are several")
    db = open_state(state, rec)
    try:
        left = rotate_ca(db, network.name, say=say)
    finally:
        db.close()
    if left:
        raise ControlStateError(
            left, "check `meshrun coordinator list`, then run `meshrun coordinator rotate-ca` again"
        )
    return "the etcd CA was replaced: certificates of the old one open no etcd member any more"


# --------------------------------------------------------------------------- one coordinator -> several


def coordinator_info(rec: dict, network: Network, endpoint: str, fingerprint: str) -> CoordinatorInfo:
    client, peer = own_urls(rec)
    return CoordinatorInfo(
        str(rec["name"]),
        str(rec.get("public_key") or network.coordinator_public_key),
        str(rec["overlay_ip"]),
        endpoint,
        fingerprint,
        client,
        peer,
    )


def replicate(state: StateDir) -> None:
    """Move this lone coordinator's SQLite state into an etcd member of its own (the first step of `add`).

    Undone if anything fails: etcd stopped and its files removed, member.json as it was."""
    rec, network = member.load(state)
    if replicated(rec):
        return
    undo: list = []
    try:
        ca_cert, ca_key = keys.new_ca(f"meshrun {network.name} etcd")
        key_pem, cert = _issue(ca_cert, ca_key, str(rec["name"]), str(rec["overlay_ip"]))
        _write_tls(state, ca_cert, cert, key_pem)
        undo.append(lambda: remove_tree(etcd_dir(state).path))
        rec = dict(rec, public_key=network.coordinator_public_key)
        pid = start_member(state, rec, network, {str(rec["name"]): own_urls(rec)[1]}, "new", [str(rec["overlay_ip"])])
        undo.append(lambda: etcd.stop_server(pid))
        sqlite = CoordinatorDB(state / "coordinator.db", readonly=True)
        try:
            dump = sqlite.dump()
        finally:
            sqlite.close()
        client = client_for(state, [own_urls(rec)[0]])
        db = EtcdCoordinatorDB(client, what=f"etcd at {client.endpoint}")
        try:
            client.put(K_CA, CaRecord(ca_cert, ca_key, (ca_cert,)).to_json())
            dump["coordinators"] = [coordinator_info(rec, network, network.endpoints[0], network.fingerprint).to_dict()]
            db.load(dump)
            # Its row carries its public endpoint from now on: other coordinators dial it there.
            db.add_coordinator(
                str(rec["name"]), network.coordinator_public_key, str(rec["overlay_ip"]), network.endpoints[0]
            )
        finally:
            db.close()
            client.close()
        old = state.read_json("member.json")
        undo.append(lambda: state.write_json("member.json", old))
        state.write_json("member.json", dict(rec, control={"kind": "etcd", "endpoints": [own_urls(rec)[0]]}))
    except BaseException:
        for step in reversed(undo):
            with contextlib.suppress(Exception):
                step()
        raise
    # The SQLite file stays as it was at the move, renamed: a backup, never read again.
    coordinatordb.retire(state / "coordinator.db")
    log.info("the network's state moved into etcd (member %s)", rec["name"])


def prepare(state: StateDir) -> dict:
    """On a node about to become a coordinator: make its etcd key and TLS identity here (they stay here),
    return what the coordinator signs and publishes: {"csr", "fingerprint"}."""
    close_reach()
    rec, _ = member.load(state)
    if rec.get("role") != "node":
        raise UsageError(f"{rec.get('name')} is a coordinator already", "pick a node")
    net.require_tools(ETCD_BINARY)
    d = etcd_dir(state)
    d.create()
    key_pem, csr = keys.new_csr(str(rec["name"]), str(rec["overlay_ip"]))
    d.write("etcd.key", key_pem, secret=True)
    cert_pem, tls_key = keys.generate_tls_identity("meshrun")
    state.write("tls.key", tls_key, secret=True)
    state.write("tls.crt", cert_pem)
    return {"csr": csr, "fingerprint": keys.cert_fingerprint(cert_pem)}


REACH_WINDOW_S = 15.0  # how long a node offers the add's token on its future enrolment port
REACH_TOKEN_BYTES = 32
_REACH: list = []  # this node's open token listener (offer_reach), closed by the next step of the add


def close_reach() -> None:
    """Close the token listener of an add's reachability check, if one is open: the port becomes the enrolment
    port once promoted (the add's next request, `prepare`, comes seconds later, within the window)."""
    while _REACH:
        _REACH.pop().close()


def offer_reach(state: StateDir, body: dict) -> dict:
    """On a node about to become a coordinator: send `body["token"]` (hex) to whoever connects to this node's
    TCP listen port (its enrolment port once promoted) for REACH_WINDOW_S (probe.TokenListener). UsageError for a
    coordinator or a malformed token; StateError when the port is taken here."""
    from meshrun.system.sockets import probe

    rec, network = member.load(state)
    if rec.get("role") != "node":
        raise UsageError(f"{rec.get('name')} is a coordinator already", "pick a node")
    try:
        token = bytes.fromhex(str(body["token"]))
    except (KeyError, ValueError):
        token = b""
    if len(token) != REACH_TOKEN_BYTES:
        raise UsageError("malformed reachability check", "run the same meshrun version everywhere")
    close_reach()
    try:
        _REACH.append(probe.TokenListener(network.listen_port, token, REACH_WINDOW_S))
    except OSError as exc:
        raise StateError(
            f"TCP port {network.listen_port} is taken on {rec['name']} ({exc.strerror})",
            "stop what listens there: a coordinator's enrolment port needs it",
        ) from None
    log.info("offering the add's reachability token on TCP %d for %.0f s", network.listen_port, REACH_WINDOW_S)
    return {"port": network.listen_port, "seconds": REACH_WINDOW_S}


def check_reach(call, name: str, endpoint: str, say=lambda text: None) -> str | None:
    """Before `add` changes anything: does TCP to `endpoint` reach member `name` (the machine, its port open)?
    `call` is _node_call's for `name`. None when it does (or `name` runs a meshrun without the check: the
    check after the promotion still holds), else what went wrong."""
    from meshrun.system.sockets import probe

    token = os.urandom(REACH_TOKEN_BYTES)
    try:
        call("/v1/coordinator/reach", {"token": token.hex()}, 15)
    except MeshrunError as exc:
        if exc.status == 404:
            say(f"{name} runs an older meshrun: its endpoint is checked once it is a coordinator")
            return None
        raise
    host, port = split_endpoint(endpoint)

    def read() -> None:
        try:
            got = probe.read_token(host, port, REACH_TOKEN_BYTES, timeout=3)
        except OSError as exc:
            raise NetworkError(exc.strerror or str(exc) or type(exc).__name__) from None
        if got != token:  # another machine, or a stranger's listener, at that address
            raise NetworkError(f"something other than {name} answers there")

    return _failure(read, min(ENROL_CHECK_S, REACH_WINDOW_S - 2), 1.0, Progress(say, f"checking {endpoint}"))


def promote(state: StateDir, offer: dict) -> None:
    """On that node: its certificate, the cluster, its etcd member started ("existing"), member.json a
    coordinator's. The caller (the node's job API) then restarts the daemon, which comes back as a
    coordinator (meshrun.mesh.run.serve)."""
    close_reach()
    rec, network = member.load(state)
    if rec.get("role") != "node" or not (etcd_dir(state) / "etcd.key").exists():
        raise UsageError("this node was not prepared to become a coordinator", "run `meshrun coordinator add` again")
    try:
        ca_cert, cert = str(offer["ca"]), str(offer["cert"])
        cluster = {str(k): str(v) for k, v in dict(offer["cluster"]).items()}
        endpoints = [str(e) for e in offer["endpoints"]]
        endpoint = parse_endpoint(str(offer["endpoint"]))
        ips = [str(ip) for ip in offer["coordinator_ips"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"malformed promotion ({exc})", "run the same meshrun version everywhere") from None
    if str(rec["overlay_ip"]) not in keys.cert_ips(cert):
        raise UsageError("the offered certificate is not for this node's overlay address", "run it again")
    _write_tls(state, ca_cert, cert)
    start_member(state, rec, network, cluster, "existing", ips)
    state.write_json(
        "member.json",
        dict(
            rec,
            role="coordinator",
            endpoint=endpoint,
            control={"kind": "etcd", "endpoints": endpoints},
        ),
    )
    log.info("%s is a coordinator now (etcd member started)", rec["name"])


def demote(state: StateDir) -> None:
    """On a coordinator that is taken out: stop its etcd member, forget its data and certificates, become a
    node again (its daemon restarts as an agent)."""
    rec, _ = member.load(state)
    stop_member(state)
    remove_tree(etcd_dir(state).path)
    rec = {k: v for k, v in rec.items() if k not in ("control", "endpoint")}
    state.write_json("member.json", dict(rec, role="node"))
    state.remove("tls.key", "tls.crt")
    log.info("%s is a node again", rec["name"])


def members_without(db: EtcdCoordinatorDB, name: str) -> list[Member]:
    return [m for m in db.members() if m.name != name]


def check_endpoint(endpoint: str, network: Network) -> str:
    refuse_ipv6(endpoint)
    try:
        return parse_endpoint(endpoint, default_port=network.listen_port)
    except ValueError as exc:
        raise UsageError(
            f"--endpoint {endpoint!r} is not HOST or HOST:PORT ({exc})",
            "give the address nodes reach that member at, e.g. --endpoint 198.51.100.7",
        ) from None


PROGRESS_S = 5.0  # an operator's command that waits says so at least this often


class Progress:
    """`tick()` in a wait loop says "still WHAT (N s)" through `say` at most every PROGRESS_S seconds, so no
    operator's command is silent longer (`clock` for tests)."""

    def __init__(self, say, what: str, every: float = PROGRESS_S, clock=time.monotonic) -> None:
        self.say, self.what, self.every, self.clock = say, what, every, clock
        self.start = clock()
        self.next = self.start + every

    def tick(self) -> None:
        now = self.clock()
        if now >= self.next:
            self.say(f"  still {self.what} ({now - self.start:.0f} s) ...")
            self.next = now + self.every


def wait_daemon(call, timeout: float = 60.0, say=lambda text: None) -> None:
    """Wait until `call()` (a request to the new coordinator's overlay API) answers (until then its node agent may
    still answer there, refusing an unsigned request); `say` hears that it still waits every few seconds."""
    deadline = time.monotonic() + timeout
    last: MeshrunError | None = None
    progress = Progress(say, "waiting for the coordinator service")
    while time.monotonic() < deadline:
        try:
            call()
            return
        except MeshrunError as exc:
            last = exc
            progress.tick()
            time.sleep(0.5)
    raise CoordinatorError(
        f"the new coordinator did not answer within {timeout:.0f} s ({last})",
        "see its daemon log (meshrun status there)",
    )


# --------------------------------------------------------------------------- the operator's commands

LEARNER_SYNC_S = 60.0  # a new etcd member catches up (a learner) before it gets a vote
GUARD_SETTLE_S = 2.5  # every coordinator's loop admits a new coordinator's address within a tick or two


def _restart_daemon(state: StateDir) -> None:
    """This coordinator's daemon again, on its new state (its jobs' supervisors are not its children)."""
    if process.pid(state) is not None:
        process.stop(state)
        process.spawn(state)


def _node_call(state: StateDir, network: Network, target: Member):
    """A request to `target`'s job API, signed with the job key this coordinator shares with it."""
    from meshrun.system.sockets import transport

    key = member.job_key(state, target.public_key)

    def call(path: str, body: dict, timeout: float) -> dict:
        return transport.call(target.overlay_ip, network.api_port, "POST", path, body, key=key, timeout=timeout)

    return call


def public_endpoint(endpoint: str, network: Network, resolve=net.resolve) -> str:
    """`endpoint` normalised, once its host is known to be an address nodes in other networks can reach (a
    name is resolved with `resolve`); UsageError naming the value and what it is otherwise."""
    endpoint = check_endpoint(endpoint, network)
    host = split_endpoint(endpoint)[0]
    try:
        ip = resolve(host)
    except OSError as exc:
        raise UsageError(
            f"--endpoint {host!r} does not resolve ({exc})", "give the new coordinator's public IP address or DNS name"
        ) from None
    kind = not_public(ip)
    if kind:
        shown = host if host == ip else f"{host} ({ip})"
        raise UsageError(
            f"--endpoint {shown} is a {kind} address: nodes in other networks cannot reach a coordinator there",
            "give the address other networks reach that machine at (its public IP, or a name that resolves to it)",
        )
    return endpoint


def _failure(call, wait: float, every: float, progress: Progress | None = None) -> str | None:
    """None once `call()` succeeds within `wait` seconds (tried at least once, then every `every` s), else the
    last failure's message; `progress` ticks between tries."""
    deadline = time.monotonic() + wait
    while True:
        try:
            call()
            return None
        except MeshrunError as exc:
            if time.monotonic() >= deadline:
                return exc.message
        if progress is not None:
            progress.tick()
        time.sleep(every)


ENROL_CHECK_S = 15.0  # how long `add` waits for the new coordinator's enrolment port to answer at its endpoint


def add(
    state: StateDir,
    name: str,
    endpoint: str,
    settle: float = GUARD_SETTLE_S,
    say=lambda text: None,
    check_endpoint_tls: bool = True,
) -> CoordinatorInfo:
    """`meshrun coordinator add NAME --endpoint HOST`, on a coordinator: member NAME becomes a coordinator.

    The endpoint must be a public address. The first time, this coordinator's state moves into etcd
    (`replicate`) and its daemon restarts on it. The new member joins etcd as a learner (it has no vote, so a
    failed start leaves the cluster as it was) and gets its vote once it caught up; then its enrolment port
    must answer at the endpoint (with `check_endpoint_tls`) before the coordinator is announced to the
    members, else it is taken out again (`remove`: a node again) and CoordinatorError says why. `say(text)`
    hears each step as it starts. UsageError for an unknown member, a coordinator or a bad endpoint; nothing
    of the new coordinator is left if a step fails."""
    from meshrun.system.sockets import transport

    rec, network = member.load(state)
    if rec.get("role") != "coordinator":
        raise StateError(f"{state.path} belongs to a node", "run `meshrun coordinator add` on a coordinator")
    endpoint = public_endpoint(endpoint, network)
    net.require_tools(ETCD_BINARY)
    if replicated(rec):
        db = open_state(state, rec, readonly=True)
    else:
        db = CoordinatorDB(state / "coordinator.db", readonly=True)
    try:
        target = db.member_by_name(name)
    finally:
        db.close()
    _check_target(target, name)
    assert target is not None
    if check_endpoint_tls:
        # First, with nothing changed yet: the endpoint reaches that machine's enrolment port. (Found only
        # after the promotion, a wrong endpoint cost a migration to etcd, two restarts of this daemon, a CA
        # rotation and 40 s, and left a moved-away SQLite file.)
        say(f"checking that TCP {endpoint} reaches {name} before anything changes ...")
        problem = check_reach(_node_call(state, network, target), name, endpoint, say)
        if problem is not None:
            port = split_endpoint(endpoint)[1]
            raise CoordinatorError(
                f"TCP {endpoint} does not reach {name} ({problem}); nothing was changed",
                f"open TCP and UDP {port} on {name} and check --endpoint, then run `meshrun coordinator add` again "
                "(--skip-endpoint-check if only this machine cannot reach it)",
            )
    if not replicated(rec):
        say("moving the network's state from SQLite into etcd on this coordinator ...")
        replicate(state)
        _restart_daemon(state)
        rec, network = member.load(state)
    db = open_state(state, rec)
    try:
        target = db.member_by_name(name)
        _check_target(target, name)
        assert target is not None
        call = _node_call(state, network, target)
        say(f"asking {name} ({target.overlay_ip}) for its etcd certificate request ...")
        health = call("/v1/coordinator/prepare", {}, 60)
        ca = _ca(db)
        # The request comes from the member: it gets a certificate for the address the network gave it, or none.
        cert = keys.sign_csr(ca.cert, ca.key, str(health["csr"]), target.overlay_ip)
        client_url = etcdconf.client_url(target.overlay_ip, ETCD_CLIENT_PORT)
        peer_url = etcdconf.peer_url(target.overlay_ip, ETCD_PEER_PORT)
        info = CoordinatorInfo(
            name, target.public_key, target.overlay_ip, endpoint, str(health["fingerprint"]), client_url, peer_url
        )
        coords = [c for c in db.coordinators() if c.name != name]
        db.put_coordinator(info)  # first: every coordinator's guard admits it (their loops read the registry)
        ips = [c.overlay_ip for c in coords] + [target.overlay_ip]
        guard_etcd(str(rec["name"]), network, ips)
        time.sleep(settle)
        say(f"{name} joins etcd as a learner, catches up, then gets its vote ...")
        new = db.client.member_add([peer_url], learner=True)
        try:
            cluster = {c.name: c.etcd_peer for c in coords if c.etcd_peer} | {name: peer_url}
            call(
                "/v1/coordinator/promote",
                {
                    "ca": ca.bundle,
                    "cert": cert,
                    "cluster": cluster,
                    "endpoints": [c.etcd_client for c in coords if c.etcd_client] + [client_url],
                    "endpoint": endpoint,
                    "coordinator_ips": ips,
                },
                HEALTHY_TIMEOUT_S + 30,
            )
            _vote(db.client, new.id)
        except BaseException:
            with contextlib.suppress(MeshrunError):
                db.client.member_remove(new.id)
            with contextlib.suppress(MeshrunError):
                db.delete_coordinator(name)
            raise
        say(f"waiting for {name}'s coordinator service ...")
        wait_daemon(lambda: transport.call(target.overlay_ip, network.api_port, "GET", "/v1/time", timeout=3), say=say)
        if check_endpoint_tls:
            say(f"checking that {name}'s enrolment port answers at {endpoint} (TCP, pinned TLS) ...")
            host, port = split_endpoint(endpoint)
            problem = _failure(
                lambda: transport.check_tls(host, port, info.fingerprint, timeout=3),
                ENROL_CHECK_S,
                1.0,
                Progress(say, f"checking {name}'s enrolment port"),
            )
            if problem is not None:
                say(f"{name}'s enrolment port does not answer at {endpoint}: taking it out again ...")
                db.close()
                undone = remove(state, name, unreachable_wait=0.0)
                raise CoordinatorError(
                    # Not "nothing was changed": it was a coordinator for a moment, and what undoing that took
                    # (a new etcd CA: it had held the old one's key) is said as it is.
                    f"{name}'s enrolment port does not answer at {endpoint} ({problem}); it was taken out again, "
                    f"no member heard of it ({undone})",
                    f"open TCP and UDP {split_endpoint(endpoint)[1]} on {name} and check --endpoint, then run "
                    "`meshrun coordinator add` again (--skip-endpoint-check if only this machine cannot reach it)",
                )
        db.add_coordinator(name, target.public_key, target.overlay_ip, endpoint)
        save_endpoints(state, [c.etcd_client for c in db.coordinators() if c.etcd_client])
        if len(coords) + 1 == 2:
            say(f"warning: {TWO_COORDINATORS}")
        return info
    finally:
        db.close()


def _check_target(target: Member | None, name: str) -> None:
    if target is None:
        raise UsageError(f"there is no member named {name!r}", "see the members with `meshrun status`")
    if target.is_coordinator:
        raise UsageError(f"{name} is a coordinator already", "see the coordinators with `meshrun coordinator list`")


def _vote(client: EtcdClient, member_id: int) -> None:
    """Give a learner its vote once etcd says it caught up (etcd refuses while it is behind)."""
    deadline = time.monotonic() + LEARNER_SYNC_S
    while True:
        try:
            client.member_promote(member_id)
            return
        except ControlStateError as exc:
            if time.monotonic() >= deadline:
                raise ControlStateError(
                    f"the new etcd member did not catch up within {LEARNER_SYNC_S:.0f} s ({exc.message})",
                    "check the new coordinator's etcd log (<state>/etcd/etcd.log) and its network",
                ) from None
            time.sleep(0.5)


def remove_etcd_member(client: EtcdClient, peer_url: str, timeout: float = MEMBER_REMOVE_S) -> None:
    """Take the etcd member at `peer_url` out of the cluster, and make sure it is out. A removal that got no
    answer (it may have been applied) or that etcd refused for now (a member that just came back makes the
    cluster "unhealthy" to etcd for a few seconds) is looked at again and tried again until `timeout`
    seconds have passed; then the last error is raised."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for m in client.members():
                if peer_url in m.peer_urls:
                    client.member_remove(m.id)
            if not any(peer_url in m.peer_urls for m in client.members()):
                return
        except ControlStateError as exc:
            if time.monotonic() >= deadline:
                raise
            log.info("etcd member %s not removed yet (%s); trying again", peer_url, exc.message)
        if time.monotonic() >= deadline:
            raise ControlStateError(
                f"the etcd member at {peer_url} is still in the cluster after {timeout:.0f} s",
                "check `meshrun status` on the coordinators (etcd needs a majority), then run the command again",
            )
        time.sleep(1.0)


def save_endpoints(state: StateDir, endpoints: list[str], others: list[CoordinatorInfo] | None = None) -> None:
    """member.json's etcd endpoints (where this coordinator's client starts after a restart) and, if given, the
    other coordinators' public faces (whom it asks after being away whether it was removed: removed_by)."""
    rec = state.read_json("member.json")
    control = dict(rec.get("control") or {}, endpoints=sorted(set(endpoints)))
    if others is not None:
        control["others"] = [
            {"name": c.name, "public_key": c.public_key, "endpoint": c.endpoint, "fingerprint": c.fingerprint}
            for c in sorted(others, key=lambda c: c.name)
        ]
    if control != rec.get("control"):
        state.write_json("member.json", dict(rec, control=control))


def removed_by(state: StateDir, rec: dict, network: Network, timeout: float = 5.0) -> str | None:
    """The name of another coordinator that says this one was removed from the network for good while it was
    away (`coordinator remove NAME --force`), asked at its public enrolment port (member.json's control
    "others"; nothing of the overlay reaches a removed member); None when none says so or none answers (the
    others may be down too, or this machine's link: then its etcd member starts as always)."""
    from meshrun.core import auth
    from meshrun.mesh.coordinator.enrolment import MEMBERSHIP_PATH, MEMBERSHIP_PURPOSE
    from meshrun.system.sockets import transport

    private = state.read("private.key").decode().strip()
    name, own = str(rec["name"]), keys.public_key(private)
    for other in (rec.get("control") or {}).get("others") or []:
        try:
            host, port = split_endpoint(str(other["endpoint"]))
            proof = auth.enrol_proof(
                keys.shared_secret(private, str(other["public_key"])),
                network.name,
                name,
                own,
                MEMBERSHIP_PURPOSE,
                time.time(),
            )
            body = {"name": name, "public_key": own, "possession": proof}
            answer = transport.call(
                host, port, "POST", MEMBERSHIP_PATH, body, fingerprint=str(other["fingerprint"]), timeout=timeout
            )
        except (MeshrunError, KeyError, ValueError) as exc:
            log.info("could not ask %s whether this coordinator is still a member: %s", other.get("name"), exc)
            continue
        if isinstance(answer, dict) and answer.get("removed") is True:
            return str(other["name"])
    return None


def refuse_removed(state: StateDir, rec: dict, by: str) -> StateError:
    """A coordinator that `by` says was removed while it was away: its etcd member stopped if it ran, its record
    marked removed (so `meshrun down --purge` may delete what is left), and the error it stops with."""
    stop_member(state)
    state.write_json("member.json", dict(rec, removed=True, removed_by=by))
    name = str(rec["name"])
    _, fix = doctor.removed("coordinator", name, by)
    return StateError(
        f"{by} says this coordinator ({name}) was removed from the network for good while it was away "
        f"(`meshrun coordinator remove {name} --force`): its etcd member was not started",
        fix,
    )


UNREACHABLE_WAIT_S = 20.0  # `remove` asks a silent coordinator this long before calling it gone


def remove(
    state: StateDir,
    name: str,
    unreachable_wait: float = UNREACHABLE_WAIT_S,
    force: bool = False,
    confirm=None,
    say=lambda text: None,
) -> str:
    """`meshrun coordinator remove NAME`, on another coordinator: NAME is a node again, or, when it does not
    answer for `unreachable_wait` seconds, a removed member (its machine is gone: its key can never rejoin).

    A silent coordinator may be rebooting, so taking it out for good needs `force`, or `confirm(question)`
    answering True (an operator at a terminal); otherwise UsageError, with nothing changed. The last
    coordinator left moves the state back into SQLite. Returns what happened to NAME, in words, once all of it
    has happened. `say(text)` hears each step."""
    from meshrun.system.sockets import transport

    rec, network = member.load(state)
    if rec.get("role") != "coordinator" or not replicated(rec):
        raise UsageError("this network has one coordinator", "`meshrun coordinator add` makes more first")
    if name == rec["name"]:
        raise UsageError(f"{name} is this coordinator", "run `meshrun coordinator remove` on another coordinator")
    db = open_state(state, rec)
    try:
        coords = db.coordinators()
        info = next((c for c in coords if c.name == name), None)
        if info is None:
            names = ", ".join(c.name for c in coords)
            raise UsageError(f"there is no coordinator named {name!r}", f"the coordinators are: {names}")
        say(f"asking {name} ({info.overlay_ip}) whether it is there ...")
        # With --force the operator knows the machine is gone: one try, not the wait for a reboot.
        reachable = (
            _failure(
                lambda: transport.call(info.overlay_ip, network.api_port, "GET", "/v1/time", timeout=5),
                0.0 if force else unreachable_wait,
                2.0,
                Progress(say, f"asking {name}"),
            )
            is None
        )
        if not reachable and not force:
            question = (
                f"{name} has not answered for {unreachable_wait:.0f} s: if it is only rebooting, wait for it. "
                f"Remove it from the network for good (its key can never rejoin)?"
            )
            if confirm is None or not confirm(question):
                raise UsageError(
                    f"{name} has not answered for {unreachable_wait:.0f} s (rebooting, or gone?): nothing was changed",
                    f"wait for it and run this again; if its machine is gone for good: meshrun coordinator remove "
                    f"{name} --force",
                )
        # The records first, while every member that answers still votes: then the etcd member goes.
        db.delete_coordinator(name)
        db.demote_coordinator(info.public_key)
        if reachable:
            outcome = f"{name} is a node again"
        else:
            db.remove_member(name)
            outcome = f"{name} did not answer: removed from the network (its key can never rejoin)"
        left = [c for c in coords if c.name != name]
        dump = db.dump() if len(left) == 1 else None
        remove_etcd_member(db.client, info.etcd_peer)
        # Those left elect a leader among themselves (it may have been the one removed) before anyone writes.
        etcd.wait_healthy(db.client, HEALTHY_TIMEOUT_S)
        if reachable:
            try:
                key = member.OverlayKeys(state)(info.public_key)  # it obeys root on a coordinator only
                transport.call(
                    info.overlay_ip, network.api_port, "POST", "/v1/coordinators/demote", {}, timeout=15, key=key
                )
            except MeshrunError as exc:
                outcome = (
                    f"{name} left the cluster but did not restart as a node ({exc.message}): run `meshrun up` there"
                )
        save_endpoints(state, [c.etcd_client for c in left if c.etcd_client])
        guard_etcd(str(rec["name"]), network, [c.overlay_ip for c in left])
        if len(left) == 2:
            outcome += f"; {TWO_COORDINATORS}"
        if dump is None:
            say("moving the remaining coordinators to a new etcd CA ...")
            # It kept a copy of its certificate and could read the CA's key: those left move to a new CA.
            with contextlib.suppress(MeshrunError):
                db.client.delete(K_TLS_ACK + name.encode())
            left_over = rotate_ca(db, network.name, say=say)
            return outcome + (f"; {left_over}" if left_over else "; the etcd CA was replaced")
    finally:
        db.close()
    unreplicate(state, dump, left[0])
    _restart_daemon(state)
    return outcome + "; the network's state is back in SQLite on this coordinator"


def unreplicate(state: StateDir, dump: dict, me: CoordinatorInfo) -> None:
    """The last coordinator: the state from etcd into a new SQLite database, its etcd member stopped. The
    network's description names this coordinator from now on (it may not be the first one)."""
    net = Network.from_dict(json.loads(dump["meta"]["network"]))
    net = dataclasses.replace(
        net,
        coordinator_ip=me.overlay_ip,
        coordinator_public_key=me.public_key,
        endpoints=(me.endpoint,),
        fingerprint=me.fingerprint,
    )
    dump = dict(dump, meta=dict(dump["meta"], network=json.dumps(net.to_dict())))
    coordinatordb.build(state / "coordinator.db", dump)
    stop_member(state)
    remove_tree(etcd_dir(state).path)
    rec = state.read_json("member.json")
    state.write_json("member.json", {k: v for k, v in rec.items() if k != "control"})
    log.info("the network's state moved back into SQLite")
