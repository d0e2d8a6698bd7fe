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


def test_what_a_running_daemon_waits_for_is_known_to_a_later_up_until_it_serves(tmp_path):
    """A second `meshrun up` finds the daemon running: it must say the daemon still waits (it said "up at")."""
    state = StateDir(tmp_path)
    state.create()
    assert process.waiting_for(state) is None
    with process.running(state):
        assert process.waiting_for(state) is None  # running, serving
        process.waiting(state, "a majority is not answering yet", "start the others")
        assert process.waiting_for(state) == ("a majority is not answering yet", "start the others")
        process.done_waiting(state)
        assert process.waiting_for(state) is None
        process.waiting(state, "a majority is not answering yet", "start the others")
    # Its note outlives a daemon killed while it waited, but says nothing without a daemon; the next one clears it.
    assert (state / process.WAITING).exists() and process.waiting_for(state) is None
    process.done_waiting(state)
    process.done_waiting(state)  # twice: nothing to remove is no error
    assert not (state / process.WAITING).exists()
