"""A rank's output as lines a terminal can show safely: carriage-return redraws, bounded lines, no escapes.

Pure. `LineAssembler` turns the bytes a process writes into events: whole lines, and *redraws* (what a
progress bar such as tqdm draws with `\\r` and no newline: only the latest one counts, as on a
terminal), emitted at most every `redraw_every` seconds (the draw on screen once the stream goes quiet),
the bar's final state being the line when it ends; so a bar that runs for hours costs one stored line
per interval and never stalls anything. A line never grows past `max_line` characters: longer output is
passed on in pieces.

A redraw is stored as a line whose text (after meshrun's `[node rN] ` prefix) starts with REDRAW, the one
marker this module defines; readers (`meshrun train`, `meshrun logs`) call `split_redraw` to tell them apart
and `Redraws` to show them as a terminal would. `clean` removes what could rewrite the operator's terminal
(cursor movement, screen clears, OSC titles and links, other control characters) or break a line in a
viewer, and keeps plain colours (SGR); `settle` is one finished line as a terminal leaves it.
"""

from __future__ import annotations

import codecs
import re
import unicodedata
from dataclasses import dataclass, field

__all__ = [
    "LINE_RE",
    "is_noise",
    "line_matches",
    "REDRAW",
    "MAX_LINE",
    "REDRAW_EVERY",
    "MAX_BARS",
    "clean",
    "settle",
    "fit",
    "LineAssembler",
    "split_redraw",
    "Redraws",
]

REDRAW = "\r"  # first character of a stored redraw's text
MAX_LINE = 16 * 1024  # characters: a longer line is passed on in pieces
REDRAW_EVERY = 0.5  # seconds between two redraws passed on from one stream
MAX_BARS = 8  # bars a terminal shows at once, one row each, at the bottom of the screen

# ESC [ params m (colours, bold...) is kept; every other escape sequence goes: CSI with any final byte,
# OSC (ESC ] ... BEL or ESC \\), DCS/SOS/PM/APC (ESC P/X/^/_ ... ESC \\), two-byte ESC sequences, and the
# 8-bit C1 forms of them.
_SGR = re.compile(r"\x1b\[[0-9;:]*m")
_ESCAPES = re.compile(
    r"(\x1b\[[0-?]*[ -/]*[@-~])"  # CSI
    r"|(\x1b\][^\x07\x1b]*(\x07|\x1b\\)?)"  # OSC
    r"|(\x1b[PX^_][^\x1b]*(\x1b\\)?)"  # DCS, SOS, PM, APC
    r"|(\x1b[ -/]*[0-~])"  # other ESC sequences (charset, keypad, RIS, ...)
    r"|(\x9b[0-?]*[ -/]*[@-~])"  # 8-bit CSI
    r"|(\x9d[^\x07\x9c]*[\x07\x9c]?)"  # 8-bit OSC
)
# Everything but TAB: ESC left over, BEL, BS, DEL, C1; also the Unicode line and paragraph separators (viewers
# and str.splitlines() break lines there) and the bidi embeddings, overrides and isolates (text that reads
# other than it is: "Trojan Source").
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_RESET = "\x1b[0m"


def clean(text: str) -> str:
    """`text` with every control character and escape sequence removed, but TAB and SGR colours."""
    kept: list[str] = []
    pos = 0
    for m in _SGR.finditer(text):
        kept.append(_strip(text[pos : m.start()]))
        kept.append(m.group(0))
        pos = m.end()
    kept.append(_strip(text[pos:]))
    return "".join(kept)


def _strip(text: str) -> str:
    return _CONTROLS.sub("", _ESCAPES.sub("", text))


def settle(line: str) -> str:
    """One finished line (no newline) as a terminal leaves it, cleaned: the text after its last carriage
    return, or after the last one that was followed by some (`"50%\\r100%\\r"` is "100%")."""
    drawn = [part for part in line.split("\r") if part]
    return clean(drawn[-1] if drawn else "")


def fit(text: str, columns: int | None) -> str:
    """`text` (cleaned) cut to fewer than `columns` screen columns, so it stays on one row of a terminal that
    wide (None: as it is). Colours are kept and not counted, TAB counts as a space, East Asian wide characters
    as two; a cut line that had colours ends with a reset."""
    if columns is None:
        return text
    out: list[str] = []
    used, pos = 0, 0
    for m in list(_SGR.finditer(text)) + [None]:
        end = m.start() if m else len(text)
        for ch in text[pos:end]:
            w = 0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
            if used + w > columns - 1:
                return "".join(out) + (_RESET if _SGR.search("".join(out)) else "")
            out.append(" " if ch == "\t" else ch)
            used += w
        if m:
            out.append(m.group(0))
            pos = m.end()
    return "".join(out)


