"""A rank's output as lines a terminal can show safely: carriage-return redraws, bounded lines, no escapes.

Pure. `LineAssembler` turns the bytes a process writes into events: whole lines, and *redraws* (what a
progress bar such as tqdm draws with `\\r` and no newline: only the latest one counts, as on a
terminal), emitted at most every `redraw_every` seconds and always before the next line and at the end,
so a bar that runs for hours costs one stored line per interval and never stalls anything. A line never
grows past `max_line` characters: longer output is passed on in pieces.

A redraw is stored as a line whose text (after meshrun's `[node rN] ` prefix) starts with REDRAW; readers
(`meshrun train`, `meshrun logs`) call `split_redraw` to tell them apart and `Redraws` to show them as a
terminal would. `clean` removes what could rewrite the operator's terminal (cursor movement, screen
clears, OSC titles and links, other control characters) and keeps plain colours (SGR).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field

__all__ = ["REDRAW", "MAX_LINE", "REDRAW_EVERY", "clean", "LineAssembler", "split_redraw", "Redraws"]

REDRAW = "\r"                    # first character of a stored redraw's text
MAX_LINE = 16 * 1024             # characters: a longer line is passed on in pieces
REDRAW_EVERY = 0.5               # seconds between two redraws passed on from one stream

# ESC [ params m (colours, bold...) is kept; every other escape sequence goes: CSI with any final byte,
# OSC (ESC ] ... BEL or ESC \\), DCS/SOS/PM/APC (ESC P/X/^/_ ... ESC \\), two-byte ESC sequences, and the
# 8-bit C1 forms of them.
_SGR = re.compile(r"\x1b\[[0-9;:]*m")
_ESCAPES = re.compile(
    r"(\x1b\[[0-?]*[ -/]*[@-~])"                       # CSI
    r"|(\x1b\][^\x07\x1b]*(\x07|\x1b\\)?)"            # OSC
    r"|(\x1b[PX^_][^\x1b]*(\x1b\\)?)"                 # DCS, SOS, PM, APC
    r"|(\x1b[ -/]*[0-~])"                             # other ESC sequences (charset, keypad, RIS, ...)
    r"|(\x9b[0-?]*[ -/]*[@-~])"                       # 8-bit CSI
    r"|(\x9d[^\x07\x9c]*[\x07\x9c]?)"                 # 8-bit OSC
)
_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")      # everything but TAB: ESC left over, BEL, BS, ...


def clean(text: str) -> str:
    """`text` with every control character and escape sequence removed, but TAB and SGR colours."""
    kept: list[str] = []
    pos = 0
    for m in _SGR.finditer(text):
        kept.append(_strip(text[pos:m.start()]))
        kept.append(m.group(0))
        pos = m.end()
    kept.append(_strip(text[pos:]))
    return "".join(kept)


def _strip(text: str) -> str:
    return _CONTROLS.sub("", _ESCAPES.sub("", text))


def split_redraw(text: str) -> tuple[bool, str]:
    """(is it a redraw, its text without the marker) for a stored line's text."""
    return (True, text[1:]) if text.startswith(REDRAW) else (False, text)


@dataclass
class LineAssembler:
    """Bytes in, ("line" | "redraw", text) out. Feed with `feed(data, now)`, call `tick(now)` when no data
    came for a while (a held redraw goes out), `close()` at the end. Texts are cleaned (`clean`)."""

    max_line: int = MAX_LINE
    redraw_every: float = REDRAW_EVERY
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    _line: str = ""                      # the current line's text so far (after its last \r)
    _held: str | None = None             # a redraw not passed on yet
    _last_redraw: float = float("-inf")  # when the last redraw went out
    _shown: str | None = None            # the last redraw passed on (the same one is not repeated)

    def feed(self, data: bytes, now: float) -> list[tuple[str, str]]:
        return self._text(self._decoder.decode(data), now)

    def tick(self, now: float) -> list[tuple[str, str]]:
        if self._held is not None and now - self._last_redraw >= self.redraw_every:
            return self._emit_redraw(now)
        return []

    def close(self) -> list[tuple[str, str]]:
        # -inf: no timed redraw here; what is held is either superseded by the current line or said below
        out = self._text(self._decoder.decode(b"", final=True), float("-inf"))
        if self._line:
            out.append(("line", clean(self._line)))
        elif self._held is not None:            # the bar's last state is its final word
            out.append(("line", clean(self._held)))
        self._line, self._held = "", None
        return out

    def _emit_redraw(self, now: float) -> list[tuple[str, str]]:
        text, self._held = clean(self._held or ""), None
        self._last_redraw = now
        if text == self._shown:
            return []
        self._shown = text
        return [("redraw", text)]

    def _text(self, text: str, now: float) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for piece in re.split(r"(\r\n|\n|\r)", text):
            if piece in ("\n", "\r\n"):
                line = self._line if self._line else (self._held or "")
                self._line, self._held, self._shown = "", None, None
                out.append(("line", clean(line)))
            elif piece == "\r":
                if self._line:                  # a redraw is complete: the latest one counts
                    self._held, self._line = self._line, ""
            elif piece:
                self._line += piece
                while len(self._line) > self.max_line:
                    out.append(("line", clean(self._line[:self.max_line])))
                    self._line = self._line[self.max_line:]
        if self._held is not None and now - self._last_redraw >= self.redraw_every:
            out += self._emit_redraw(now)
        return out


@dataclass
class Redraws:
    """How a reader shows redraws: on a terminal the latest overwrites the previous one of its source; in a
    file or a pipe only the last of a run is printed (before the source's next line, at the end, or once
    per `file_every` seconds so a long bar still shows progress)."""

    tty: bool
    file_every: float = 30.0
    _pending: dict[str, str] = field(default_factory=dict)       # source -> its latest unprinted redraw
    _printed: dict[str, float] = field(default_factory=dict)     # source -> when its last redraw was printed
    _open: str | None = None                                     # tty: the source whose redraw is on screen

    def line(self, source: str, prefix: str, text: str, now: float) -> list[str]:
        """What to write for one stored line of `source` (`prefix`: meshrun's `[node rN] `, `text`: the rest),
        as terminal output with its newlines."""
        redraw, body = split_redraw(text)
        body = prefix + clean(body)
        out: list[str] = []
        if self.tty:
            if redraw:
                if self._open is not None and self._open != source:
                    out.append("\n")
                self._open = source
                out.append("\r\x1b[2K" + body)
                return out
            if self._open is not None:
                out.append("\n")
                self._open = None
            return out + [body + "\n"]
        if redraw:
            self._pending[source] = body
            if now - self._printed.get(source, float("-inf")) >= self.file_every:
                self._printed[source] = now
                out.append(self._pending.pop(source) + "\n")
            return out
        if source in self._pending:
            out.append(self._pending.pop(source) + "\n")
        return out + [body + "\n"]

    def finish(self) -> list[str]:
        """What is still owed at the end: an open terminal line's newline, or the last redraws."""
        out = ["\n"] if self.tty and self._open is not None else []
        out += [text + "\n" for text in self._pending.values()]
        self._pending.clear()
        self._open = None
        return out
