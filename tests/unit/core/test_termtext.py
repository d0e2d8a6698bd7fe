"""meshrun.core.termtext: progress bars as a terminal shows them, bounded lines, nothing that rewrites a terminal."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from meshrun.core import termtext
from meshrun.core.termtext import LineAssembler, Redraws, clean, fit, settle

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
    assert len(redraws) <= 3  # twice a second at most
    assert out[-2] == ("line", " eval 100%|" + "#" * 10)  # the bar's last state, as a terminal shows it
    assert out[-1] == ("line", "done")


def test_a_held_redraw_goes_out_on_tick_or_at_the_end():
    a = LineAssembler(redraw_every=0.5)
    assert a.feed(b"\rstep 1", 0.0) == [] and a.feed(b"\rstep 2", 0.1) == [("redraw", "step 1")]
    assert a.feed(b"\rstep 3", 0.2) == []
    # the stream went quiet: the draw on screen now is step 3 (tqdm's "\r" comes before its draw)
    assert a.tick(0.3) == [] and a.tick(0.7) == [("redraw", "step 3")]
    assert a.tick(1.5) == []  # nothing new: nothing repeated
    assert a.feed(b"\rstep 4", 1.6) == []
    assert a.close() == [("line", "step 4")]


def test_a_slow_bar_shows_its_current_state_not_the_one_before():
    """One tqdm update a minute: the operator sees the epoch that runs, not the previous one."""
    a = LineAssembler()
    out = []
    for epoch in range(3):
        out += a.feed(f"\repoch {epoch}/3".encode(), epoch * 60.0)
        out += a.tick(epoch * 60.0 + 0.5)
    assert out == [("redraw", "epoch 0/3"), ("redraw", "epoch 1/3"), ("redraw", "epoch 2/3")]
    assert a.feed(b"\repoch 3/3\n", 180.0) == [("line", "epoch 3/3")]


def test_a_bar_ended_by_carriage_returns_keeps_its_last_state_as_its_line():
    a = LineAssembler(redraw_every=0.5)
    assert a.feed(b"50%\r", 0.0) == [("redraw", "50%")]
    assert a.feed(b"100%\r", 1.0) == [("redraw", "100%")]
    assert a.feed(b"\n", 2.0) == [("line", "100%")]  # print() after the bar: it stays on screen
    a.feed(b"\r" + b"#" * 10 + b"\r" + b" " * 10 + b"\r", 3.0)  # tqdm(leave=False) wipes its bar
    assert a.tick(4.0) == [] and a.close() == []


def test_a_line_without_end_is_passed_on_in_bounded_pieces():
    out = feed_all(["x" * 25, "y" * 10], max_line=10)
    assert out == [("line", "x" * 10), ("line", "x" * 10), ("line", "xxxxxyyyyy"), ("line", "yyyyy")]


def test_utf8_split_across_chunks_is_not_garbled():
    data = "é€😀\n".encode()
    assert feed_all([data[i : i + 1] for i in range(len(data))]) == [("line", "é€😀")]


def test_colours_stay_everything_else_that_drives_a_terminal_goes():
    red = f"{ESC}[31mred{ESC}[0m"
    assert clean(red) == red
    nasty = (
        f"ok{ESC}[2J{ESC}[H{ESC}]0;owned\x07{ESC}]8;;http://x\x1b\\link{ESC}]8;;\x1b\\\x08\x07"
        f"{ESC}P1$r{ESC}\\{ESC}c\x9b2J\x00tail"
    )
    assert clean(nasty) == "oklinktail"
    assert clean("tab\tstays") == "tab\tstays"


def test_a_rank_cannot_forge_another_ranks_line():
    out = feed_all(["mine\n[dc2-a r1] forged\rfake\n"])
    # every event is one line of this rank: the worker prefixes each with [node rN], so the forgery reads
    # "[dc1-a r0] fake", and a carriage return cannot move to the start of the real prefix
    assert out == [("line", "mine"), ("line", "fake")]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.binary(max_size=64)
        | st.sampled_from([b"\r", b"\n", b"\x1b[", b"\x1b]", b"\x9b", b"m", b"\x07", b"\xc3", b"\xa9", b"\x1b\\"]),
        max_size=30,
    )
)
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


class Screen:
    """Just enough of a terminal to check what Redraws writes: text, CR, LF (as a tty's ONLCR: to column 0),
    CSI n A/B (up/down), 2K (clear row), J (clear below); SGR takes no room; text wraps at `width`."""

    def __init__(self, width: int = 80) -> None:
        self.rows, self.y, self.x, self.width = [""], 0, 0, width

    def write(self, text: str) -> None:
        i = 0
        while i < len(text):
            m = re.match(r"\x1b\[([0-9;:]*)([ABJKm])", text[i:])
            if m:
                n = int(m.group(1) or 1) if m.group(2) in "AB" else 0
                if m.group(2) == "A":
                    self.y = max(0, self.y - n)
                elif m.group(2) == "B":
                    self.y = min(len(self.rows) - 1, self.y + n)
                elif m.group(2) == "K":
                    self.rows[self.y] = ""
                elif m.group(2) == "J":
                    self.rows[self.y] = self.rows[self.y][: self.x]
                    del self.rows[self.y + 1 :]
                i += m.end()
                continue
            ch = text[i]
            assert ch != ESC, f"an escape the screen does not know: {text[i : i + 10]!r}"
            if ch == "\r":
                self.x = 0
            elif ch == "\n":
                self._down()
            else:
                if self.x >= self.width:
                    self._down()
                row = self.rows[self.y].ljust(self.x)
                self.rows[self.y] = row[: self.x] + ch + row[self.x + 1 :]
                self.x += 1
            i += 1

    def _down(self) -> None:
        self.y, self.x = self.y + 1, 0
        if self.y == len(self.rows):
            self.rows.append("")

    def text(self) -> list[str]:
        return [re.sub(r"\x1b\[[0-9;:]*m", "", r).rstrip() for r in self.rows]


def show(r: Redraws, screen: Screen, source: str, text: str, now: float = 0.0) -> None:
    for t in r.line(source, source, text, now):
        screen.write(t)


def test_a_terminal_redraws_a_bar_in_place_and_its_final_line_takes_its_place():
    r, screen = Redraws(tty=True), Screen()
    for i in range(100):
        show(r, screen, "[a r0] ", f"\rstep {i}")
        assert screen.text() == [f"[a r0] step {i}", ""]
    show(r, screen, "[a r0] ", "step 99 done")
    for t in r.finish():
        screen.write(t)
    assert screen.text() == ["[a r0] step 99 done", ""]


def test_several_bars_keep_a_row_each_and_other_lines_scroll_above_them():
    r, screen = Redraws(tty=True), Screen()
    written = []
    for i in range(200):
        for src in ("[a r0] ", "[b r1] "):
            written += r.line(src, src, f"\rstep {i}", float(i))
        if i % 50 == 0:
            written += r.line("[c r2] ", "[c r2] ", f"loss {i}", float(i))
    for t in written:
        screen.write(t)
    assert screen.text() == [
        "[c r2] loss 0",
        "[c r2] loss 50",
        "[c r2] loss 100",
        "[c r2] loss 150",
        "[a r0] step 199",
        "[b r1] step 199",
        "",
    ]
    # meshrun's own line (on stderr, the same terminal): the bars step aside and come back below it
    for t in r.interrupt():
        screen.write(t)
    screen.write("meshrun: lost dc3-a\n")
    for t in r.resume():
        screen.write(t)
    show(r, screen, "[a r0] ", "finished")
    assert screen.text() == [
        "[c r2] loss 0",
        "[c r2] loss 50",
        "[c r2] loss 100",
        "[c r2] loss 150",
        "meshrun: lost dc3-a",
        "[a r0] finished",
        "[b r1] step 199",
        "",
    ]


def test_a_bar_row_is_cut_to_the_terminal_width_so_it_stays_one_row():
    r, screen = Redraws(tty=True, width=20), Screen(width=20)
    for i in range(50):
        show(r, screen, "[a r0] ", f"\r\x1b[32m{i:3d}%|{'#' * (i // 2)}|\x1b[0m 123 it/s")
    assert screen.text() == ["[a r0]  49%|#######", ""]
    assert fit("[a r0] \x1b[32mabcdefghijklmnop", 10) == "[a r0] \x1b[32mab\x1b[0m"
    assert fit("日本語のテキスト", 7) == "日本語" and fit("a\tb", None) == "a\tb" and fit("a\tb", 9) == "a b"


def test_more_bars_than_fit_fall_back_to_a_line_now_and_then():
    r, screen = Redraws(tty=True, file_every=30), Screen()
    sources = [f"[n{k} r{k}] " for k in range(termtext.MAX_BARS + 2)]
    for i in range(100):
        for src in sources:
            for t in r.line(src, src, f"\rstep {i}", float(i)):
                screen.write(t)
    rows = screen.text()
    assert rows[-termtext.MAX_BARS - 1 :] == [f"{s}step 99" for s in sources[: termtext.MAX_BARS]] + [""]
    extra = rows[: -termtext.MAX_BARS - 1]
    assert len(extra) == 2 * 4 and all(r.startswith(tuple(sources[termtext.MAX_BARS :])) for r in extra)


def test_a_file_gets_only_the_last_redraw_of_a_run_and_one_now_and_then():
    f = Redraws(tty=False, file_every=30)
    out = []
    for i in range(100):
        out += f.line("[a r0] ", "[a r0] ", f"\rstep {i}", float(i))
    out += f.line("[b r1] ", "[b r1] ", "other rank", 100.0)
    out += f.line("[a r0] ", "[a r0] ", "done", 101.0)
    out += f.line("[b r1] ", "[b r1] ", "\rlast", 102.0)
    out += f.line("[b r1] ", "[b r1] ", "last", 103.0)  # its final line: the same text once
    out += f.line("[c r2] ", "[c r2] ", "\r\x1b[31mred bar", 104.0)
    out += f.finish()
    assert out == [
        "[a r0] step 0\n",
        "[a r0] step 30\n",
        "[a r0] step 60\n",
        "[a r0] step 90\n",
        "[b r1] other rank\n",
        "[a r0] step 99\n",
        "[a r0] done\n",
        "[b r1] last\n",
        "[c r2] \x1b[31mred bar\x1b[0m\n",
    ]
    assert termtext.split_redraw("\rx") == (True, "x") and termtext.split_redraw("x") == (False, "x")


def test_a_terminal_bar_with_no_more_lines_stays_as_it_was_drawn():
    r, screen = Redraws(tty=True), Screen()
    show(r, screen, "[a r0] ", "\r 10%")
    show(r, screen, "[a r0] ", "\r 20%")
    for t in r.finish():
        screen.write(t)
    screen.write("meshrun: job x succeeded\n")
    assert screen.text() == ["[a r0]  20%", "meshrun: job x succeeded", ""]


def test_settle_is_what_a_terminal_leaves_of_a_line():
    assert settle("50%\r100%") == "100%" and settle("50%\r100%\r") == "100%" and settle("\r\r") == ""
    assert settle("plain \x1b[2Jtext") == "plain text"


def test_line_separators_and_bidi_overrides_go():
    assert clean("a\u2028b\u2029c\x85d") == "abcd"
    assert clean("safe\u202etxt.exe\u2066x\u2069") == "safetxt.exex"


_CONTROL_HEAVY = st.text(
    alphabet=st.sampled_from(
        [
            "\x1b",
            "[",
            "]",
            "m",
            "0",
            "1",
            ";",
            "3",
            "2",
            "J",
            "H",
            "P",
            "\\",
            "\x07",
            "\x08",
            "\x00",
            "\r",
            "\n",
            "\t",
            "\x9b",
            "\x9d",
            "\x9c",
            "\x7f",
            "a",
            "é",
            "\u2028",
            "\u202e",
            " ",
        ]
    ),
    max_size=60,
) | st.text(max_size=60)


def _only_allowed(text: str) -> bool:
    rest = re.sub(r"\x1b\[[0-9;:]*m", "", text)
    return not re.search(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]", rest)


@settings(max_examples=500, deadline=None)
@given(_CONTROL_HEAVY)
def test_clean_keeps_only_sgr_escapes_and_tab_and_is_idempotent(text):
    out = clean(text)
    assert _only_allowed(out), repr(out)
    assert clean(out) == out
    assert _only_allowed(settle(text)) and _only_allowed(fit(out, 12))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["[a r0] ", "[b r1] ", "[c] "]), _CONTROL_HEAVY), max_size=25), st.booleans())
def test_whatever_nodes_send_each_line_shown_starts_with_its_prefix(lines, tty):
    """No text of a node can start a line of its own on the operator's terminal or escape but in colour."""
    r = Redraws(tty=tty, width=200 if tty else None, file_every=2)  # wide: a row is one line
    written = ""
    for i, (src, text) in enumerate(lines):
        written += "".join(r.line(src, src, text, float(i)))
    written += "".join(r.finish())
    if tty:  # what a terminal ends up showing: every row from one line, prefix first
        screen = Screen(width=200)
        screen.write(written)
        assert all(row == "" or row.startswith(("[a r0]", "[b r1]", "[c]")) for row in screen.text())
    else:
        assert _only_allowed(written.replace("\n", "")) and "\r" not in written
        assert all(row.startswith(("[a r0] ", "[b r1] ", "[c] ")) for row in written.split("\n")[:-1])
