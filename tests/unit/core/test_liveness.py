"""meshrun.core.liveness: a node is gone after enough silence over enough probes in a row (pure)."""

from __future__ import annotations

from meshrun.core.liveness import Liveness


def test_gone_after_the_silence_and_the_misses_both():
    lv = Liveness(gone_after_s=4.0, min_misses=3)
    assert not lv.missed(sent=0.0, now=1.5)
    assert not lv.missed(sent=1.5, now=3.0)  # two misses, 3 s
    assert lv.missed(sent=3.0, now=4.5)  # three misses, 4.5 s since the first was sent
    assert lv.silent_since == 0.0 and lv.misses == 3


def test_many_quick_misses_are_not_enough_without_the_time():
    lv = Liveness(gone_after_s=4.0, min_misses=3)
    assert not any(lv.missed(sent=t / 10, now=t / 10 + 0.1) for t in range(10))  # 10 misses within 1.1 s


def test_a_long_single_miss_is_not_enough_without_the_count():
    lv = Liveness(gone_after_s=4.0, min_misses=3)
    assert not lv.missed(sent=0.0, now=60.0)
    assert not lv.missed(sent=60.0, now=61.0)


def test_an_answer_starts_the_count_again():
    lv = Liveness(gone_after_s=4.0, min_misses=3)
    lv.missed(0.0, 1.5)
    lv.missed(1.5, 3.0)
    lv.answered()
    assert lv.silent_since is None and lv.misses == 0
    assert not lv.missed(4.0, 5.5) and not lv.missed(5.5, 7.0)
    assert lv.missed(7.0, 8.5)
