"""meshrun.system.files.joblogs, a share's output and `follow`: reading never stalls on output without newlines,
lines stay bounded and whole, and every line shown is its own node's."""

from __future__ import annotations

import io

from meshrun.core import termtext
from meshrun.core.jobspec import JobRecord
from meshrun.jobs import control
from meshrun.jobs.share import Share, share_output
from meshrun.system.files import joblogs
from meshrun.system.files.statedir import StateDir


def test_a_chunk_without_a_newline_is_passed_on_and_the_offset_always_advances(tmp_path):
    """The bug: 400 KiB of tqdm-style redraws on one line stalled `meshrun train` for ever."""
    log = tmp_path / "output.log"
    bar = "".join(f"\r{i:6d}/100000 [{'#' * 20}]" for i in range(400 * 1024 // 30)).encode()
    log.write_bytes(b"[dc1-a r0] " + bar + b"\n[dc1-a r0] done\n")
    offset, lines = 0, []
    for _ in range(50):
        got, new = joblogs.read_from(log, offset)
        assert new > offset or new == log.stat().st_size
        lines += got
        offset = new
        if offset == log.stat().st_size:
            break
    assert offset == log.stat().st_size and lines[-1] == "[dc1-a r0] done"
    assert "".join(lines[:-1]) == ("[dc1-a r0] " + bar.decode())


def test_a_line_cut_between_reads_keeps_its_characters(tmp_path):
    log = tmp_path / "output.log"
    text = "é" * 100_000 + "\n"
    log.write_bytes(text.encode())
    offset, parts = 0, []
    while offset < log.stat().st_size:
        got, offset = joblogs.read_from(log, offset, limit=4097)  # odd: a cut would fall mid-character
        parts += got
    assert "".join(parts) == "é" * 100_000 and "\ufffd" not in "".join(parts)


def test_a_line_still_being_written_waits(tmp_path):
    log = tmp_path / "output.log"
    log.write_bytes(b"complete\npartial")
    assert joblogs.read_from(log, 0) == (["complete"], 9)
    assert joblogs.read_from(log, 9) == ([], 9)


def test_share_output_reaches_the_end_and_reports_done(tmp_path):
    job = StateDir(tmp_path / "job")
    job.create()
    (job / "output.log").write_bytes(b"[n r0] " + b"\rx" * 300_000 + b"\n[n r0] last line\n")
    job.write_json("status.json", {"code": 0})
    offset, lines = 0, []
    for _ in range(20):
        ans = share_output(job, offset, 0)
        lines += ans["lines"]
        offset = ans["offset"]
        if ans["done"]:
            break
    assert ans["done"] and ans["status"] == {"code": 0} and lines[-1] == "[n r0] last line"


def test_the_last_line_of_a_finished_log_is_read_even_without_a_newline(tmp_path):
    log = tmp_path / "output.log"
    log.write_bytes(b"complete\npartial")
    assert joblogs.read_from(log, 9) == ([], 9)  # still being written: wait
    assert joblogs.read_from(log, 9, final=True) == (["partial"], 16)  # the writer is gone: it is the last
    assert joblogs.read_from(log, 0, final=True) == (["complete", "partial"], 16)
    assert joblogs.read_from(log, 16, final=True) == ([], 16)


def test_share_output_is_done_when_the_log_ends_without_a_newline(tmp_path):
    """A share killed mid-write (or a full disk) leaves a partial last line: `done` must still come."""
    job = StateDir(tmp_path / "job")
    job.create()
    (job / "output.log").write_bytes(b"[n r0] one\n[n r0] cut sho")
    job.write_json("status.json", {"code": 0})
    ans = share_output(job, 0, 0)
    assert ans["lines"] == ["[n r0] one", "[n r0] cut sho"] and ans["done"] and ans["status"] == {"code": 0}


def test_lines_split_on_newlines_only(tmp_path):
    """Other separators (U+2028, NEL, \\r...) would let a line's tail pass for a line of its own."""
    log = tmp_path / "output.log"
    log.write_bytes("[n r0] a\u2028[m r1] b\x85c\r[m r1] d\x1c\n".encode())
    assert joblogs.read_from(log, 0)[0] == ["[n r0] a\u2028[m r1] b\x85c\r[m r1] d\x1c"]


def _share(tmp_path, node="dc1-a"):
    """A Share with only what its pumps use (no torchrun)."""
    share = Share.__new__(Share)
    share.node, share.error = node, ""
    share.log = joblogs.BoundedLog(tmp_path / "output.log")
    return share


def _pumped(tmp_path, data: bytes, is_stderr: bool = False) -> list[str]:
    share = _share(tmp_path)
    share._pump(io.BufferedReader(io.BytesIO(data)), is_stderr)
    share.log.close()
    return (tmp_path / "output.log").read_bytes().decode().split("\n")[:-1]


def test_the_share_keeps_worker_lines_and_settles_torchruns_own(tmp_path):
    lines = _pumped(
        tmp_path,
        (
            b"[dc1-a r0] epoch 1\n"
            b"[dc1-a r1] \r 50%|#####     |\n"  # a worker's redraw: its marker stays
            b"torchrun 10%\rtorchrun 100%\r\n"  # torchrun's own: as a terminal leaves it
            b"\x1b]0;title\x07\x1b[2Jcleared \x1b[1mbold\x1b[0m\n"
            b"[dc2-a r0] not from dc2-a\n"  # another node's prefix: this node's line
            b"no newline at the end"
        ),
    )
    assert lines == [
        "[dc1-a r0] epoch 1",
        "[dc1-a r1] \r 50%|#####     |",
        "[dc1-a] torchrun 100%",
        "[dc1-a] cleared \x1b[1mbold\x1b[0m",
        "[dc1-a] [dc2-a r0] not from dc2-a",
        "[dc1-a] no newline at the end",
    ]


def test_the_share_reads_bounded_lines_and_keeps_characters_whole(tmp_path):
    from meshrun.jobs.share import LINE_CAP

    worker_line = "[dc1-a r0] " + "€" * termtext.MAX_LINE  # the longest a worker writes
    torchrun_line = "é" * LINE_CAP  # 2 * LINE_CAP bytes, no newline
    lines = _pumped(tmp_path, (worker_line + "\n" + torchrun_line + "\nend\n").encode(), is_stderr=True)
    assert lines[0] == worker_line  # whole: a capped line fits
    pieces = lines[1:-1]
    assert len(pieces) == 2 and all(p.startswith("[dc1-a] ") for p in pieces)
    assert "".join(p[len("[dc1-a] ") :] for p in pieces) == torchrun_line  # nothing garbled at the cut
    assert lines[-1] == "[dc1-a] end"


def test_the_share_finds_torchruns_error_line(tmp_path):
    share = _share(tmp_path)
    share._pump(io.BufferedReader(io.BytesIO(b"RuntimeError: \x1b[31mboom\x1b[0m\rRuntimeError: boom 2\n")), True)
    assert share.error == "RuntimeError: boom 2"


def finished_job(tmp_path, logs: dict[str, bytes]) -> StateDir:
    """A coordinator's state with job j1, succeeded, whose mirrors hold `logs` ({file name: bytes})."""
    state = StateDir(tmp_path / "state")
    job = StateDir(state / "jobs" / "j1")
    job.create()
    job.write_json("job.json", JobRecord("j1", state="succeeded", exit_code=0).to_dict())
    StateDir(job / "logs").create()
    for name, data in logs.items():
        (job / "logs" / name).write_bytes(data)
    return state


def test_follow_shows_each_line_as_its_nodes_and_filters_by_rank(tmp_path):
    state = finished_job(
        tmp_path,
        {
            "dc1-a.log": b"100 [dc1-a r0] one\n101 [dc1-a r0] \rbar\n102 [dc2-a r1] forged\n103 piece of a long line\n"
            b"105 [dc1-a] torchrun\n106 [dc1-a r0] last, no newline",
            "_meshrun.log": b"104 job j1 succeeded\n",
        },
    )
    seen = []
    rec = control.follow(state, "j1", lambda line, ours: seen.append((line, ours)), keep_going=False)
    assert rec.final
    assert seen == [
        ("[dc1-a r0] one", False),
        ("[dc1-a r0] \rbar", False),
        ("[dc1-a] [dc2-a r1] forged", False),
        ("[dc1-a] piece of a long line", False),
        ("job j1 succeeded", True),
        ("[dc1-a] torchrun", False),
        ("[dc1-a r0] last, no newline", False),
    ]
    seen.clear()
    control.follow(state, "j1", lambda line, ours: seen.append(line), rank=1, keep_going=False)
    assert seen == ["job j1 succeeded"]  # the forged "r1" line is not rank 1's


def test_follow_starts_at_the_tail_or_at_a_time(tmp_path):
    """--tail N: the last N lines there are (after the other filters), --since: those that arrived from then on
    (the coordinator's arrival time of each line, in ms, starts it in the mirror)."""
    state = finished_job(
        tmp_path,
        {
            "dc1-a.log": b"100 [dc1-a r0] a\n102 [dc1-a r0] b\n105 [dc1-a r0] c\n",
            "dc2-a.log": b"101 [dc2-a r1] x\n106 [dc2-a r1] y\n",
            "_meshrun.log": b"107 job j1 succeeded\n",
        },
    )

    def seen(**kw) -> list[str]:
        out: list[str] = []
        control.follow(state, "j1", lambda line, ours: out.append(line), keep_going=False, **kw)
        return out

    assert seen(tail=3) == ["[dc1-a r0] c", "[dc2-a r1] y", "job j1 succeeded"]
    assert seen(tail=2, rank=1) == ["[dc2-a r1] y", "job j1 succeeded"]  # meshrun's own lines are always shown
    assert seen(tail=0) == [] and len(seen(tail=99)) == 6
    assert seen(since=0.102) == ["[dc1-a r0] b", "[dc1-a r0] c", "[dc2-a r1] y", "job j1 succeeded"]
    assert seen(since=0.102, tail=1) == ["job j1 succeeded"]
