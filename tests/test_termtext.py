"""meshrun.core.termtext: progress bars as a terminal shows them, bounded lines, nothing that rewrites a terminal."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from meshrun.core import termtext
from meshrun.core.termtext import LineAssembler, Redraws, clean

ESC = "\x1b"


def feed_all(chunks, times=None, **kw):
    a = LineAssembler(**kw)
    out = []
    for i, c in enumerate(chunks):
        out += a.feed(c if isinstance(c, bytes) else c.encode(), times[i] if times else float(i))
    return out + a.close()


def test_lines_pass_through_and_a_last_partial_line_is_kept():
    assert feed_all(["a\nb", "c\r\nd"]) == [("line", "a"), ("line", "bc"), ("line", "d")]


def test_a_bar_becomes_a_few_redraws_and_its_final_state_comes_before_the_next_line():
    bar = [f"\r eval {i:3d}%|{'#' * (i // 10)}" for i in range(101)]
    # 101 redraws arriving within 1 s, then a normal line
    times = [i / 100 for i in range(101)] + [1.0]
    out = feed_all(bar + ["\ndone\n"], times=times)
    redraws = [t for k, t in out if k == "redraw"]
    assert len(redraws) <= 3                                    # twice a second at most
    assert out[-2] == ("line", " eval 100%|" + "#" * 10)       # the bar's last state, as a terminal shows it
    assert out[-1] == ("line", "done")


def test_a_held_redraw_goes_out_on_tick_or_at_the_end():
    a = LineAssembler(redraw_every=0.5)
    assert a.feed(b"\rstep 1", 0.0) == [] and a.feed(b"\rstep 2", 0.1) == [("redraw", "step 1")]
    assert a.feed(b"\rstep 3", 0.2) == []
    assert a.tick(0.3) == [] and a.tick(0.7) == [("redraw", "step 2")]
    assert a.feed(b"\rstep 4", 0.8) == []
    assert a.close() == [("line", "step 4")]


def test_a_line_without_end_is_passed_on_in_bounded_pieces():
    out = feed_all(["x" * 25, "y" * 10], max_line=10)
    assert out == [("line", "x" * 10), ("line", "x" * 10), ("line", "xxxxxyyyyy"), ("line", "yyyyy")]


def test_utf8_split_across_chunks_is_not_garbled():
    data = "é€😀\n".encode()
    assert feed_all([data[i:i + 1] for i in range(len(data))]) == [("line", "é€😀")]


def test_colours_stay_everything_else_that_drives_a_terminal_goes():
    red = f"{ESC}[31mred{ESC}[0m"
    assert clean(red) == red
    nasty = (f"ok{ESC}[2J{ESC}[H{ESC}]0;owned\x07{ESC}]8;;http://x\x1b\\link{ESC}]8;;\x1b\\\x08\x07"
             f"{ESC}P1$r{ESC}\\{ESC}c\x9b2J\x00tail")
    assert clean(nasty) == "oklinktail"
    assert clean("tab\tstays") == "tab\tstays"


def test_a_rank_cannot_forge_another_ranks_line():
    out = feed_all(["mine\n[dc2-a r1] forged\rfake\n"])
    # every event is one line of this rank: the worker prefixes each with [node rN], so the forgery reads
    # "[dc1-a r0] fake", and a carriage return cannot move to the start of the real prefix
    assert out == [("line", "mine"), ("line", "fake")]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64) | st.sampled_from([b"\r", b"\n", b"\x1b[", b"\x1b]", b"\x9b", b"m", b"\x07",
                                                         b"\xc3", b"\xa9", b"\x1b\\"]), max_size=30))
def test_no_input_produces_control_characters_or_non_sgr_escapes(chunks):
    a = LineAssembler(max_line=50)
    events = []
    for i, c in enumerate(chunks):
        events += a.feed(c, i * 0.3)
        events += a.tick(i * 0.3 + 0.1)
    events += a.close()
    for kind, text in events:
        assert kind in ("line", "redraw") and len(text) <= 50 * 8
        without_sgr = re.sub(r"\x1b\[[0-9;:]*m", "", text)
        assert not re.search(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]", without_sgr), repr(text)


def test_a_terminal_overwrites_redraws_a_file_gets_only_the_last_of_a_run():
    tty = Redraws(tty=True)
    shown = "".join(t for i in range(3) for t in tty.line("[a r0] ", "[a r0] ", f"\rstep {i}", float(i)))
    shown += "".join(tty.line("[a r0] ", "[a r0] ", "done", 3.0)) + "".join(tty.finish())
    assert shown == ("\r\x1b[2K[a r0] step 0\r\x1b[2K[a r0] step 1\r\x1b[2K[a r0] step 2\n[a r0] done\n")
    f = Redraws(tty=False, file_every=30)
    out = []
    for i in range(100):
        out += f.line("[a r0] ", "[a r0] ", f"\rstep {i}", float(i))
    out += f.line("[b r1] ", "[b r1] ", "other rank", 100.0)
    out += f.line("[a r0] ", "[a r0] ", "done", 101.0)
    out += f.finish()
    assert out == ["[a r0] step 0\n", "[a r0] step 30\n", "[a r0] step 60\n", "[a r0] step 90\n",
                   "[b r1] other rank\n", "[a r0] step 99\n", "[a r0] done\n"]
    assert termtext.split_redraw("\rx") == (True, "x") and termtext.split_redraw("x") == (False, "x")