def _closed(text: str) -> str:
    """`text` that cannot leave its colour on what the terminal shows next."""
    return text + _RESET if _SGR.search(text) and not text.endswith((_RESET, "\x1b[m")) else text


def split_redraw(text: str) -> tuple[bool, str]:
    """(is it a redraw, its text without the marker) for a stored line's text."""
    return (True, text[1:]) if text.startswith(REDRAW) else (False, text)


@dataclass
class LineAssembler:
    """Bytes in, ("line" | "redraw", text) out. Feed with `feed(data, now)`, call `tick(now)` when no data
    came for a while, `close()` at the end. Texts are cleaned (`clean`).

    A line that had a carriage return is a bar being redrawn: its latest complete draw goes out as a
    "redraw" at most every `redraw_every` seconds; `tick` (the stream went quiet, so what was written is
    whole) passes on the draw in progress too, so a slow bar shows its current state, not the one before.
    The line's end (newline, or `close`) gives its final state as a "line": what a terminal leaves on screen.
    """

    max_line: int = MAX_LINE
    redraw_every: float = REDRAW_EVERY
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    _line: str = ""  # the current line's text so far (after its last \r)
    _drawn: str = ""  # the current line's last complete draw (before its last \r)
    _dirty: bool = False  # _drawn changed since a redraw last went out
    _redrawing: bool = False  # the current line had a \r: it is a bar
    _last_redraw: float = float("-inf")  # when the last redraw went out
    _shown: str | None = None  # the last redraw passed on (the same one is not repeated)

    def feed(self, data: bytes, now: float) -> list[tuple[str, str]]:
        return self._text(self._decoder.decode(data), now)

    def tick(self, now: float) -> list[tuple[str, str]]:
        if self._redrawing and now - self._last_redraw >= self.redraw_every:
            self._dirty = False
            return self._emit_redraw(self._line or self._drawn, now)
        return []

    def close(self) -> list[tuple[str, str]]:
        # -inf: no timed redraw here; the line's final state is said below
        out = self._text(self._decoder.decode(b"", final=True), float("-inf"))
        final = clean(self._line or self._drawn)
        if final.strip() or (final and not self._redrawing):  # not a bar wiped with spaces at the end
            out.append(("line", final))
        self._new_line()
        return out

    def _new_line(self) -> None:
        self._line, self._drawn, self._dirty, self._redrawing, self._shown = "", "", False, False, None

    def _emit_redraw(self, text: str, now: float) -> list[tuple[str, str]]:
        text = clean(text)
        # Nothing new, or a bar wiped with spaces: nothing to show, and the throttle's clock does not restart.
        if not text.strip() or text == self._shown:
            return []
        self._last_redraw, self._shown = now, text
        return [("redraw", text)]

    def _text(self, text: str, now: float) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for piece in re.split(r"(\r\n|\n|\r)", text):
            if piece in ("\n", "\r\n"):
                out.append(("line", clean(self._line or self._drawn)))
                self._new_line()
            elif piece == "\r":
                self._redrawing = True
                if self._line:  # a draw is complete: the latest one counts
                    self._drawn, self._line, self._dirty = self._line, "", True
            elif piece:
                self._line += piece
                while len(self._line) > self.max_line:
                    out.append(("line", clean(self._line[: self.max_line])))
                    self._line = self._line[self.max_line :]
        if self._dirty and now - self._last_redraw >= self.redraw_every:
            self._dirty = False
            out += self._emit_redraw(self._drawn, now)
        return out


