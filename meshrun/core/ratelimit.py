"""A token bucket per key (a source address, a member): how often something may be asked. Pure but for the
default clock; thread-safe."""

from __future__ import annotations

import threading
import time

__all__ = ["RateLimiter"]


class RateLimiter:
    """`burst` requests per key at once, refilled at `per_s` per second; memory bounded by `max_keys`."""

    def __init__(self, burst: int = 10, per_s: float = 0.5, max_keys: int = 10000) -> None:
        self.burst, self.per_s, self.max_keys = burst, per_s, max_keys
        self._b: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str, now: float | None = None) -> bool:
        """Take one request from `key`'s bucket; False when it is empty."""
        now = time.monotonic() if now is None else now
        with self._lock:
            level, last = self._b.get(key, (float(self.burst), now))
            level = min(self.burst, level + (now - last) * self.per_s)
            ok = level >= 1
            self._b[key] = (level - 1 if ok else level, now)
            if len(self._b) > self.max_keys:  # bound memory under a spray of keys: forget the full buckets
                self._b = {k: v for k, v in self._b.items() if now - v[1] < self.burst / max(self.per_s, 1e-9)}
            return ok
