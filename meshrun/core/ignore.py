"""Gitignore patterns: which paths of a project a job does not ship (`.meshrunignore`, `.gitignore`).

Pure. `IgnoreRules` holds the patterns of one ignore file, relative to the directory that file sits
in; `Matcher` stacks them the way git does (a deeper file's patterns win over a shallower one's, the
last matching pattern of a file wins, `!` re-includes, a path under an ignored directory stays
ignored whatever a later pattern says). The syntax is git's (gitignore(5)): `#` comments, `\\`
escapes, trailing `/` for directories only, a slash elsewhere anchors the pattern to the file's
directory, `*`, `?`, `[...]` and `**` (leading `**/`, trailing `/**`, inner `/**/`).

tests/unit/core/test_ignore.py checks the translation against `git check-ignore` on the same patterns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Pattern", "IgnoreRules", "Matcher", "parse"]


@dataclass(frozen=True)
class Pattern:
    """One compiled pattern line: `regex` matches a path relative to the ignore file's directory."""

    text: str
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _class(pat: str, i: int) -> tuple[str, int]:
    """The regex for a bracket expression starting at pat[i] == "[", and the index after it."""
    j = i + 1
    if j < len(pat) and pat[j] in "!^":
        j += 1
    if j < len(pat) and pat[j] == "]":
        j += 1
    while j < len(pat) and pat[j] != "]":
        j += 1
    if j >= len(pat):  # no closing bracket: a literal "["
        return re.escape("["), i + 1
    body = pat[i + 1 : j]
    neg = body[:1] in ("!", "^")
    if neg:
        body = body[1:]
    body = body.replace("\\", "\\\\").replace("^", "\\^")
    return f"[{'^' if neg else ''}{body}]" if not neg else f"(?!/)[^{body}]", j + 1


def _translate(pat: str) -> str:
    """The regex body for a pattern with its anchoring slash and trailing slash already removed."""
    out = []
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        if c == "*":
            if pat.startswith("**", i):
                before_ok = i == 0 or pat[i - 1] == "/"
                after = pat[i + 2 : i + 3]
                if before_ok and after == "/":  # "**/": zero or more directories
                    out.append("(?:[^/]*/)*")
                    i += 3
                    continue
                if before_ok and i + 2 == n:  # trailing "/**" (or the whole pattern): everything
                    out.append(".*")
                    i += 2
                    continue
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            rx, i = _class(pat, i)
            out.append(rx)
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pat[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _strip_trailing_spaces(line: str) -> str:
    """Trailing spaces are dropped unless escaped with a backslash (gitignore(5))."""
    end = len(line)
    while end > 0 and line[end - 1] == " " and not (end >= 2 and line[end - 2] == "\\"):
        end -= 1
    return line[:end]


def compile_pattern(line: str) -> Pattern | None:
    """One line of an ignore file as a Pattern; None for blank lines and comments."""
    text = _strip_trailing_spaces(line.rstrip("\n").rstrip("\r"))
    if not text or text.startswith("#"):
        return None
    negate = text.startswith("!")
    body = text[1:] if negate else text
    if body.startswith("\\") and body[1:2] in ("#", "!"):
        body = body[1:]
    dir_only = body.endswith("/") and not body.endswith("\\/")
    body = body.rstrip("/") if dir_only else body
    if not body:
        return None
    anchored = "/" in body
    body = body.lstrip("/")
    rx = _translate(body)
    if not anchored:
        rx = "(?:.*/)?" + rx
    return Pattern(text, re.compile(rf"\A{rx}\Z", re.S), negate, dir_only)


@dataclass(frozen=True)
class IgnoreRules:
    """The patterns of one ignore file; `base` is its directory relative to the root ("" at the root)."""

    base: str
    patterns: tuple[Pattern, ...] = ()

    def verdict(self, rel: str, is_dir: bool) -> bool | None:
        """True: ignored, False: re-included by a `!` pattern, None: no pattern of this file matches."""
        if self.base:
            if not rel.startswith(self.base + "/"):
                return None
            rel = rel[len(self.base) + 1 :]
        for p in reversed(self.patterns):
            if p.dir_only and not is_dir:
                continue
            if p.regex.match(rel):
                return not p.negate
        return None


def parse(text: str, base: str = "") -> IgnoreRules:
    """The rules of an ignore file's `text`, sitting in directory `base` (relative, "" for the root)."""
    pats = (compile_pattern(line) for line in text.splitlines())
    return IgnoreRules(base.strip("/"), tuple(p for p in pats if p is not None))


@dataclass
class Matcher:
    """Ignore rules from several files, applied as git applies them (deeper files first).

    Callers walk top-down and never descend into an ignored directory, which gives git's rule that
    nothing under an ignored directory can be re-included.
    """

    rules: list[IgnoreRules] = field(default_factory=list)

    def add(self, rules: IgnoreRules) -> None:
        if rules.patterns:
            self.rules.append(rules)

    def ignored(self, rel: str, is_dir: bool = False) -> bool:
        """Is the path `rel` (relative to the root, "/"-separated) ignored by these rules?"""
        for r in sorted(self.rules, key=lambda r: -r.base.count("/") - (1 if r.base else 0)):
            v = r.verdict(rel, is_dir)
            if v is not None:
                return v
        return False

    def ignored_any(self, rels: Iterable[str]) -> list[str]:
        return [r for r in rels if self.ignored(r)]
