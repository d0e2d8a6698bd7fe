"""meshrun.mesh.process: the daemon lock is taken once per process, however deeply `running` nests (the
daemon takes it before building its service, whose run() takes it again)."""

from __future__ import annotations

import pytest

from meshrun.errors import StateError
from meshrun.mesh import process
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine import procs


def test_running_nests_in_one_process_and_holds_the_lock_until_the_outer_block_ends(tmp_path):
    state = StateDir(tmp_path)
    state.create()
    with process.running(state):
        with process.running(state):  # the service's run() inside serve(): no second flock, no refusal
            pass
        assert process.pid(state) is not None  # the inner block's end kept the outer one's lock
        with pytest.raises(StateError):  # another holder (a second daemon) is still refused
            procs.DaemonLock(state / "daemon.lock").acquire()
    assert process.pid(state) is None
