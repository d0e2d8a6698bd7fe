"""How far a job is, from its rank 0's output: `meshrun jobs` shows the step, the rate and the numbers.

Two sources, both lines of rank 0's output: the line `meshrun.train.report(step, total, **numbers)` prints
(MARK and JSON: the supervisor keeps it out of the job's logs), and a tqdm bar's state (`45/100 [00:10<00:12,
4.50it/s]`), where a script has one. Pure: the supervisor (meshrun.jobs.supervisor) feeds it lines with their
arrival times and saves `Progress.record()` in the job's record.

A line is the job's own output, so what it may put in the record is bounded: a whole step, at most
MAX_NUMBERS numbers with names of at most MAX_NAME characters, finite values only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

MARK = "@meshrun:progress "
MAX_NUMBERS = 8
MAX_NAME = 32
RATE_WINDOW_S = 60.0  # the rate is the steps over about the last minute
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
# tqdm's default bar: "... 45/100 [00:10<00:12,  4.50it/s]" (or "s/it" below one step a second).
_TQDM = re.compile(r"(\d+)/(\d+) \[[\d:]+<[\d:?]+,\s*([\d.]+)(it/s|s/it)")


def line(step: int, total: int | None = None, **numbers: float) -> str:
    """What `meshrun.train.report` prints (without the newline)."""
    return MARK + json.dumps({"step": int(step), "total": None if total is None else int(total), **numbers})


def parse(text: str) -> dict | None:
    """{"step", "total", "numbers"} from a line `line` made, else None (not one, or not valid)."""
    if not text.startswith(MARK):
        return None
    try:
        d = json.loads(text[len(MARK) :])
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    step, total = d.pop("step", None), d.pop("total", None)
    if not _whole(step) or not (total is None or _whole(total)):
        return None
    numbers = {
        k: float(v) for k, v in d.items() if isinstance(k, str) and len(k) <= MAX_NAME and _NAME.match(k) and _finite(v)
    }
    return {"step": step, "total": total, "numbers": dict(list(numbers.items())[:MAX_NUMBERS])}


def parse_tqdm(text: str) -> dict | None:
    """{"step", "total", "rate"} from the last state of a tqdm bar in `text`, else None."""
    found = _TQDM.findall(text)
    if not found:
        return None
    step, total, value, unit = found[-1]
    rate = float(value) if unit == "it/s" else (1 / float(value) if float(value) > 0 else None)
    return {"step": int(step), "total": int(total), "rate": rate}


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Progress:
    """A job's progress as its supervisor follows rank 0's lines: `see(text, at)` each, `record()` to save."""

    step: int | None = None
    total: int | None = None
    numbers: dict[str, float] = field(default_factory=dict)
    at: float | None = None  # when the newest step arrived (unix s)
    rate: float | None = None  # steps a second over about RATE_WINDOW_S; a tqdm bar's own where it says
    _samples: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def see(self, text: str, at: float) -> bool:
        """Take one line of rank 0's (its node prefix removed) arriving at `at`; True if it was a report
        line (to be kept out of the job's logs)."""
        report = parse(text)
        if report is not None:
            self._step(report["step"], report["total"], at)
            self.numbers = report["numbers"]
            self.rate = self._rate()
            return True
        bar = parse_tqdm(text)
        if bar is not None:
            self._step(bar["step"], bar["total"], at)
            self.rate = bar["rate"] if bar["rate"] is not None else self._rate()
        return False

    def _step(self, step: int, total: int | None, at: float) -> None:
        if self.step is not None and step < self.step:
            self._samples.clear()  # a restart resumed from an earlier step: the rate starts again
        self.step, self.total, self.at = step, total, at
        self._samples.append((at, step))
        while len(self._samples) > 2 and at - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.pop(0)

    def _rate(self) -> float | None:
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def record(self) -> dict:
        """As the job's record keeps it ({} before the first step)."""
        if self.step is None:
            return {}
        return {"step": self.step, "total": self.total, "rate": self.rate, "at": self.at, "numbers": self.numbers}


def cells(progress: dict, last_output: float | None, now: float) -> tuple[str, str, str]:
    """`meshrun jobs`' STEP, RATE and LAST OUTPUT for a record's progress and last output ("-" where unknown)."""
    step = "-"
    if progress.get("step") is not None:
        step = f"{progress['step']}/{progress['total']}" if progress.get("total") else str(progress["step"])
    rate = progress.get("rate")
    rate_text = "-" if rate is None else f"{rate:.3g}/s" if rate >= 1 else f"{rate * 60:.3g}/min"
    age = "-" if last_output is None else f"{_ago(max(0.0, now - last_output))} ago"
    return step, rate_text, age


def _ago(s: float) -> str:
    return (
        f"{s:.0f}s"
        if s < 120
        else f"{s / 60:.0f}m"
        if s < 7200
        else f"{s / 3600:.0f}h"
        if s < 172800
        else f"{s / 86400:.0f}d"
    )
