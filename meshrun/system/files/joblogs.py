"""A job's files: its directory layout, bounded output logs, and reading them from an offset.

On the coordinator, <state>/jobs/<id>/ holds spec.json (what was asked), job.json (the record the
supervisor keeps), supervisor.lock / supervisor.out, and logs/<node>.log: every line of that
node's output as it arrived, prefixed with its arrival time in milliseconds, so `meshrun logs`
can merge nodes in order. On a node, <state>/jobs/<id>/ holds code/ (shipped), share.json (the
command), share.lock, output.log and status.json. A coordinator that takes a share keeps it in
<state>/jobs/<id>/share/.

Logs are bounded: past `cap` bytes a log keeps its head, counts what it drops, and keeps the
last TAIL_LINES lines in memory, written after a marker when the log is closed.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

from meshrun.system.files.statedir import StateDir

LOG_CAP = 256 << 20  # per log file (a node's output, or its mirror on the coordinator)
TAIL_LINES = 2000
READ_CHUNK = 256 << 10


def jobs_root(state: StateDir) -> StateDir:
    """<state>/jobs: every job's directory on this member."""
    return StateDir(state / "jobs")


def job_dir(state: StateDir, job_id: str, create: bool = False) -> StateDir:
    """The directory of job `job_id` in a member's state (the caller checked the id: JOB_ID_RE); made 0700
    with `create`."""
    d = StateDir(jobs_root(state) / job_id)
    if create:
        d.create()
    return d


def job_ids(state: StateDir) -> list[str]:
    """Every job directory's name, oldest first."""
    root = jobs_root(state).path
    if not root.is_dir():
        return []
    return [p.name for p in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime) if p.is_dir()]


class BoundedLog:
    """Append-only lines, at most `cap` bytes on disk plus the tail kept at close."""

    def __init__(self, path: Path, cap: int = LOG_CAP) -> None:
        self.path = Path(path)
        self.cap = cap
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.f = os.fdopen(fd, "ab")
        self.size = self.f.seek(0, os.SEEK_END)
        self.dropped = 0
        self.tail: collections.deque[bytes] = collections.deque(maxlen=TAIL_LINES)

    def write(self, line: str) -> None:
        data = line.rstrip("\n").encode("utf-8", errors="replace") + b"\n"
        if self.size + len(data) > self.cap:
            self.dropped += 1
            self.tail.append(data)
            return
        self.f.write(data)
        self.f.flush()
        self.size += len(data)

    def close(self) -> None:
        if self.dropped:
            kept = len(self.tail)
            self.f.write(
                f"[meshrun: {self.dropped - kept} line(s) dropped past the {self.cap >> 20} MiB bound; "
                f"the last {kept} follow]\n".encode()
            )
            self.f.writelines(self.tail)
        self.f.close()


def read_from(path: Path, offset: int, limit: int = READ_CHUNK, final: bool = False) -> tuple[list[str], int]:
    """Whole lines of `path` from byte `offset` (at most about `limit` bytes); (lines, next offset).

    Lines end at "\\n" only. Always moves on when a full chunk holds no newline (a line longer than
    `limit`): that chunk is returned as a line, cut at a UTF-8 character boundary. A shorter chunk
    without one is a line still being written: nothing is returned until it ends, unless `final` (the
    writer has finished: it is the file's last line).
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return [], offset
    # The writer is gone and this is the end of the file: its last line counts, ended or not.
    unended = final and 0 < len(data) < limit and not data.endswith(b"\n")
    end = len(data) if unended else data.rfind(b"\n") + 1
    if end == 0:
        if len(data) < limit:
            return [], offset
        end = utf8_boundary(data)
        return [data[:end].decode("utf-8", errors="replace")], offset + end
    # "\n" only: a redraw's "\r" marker (meshrun.core.termtext) and other separators splitlines() knows stay
    text = data[:end].decode("utf-8", errors="replace")
    return text.removesuffix("\n").split("\n"), offset + end


def utf8_boundary(data: bytes) -> int:
    """The length of the longest prefix of `data` that does not end inside a UTF-8 character (at least 1)."""
    end = len(data)
    back = 0
    while back < 3 and end - back - 1 >= 0 and data[end - back - 1] & 0xC0 == 0x80:
        back += 1
    lead = end - back - 1
    if lead >= 0 and data[lead] >= 0xC0:  # a lead byte: is its character complete?
        need = 2 if data[lead] < 0xE0 else 3 if data[lead] < 0xF0 else 4
        if back + 1 < need:
            return max(lead, 1)
    return end


def size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0
