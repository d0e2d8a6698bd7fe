"""meshrun.system.jobfiles and a share's output: reading never stalls on output without newlines."""

from __future__ import annotations

from meshrun.jobs.share import share_output
from meshrun.system import jobfiles
from meshrun.system.store import StateDir


def test_a_chunk_without_a_newline_is_passed_on_and_the_offset_always_advances(tmp_path):
    """The bug: 400 KiB of tqdm-style redraws on one line stalled `meshrun train` for ever."""
    log = tmp_path / "output.log"
    bar = "".join(f"\r{i:6d}/100000 [{'#' * 20}]" for i in range(400 * 1024 // 30)).encode()
    log.write_bytes(b"[dc1-a r0] " + bar + b"\n[dc1-a r0] done\n")
    offset, lines = 0, []
    for _ in range(50):
        got, new = jobfiles.read_from(log, offset)
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
        got, offset = jobfiles.read_from(log, offset, limit=4097)     # odd: a cut would fall mid-character
        parts += got
    assert "".join(parts) == "é" * 100_000 and "\ufffd" not in "".join(parts)


def test_a_line_still_being_written_waits(tmp_path):
    log = tmp_path / "output.log"
    log.write_bytes(b"complete\npartial")
    assert jobfiles.read_from(log, 0) == (["complete"], 9)
    assert jobfiles.read_from(log, 9) == ([], 9)


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
