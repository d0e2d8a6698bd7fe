"""End-to-end: a coordinator taken out keeps nothing that opens etcd. Three coordinators on real etcd members;
C's etcd certificate and key are copied out of its state directory while it is a coordinator (what a removed
machine, or whoever holds its disk, keeps). After `meshrun coordinator remove C` the etcd CA is replaced:
the remaining members refuse that certificate, while the coordinators left go on working.

The certificate is tried from A's namespace (a coordinator's overlay address, which the members' nftables
guard admits), so a refusal is etcd's TLS refusing the certificate, not the guard dropping C's address.
"""

from __future__ import annotations

import json
import shutil

import pytest

from meshrun.lab.mesh import Mesh
from meshrun.lab.testbed import DatacenterSpec

pytestmark = [pytest.mark.netns, pytest.mark.slow]

A, B, C = "dc1-a", "dc2-a", "dc3-a"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from support import joined_mesh

    with joined_mesh(tmp_path_factory, [DatacenterSpec(f"dc{i}") for i in (1, 2, 3)], A, (B, C), promote=(B, C)) as m:
        yield m


def health(mesh: Mesh, where: str, ip: str, cert, key) -> str:
    """etcd's /health at `ip`'s client port, asked from `where` with this client certificate: the HTTP status,
    or curl's error (a TLS refusal). The server's certificate is not what is tested here (-k)."""
    res = mesh.world.node(where).run(
        "curl", "-sk", "--max-time", "10", "--cert", str(cert), "--key", str(key),
        "-o", "/dev/null", "-w", "%{http_code}", f"https://{ip}:2379/health",
        check=False, timeout=30,
    )  # fmt: skip
    return res.stdout.strip() if res.returncode == 0 else f"curl exit {res.returncode} ({res.stdout.strip()})"


def test_a_removed_coordinators_certificate_opens_no_etcd_member_any_more(mesh, tmp_path):
    rows = {r["name"]: r for r in json.loads(mesh.meshrun(A, "coordinator", "list", "--json").stdout)}
    assert set(rows) == {"coordinator", B, C} and all(r["etcd"] == "ok" for r in rows.values()), rows
    ip_a, ip_b = rows["coordinator"]["overlay_ip"], rows[B]["overlay_ip"]
    etcd_c = mesh.state_dir(mesh.world.node(C)) / "etcd"
    etcd_b = mesh.state_dir(mesh.world.node(B)) / "etcd"
    kept = tmp_path / "kept"
    kept.mkdir()
    for f in ("etcd.crt", "etcd.key"):
        shutil.copy(etcd_c / f, kept / f)
    # The negative control: while C is a coordinator its certificate opens every member.
    for ip in (ip_a, ip_b):
        assert health(mesh, A, ip, kept / "etcd.crt", kept / "etcd.key") == "200"

    out = mesh.meshrun(A, "coordinator", "remove", C, timeout=300).stdout
    assert f"{C} is a node again" in out and "the etcd CA was replaced" in out, out

    for ip in (ip_a, ip_b):
        answer = health(mesh, A, ip, kept / "etcd.crt", kept / "etcd.key")
        assert answer != "200" and answer.startswith("curl exit"), f"C's old certificate still opens {ip}: {answer}"
    # Those left work: B's current certificate opens both members, the state answers and takes writes.
    for ip in (ip_a, ip_b):
        assert health(mesh, A, ip, etcd_b / "etcd.crt", etcd_b / "etcd.key") == "200"
    rows = {r["name"]: r for r in json.loads(mesh.meshrun(B, "coordinator", "list", "--json").stdout)}
    assert set(rows) == {"coordinator", B} and all(r["etcd"] == "ok" for r in rows.values()), rows
    assert mesh.meshrun(B, "token", "create", "--ttl", "5m").stdout.strip()
    trusted = (etcd_b / "ca.crt").read_text()
    assert (
        trusted.count("BEGIN CERTIFICATE") == 1
        and trusted == (mesh.state_dir(mesh.world.node(A)) / "etcd" / "ca.crt").read_text()
    ), "both members trust the new CA alone"
