"""meshrun.core.mtu: the largest size a path carries, from yes/no probes."""

from __future__ import annotations

from meshrun.core import mtu


def test_mtu_search_finds_the_largest_passing_size_in_few_probes():
    asked = []

    def passes(limit):
        def probe(n):
            asked.append(n)
            return n <= limit

        return probe

    assert mtu.largest(passes(1420), 576, 1420) == 1420 and asked == [1420]
    asked.clear()
    found = mtu.largest(passes(1341), 576, 1420)
    assert 1341 - mtu.STEP < found <= 1341 and len(asked) <= 12
    assert mtu.largest(passes(500), 576, 1420) is None
    assert mtu.largest(lambda n: None, 576, 1420) is None


def test_a_probe_that_cannot_be_made_midway_gives_no_answer():
    answers = iter([False, True, None])
    assert mtu.largest(lambda n: next(answers), 576, 1420) is None


def test_every_answer_is_a_multiple_of_the_step_above_the_floor():
    for limit in range(576, 1421, 37):
        found = mtu.largest(lambda n, limit=limit: n <= limit, 576, 1420)
        assert found is not None and found <= limit and limit - found < mtu.STEP + 1
        assert (found - 576) % mtu.STEP == 0 or found == 1420
