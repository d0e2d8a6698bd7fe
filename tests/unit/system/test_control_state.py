"""The control-state contract (tests/control_state_contract.py) on every backend of
meshrun.system.control.state.ControlState: SQLite, etcd in memory (FakeEtcd) and a real etcd (TLS, 127.0.0.1).

Without /usr/bin/etcd the real-etcd runs skip, saying why; in CI (`CI` set) they fail instead.
"""

from __future__ import annotations

import pytest
from control_state_contract import (  # noqa: F401 (collected here, against this module's `db`)
    TestEnrol,
    TestState,
    TestTokens,
    seed,
)
from realetcd import RealEtcd

from meshrun.system.control.coordinatordb import CoordinatorDB
from meshrun.system.control.etcdstate import PREFIX, EtcdCoordinatorDB
from meshrun.system.control.fakeetcd import FakeEtcd


@pytest.fixture(scope="module")
def real_etcd(tmp_path_factory):
    server = RealEtcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "fake etcd", "etcd"])
def db(request, tmp_path):
    """One store per backend, seeded as the contract says."""
    if request.param == "sqlite":
        d = CoordinatorDB.create(tmp_path / "coordinator.db")
    elif request.param == "fake etcd":
        d = EtcdCoordinatorDB(FakeEtcd())
    else:
        client = request.getfixturevalue("real_etcd").client
        client.delete(PREFIX, prefix=True)  # the server is shared by the module's tests: each starts empty
        d = EtcdCoordinatorDB(client)
    seed(d)
    yield d
    d.close()  # (an EtcdCoordinatorDB leaves its client open: the real server's outlives the test)


@pytest.fixture
def empty_store(tmp_path):
    """A callable giving one empty store of each backend a dump may move into: [(kind, store)]."""
    return lambda: [
        ("sqlite", CoordinatorDB.create(tmp_path / "moved.db")),
        ("fake etcd", EtcdCoordinatorDB(FakeEtcd())),
    ]
