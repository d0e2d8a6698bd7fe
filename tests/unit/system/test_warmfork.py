"""meshrun.system.machine.warmfork: what a forked child writes is its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from support import REPO_ROOT

PARENT = textwrap.dedent(
    """
    import sys
    from meshrun.system.machine import warmfork
    sys.stdout.write("parent's line\\n")  # a pipe: block-buffered, still in the buffer at the fork
    child = warmfork.fork_call(lambda: print("child's line") or 0)
    got = child.stdout.read()
    child.wait()
    sys.stderr.write(repr(got))
    """
)


def test_the_parents_buffered_output_is_not_written_again_by_the_child():
    """The child flushes every open file at its end (as the interpreter's exit would); the parent's stdout
    buffer, copied by the fork, must already be empty then, or its lines come out twice."""
    r = subprocess.run(
        [sys.executable, "-c", PARENT],
        # Buffered as a script's stdout is by default (PYTHONUNBUFFERED would write each line at once).
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"parent's line\n"
    assert r.stderr == repr(b"child's line\n").encode()
