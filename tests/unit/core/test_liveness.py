"""meshrun.core.liveness: a node is gone after enough silence over enough probes in a row (pure)."""

from __future__ import annotations

from meshrun.core.liveness import GONE_AFTER_S, MAX_IN_FLIGHT, Liveness, Probes


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


class Probe:
    """A probe in flight: settled by the test, at a time it says."""

    def __init__(self) -> None:
        self.result: tuple[bool, float] | None = None


def drive(probes: Probes, names: list[str], until: float, answers, timeout: float = 1.5, step: float = 0.05):
    """Run `probes` from 0 to `until` seconds with a clock in steps: each probe of node N sent at t is answered at
    t + 0.02 if answers(N, t), else settled unanswered at t + timeout. Returns [(t, name)] of the verdicts."""
    out, live = [], []
    for i in range(int(until / step) + 1):
        t = i * step
        for sent, name, p in live:
            if p.result is None and t >= sent + (0.02 if answers(name, sent) else timeout):
                p.result = (answers(name, sent), t)
        for name in probes.due(names, t):
            p = Probe()
            probes.sent(name, t, p)
            live.append((t, name, p))
        probes.settle(lambda p: p.result)
        out += [(t, name) for name, _, _ in probes.gone(names, t)]
    return out


def test_overlapping_probes_call_a_gone_machine_a_period_per_miss_not_a_timeout():
    probes = Probes(period_s=1.0)
    verdicts = drive(probes, ["a", "b"], 8.0, lambda name, t: name == "a" or t < 2.0)
    first = verdicts[0]
    # b's first unanswered probe is sent at 2.0; MIN_MISSES 3 are settled by 2.0 + 2 periods + the timeout.
    assert first[1] == "b" and 2.0 + GONE_AFTER_S <= first[0] <= 2.0 + 2 * 1.0 + 1.5 + 0.1, verdicts
    assert all(name == "b" for _, name in verdicts)


def test_no_more_than_two_probes_of_a_silent_node_wait_at_once():
    probes = Probes(period_s=0.2)
    drive(probes, ["a"], 3.0, lambda name, t: t < 1.0, timeout=1.5)
    assert len(probes.in_flight["a"]) <= MAX_IN_FLIGHT


def test_every_node_silent_at_once_calls_none_gone():
    probes = Probes(period_s=1.0)
    assert drive(probes, ["a", "b"], 10.0, lambda name, t: t < 2.0) == []


def test_a_node_no_longer_named_is_forgotten():
    probes = Probes(period_s=1.0)
    drive(probes, ["a", "b"], 3.0, lambda name, t: True)
    assert probes.due(["a"], 100.0) == ["a"] and set(probes.in_flight) <= {"a"} and "b" not in probes.seen
