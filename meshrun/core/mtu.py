"""Finding the largest packet a path carries, from a yes/no probe (pure: the probe is passed in).

A path whose routers drop oversized packets without the ICMP "fragmentation needed" that path MTU
discovery relies on (an ICMP black hole) is only found by sending packets of the full size and
seeing whether they arrive; this is the search over such probes.
"""

from __future__ import annotations

from collections.abc import Callable

from meshrun.core.model import MIN_MTU

STEP = 8  # sizes are searched to this granularity (IPv4 fragments are multiples of 8)


def largest(passes: Callable[[int], bool | None], lo: int = MIN_MTU, hi: int = 1500) -> int | None:
    """The largest size in [lo, hi] (to STEP bytes) for which `passes(size)` is true.

    `passes` is monotonic on a real path: what fits at size n fits below it. Returns hi at once if
    hi passes (one probe on a healthy path), None if lo does not pass or a probe cannot be made.
    """
    top = passes(hi)
    if top is None:
        return None
    if top:
        return hi
    bottom = passes(lo)
    if not bottom:
        return None
    good, bad = lo, hi  # invariant: good passes, bad does not
    while bad - good > STEP:
        mid = (good + bad) // 2 // STEP * STEP
        if mid <= good:
            mid = good + STEP
        ok = passes(mid)
        if ok is None:
            return None
        if ok:
            good = mid
        else:
            bad = mid
    return good