@dataclass
class Redraws:
    """How a reader shows a job's lines and their redraws (`line`, then `finish` at the end).

    On a terminal (`tty`) every source drawing a bar gets one row at the bottom of the screen, redrawn in
    place as its redraws arrive (carriage return, clear line), as tqdm shows several bars; other lines
    scroll above those rows, and a source's next line takes the place of its bar (its final state, or the
    script moved on). A bar's row is cut to the terminal's `width` so that it stays one row: the cursor
    movements count rows. Sources beyond MAX_BARS, and every source in a file or a pipe, print only the
    redraws not superseded: the last of a run before the source's next line and at the end, and one per
    `file_every` seconds so a long bar still shows progress. Before writing anything else to the same
    terminal (meshrun's own lines on stderr) take the bars away with `interrupt` and put them back with
    `resume`. Every text returned is the caller's to write as it is: nodes' text cleaned (`clean`), its
    colours ended.
    """

    tty: bool
    file_every: float = 30.0
    width: int | None = None  # the terminal's columns (None: not cut)
    _pending: dict[str, str] = field(default_factory=dict)  # source -> its latest unprinted redraw
    _printed: dict[str, float] = field(default_factory=dict)  # source -> when its last redraw was printed
    _last: dict[str, str] = field(default_factory=dict)  # source -> its redraw printed last, if latest
    _bars: dict[str, str] = field(default_factory=dict)  # tty: source -> its row, top to bottom

    def line(self, source: str, prefix: str, text: str, now: float) -> list[str]:
        """What to write for one stored line of `source` (`prefix`: meshrun's `[node rN] `, `text`: the rest),
        as terminal output with its newlines."""
        redraw, body = split_redraw(text)
        body = prefix + _closed(clean(body))
        if redraw and self.tty and (source in self._bars or len(self._bars) < MAX_BARS):
            return self._bar(source, body)
        if redraw:
            self._pending[source] = body
            self._last.pop(source, None)
            if now - self._printed.get(source, float("-inf")) < self.file_every:
                return []
            self._printed[source] = now
            self._last[source] = self._pending.pop(source)
            return self.interrupt() + [body + "\n"] + self.resume()
        out = self.interrupt()
        self._bars.pop(source, None)
        held = self._pending.pop(source, None)
        if held is not None and held != body:  # the bar's final state, then what came next
            out.append(held + "\n")
        if self._last.pop(source, None) != body:  # not the bar's final state printed just before
            out.append(body + "\n")
        return out + self.resume()

    def _bar(self, source: str, body: str) -> list[str]:
        row = _closed(fit(body, self.width))
        self._pending.pop(source, None)  # held while it had no row: superseded now
        if source not in self._bars:
            self._bars[source] = row
            return [row + "\n"]  # the cursor stays below the bars
        self._bars[source] = row
        up = len(self._bars) - list(self._bars).index(source)
        return [f"\x1b[{up}A\r\x1b[2K{row}\x1b[{up}B\r"]

    def interrupt(self) -> list[str]:
        """Take the bars off a terminal's screen (the cursor goes to where the first one was)."""
        return [f"\x1b[{len(self._bars)}A\r\x1b[J"] if self._bars else []

    def resume(self) -> list[str]:
        """Draw the bars again below what was written since `interrupt`."""
        return [row + "\n" for row in self._bars.values()]

    def finish(self) -> list[str]:
        """What is still owed at the end: the redraws held back. The bars stay on screen as they are."""
        out = [text + "\n" for text in self._pending.values()]
        if out and self._bars:
            out = self.interrupt() + out + self.resume()
        self._pending.clear()
        self._bars.clear()
        return out


# --------------------------------------------------------------------------- meshrun's prefix on every line

LINE_RE = re.compile(r"^\[(?P<node>[a-z0-9][a-z0-9-]{0,31})(?: r(?P<rank>\d+))?\] ")
# torch's TCPStore logs this for every client whose address has no reverse DNS (overlay addresses
# never do): one line per node and rank, nothing anyone can act on. Only this exact line is dropped.
REVERSE_DNS_NOISE = re.compile(
    r"^\[W\d{4} \d\d:\d\d:\d\d\.\d+ socket\.cpp:\d+\] \[c10d\] The hostname of the "
    r"client socket cannot be retrieved\. err=-?\d+$"
)


def is_noise(line: str) -> bool:
    """True for an output line (with or without its `[node rR] ` prefix) that is c10d's reverse-DNS warning."""
    return bool(REVERSE_DNS_NOISE.match(LINE_RE.sub("", line, count=1)))


def line_matches(line: str, node: str | None, rank: int | None) -> bool:
    """Does a job output line (prefixed `[node rR]` or `[node]`) belong to `node` / `rank`?"""
    if node is None and rank is None:
        return True
    m = LINE_RE.match(line)
    if not m:
        return False
    if node is not None and m.group("node") != node:
        return False
    return rank is None or (m.group("rank") is not None and int(m.group("rank")) == rank)
