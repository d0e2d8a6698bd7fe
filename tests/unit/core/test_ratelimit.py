"""meshrun.core.ratelimit: a token bucket per key, with bounded memory."""

from __future__ import annotations

from meshrun.core.ratelimit import RateLimiter


def test_a_burst_then_the_refill_rate():
    rl = RateLimiter(burst=3, per_s=2.0)
    assert [rl.allow("a", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert rl.allow("a", now=0.4) is False  # 0.8 of a request refilled
    assert rl.allow("a", now=0.5) is True
    assert rl.allow("b", now=0.5) is True  # keys do not share a bucket


def test_a_quiet_key_refills_to_its_burst_and_no_further():
    rl = RateLimiter(burst=2, per_s=1.0)
    assert rl.allow("a", now=0.0) and rl.allow("a", now=0.0)
    assert [rl.allow("a", now=1000.0) for _ in range(3)] == [True, True, False]


def test_a_spray_of_keys_keeps_memory_bounded_and_forgets_only_full_buckets():
    rl = RateLimiter(burst=2, per_s=1.0, max_keys=100)
    rl.allow("busy", now=0.0)
    rl.allow("busy", now=0.0)
    for i in range(1000):
        rl.allow(f"spray{i}", now=10.0 + i)
    assert len(rl._b) <= 101
    assert rl.allow("busy", now=10.0 + 999) is True  # forgotten when full: no harm, it would allow anyway
