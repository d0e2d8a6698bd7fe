"""A real single-member etcd for tests: 127.0.0.1, random ports, TLS both ways, configured as
meshrun.core.etcdconf.server_argv configures a coordinator's member, started and stopped by its PID.

Without /usr/bin/etcd a test that needs it skips, saying why; in CI (`CI` set) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from support import cannot_run

from meshrun.core import etcdconf, keys
from meshrun.system.control import etcd
from meshrun.system.control.etcd import EtcdClient

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_etcd() -> None:
    if not os.access(ETCD, os.X_OK):
        cannot_run("the real-etcd tests", f"etcd is not installed ({ETCD}; Debian: apt install etcd-server)")


def issue(ca: tuple[str, str], tls: Path, name: str, ip: str) -> tuple[Path, Path]:
    key, csr = keys.new_csr(name, ip)
    cert_path, key_path = tls / f"{name}.crt", tls / f"{name}.key"
    cert_path.write_text(keys.sign_csr(*ca, csr, ip))
    key_path.write_text(key)
    key_path.chmod(0o600)
    return cert_path, key_path


class RealEtcd:
    """A single-member etcd under `root` (its TLS files, data and log), `quota` bytes of backend if given."""

    def __init__(self, root: Path, quota: int | None = None) -> None:
        need_etcd()
        self.root = root
        tls = root / "tls"
        tls.mkdir()
        self.ca = keys.new_ca("meshrun-etcd-ca")
        (tls / etcdconf.CA_FILE).write_text(self.ca[0])
        issue(self.ca, tls, "etcd", "127.0.0.1")
        self.client_cert, self.client_key = issue(self.ca, tls, "client", "127.0.0.1")
        self.ca_file = str(tls / etcdconf.CA_FILE)
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = etcdconf.client_url("127.0.0.1", self.client_port)
        argv = etcdconf.server_argv(
            "m1",
            root / "data",
            "127.0.0.1",
            self.client_port,
            self.peer_port,
            {"m1": etcdconf.peer_url("127.0.0.1", self.peer_port)},
            "new",
            tls,
        )
        if quota is not None:
            argv[argv.index("--quota-backend-bytes") + 1] = str(quota)
        self.log = root / "etcd.log"
        self.pid = etcd.start_server([ETCD, *argv], self.log)
        self.client = self.make_client([self.url])
        try:
            etcd.wait_healthy(self.client, 60, self.log, self.pid)
        except BaseException:
            self.stop()
            raise

    def make_client(self, endpoints: list[str] | None = None, timeout: float = 5.0) -> EtcdClient:
        return EtcdClient(endpoints or [self.url], self.ca_file, str(self.client_cert), str(self.client_key), timeout)

    def stop(self) -> None:
        self.client.close()
        etcd.stop_server(self.pid)
