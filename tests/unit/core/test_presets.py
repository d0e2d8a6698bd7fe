"""meshrun.core.presets: the DiLoCo presets, what `--compression auto` picks from the link and the model, and why."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrun.core import presets
from meshrun.core.presets import LEVELS, PRESETS, SYNC_FRACTION, Choice, Link, Preset, decide, link_from_bench
from meshrun.errors import UsageError

MBIT = 1e6 / 8  # bytes per second in a Mbit/s


def _sync_s(level: str, params: int, workers: int, link: Link) -> float:
    return PRESETS[level].wire_per_param(workers) * params / link.bytes_per_s


def test_levels_go_from_least_to_most_compressed():
    wire = [PRESETS[level].wire_per_param(3) / PRESETS[level].sync_every for level in LEVELS]
    assert wire == sorted(wire, reverse=True) and len(set(wire)) == len(wire)
    assert PRESETS["high"].compression.startswith("sparse-") and PRESETS["medium"].fragments > 1


def test_wire_bytes_follow_the_collective():
    # all_reduce: 2(n-1)/n of the payload leaves each worker; all_gather: (n-1) payloads
    assert Preset("x", 1, 1, "bf16").wire_per_param(4) == pytest.approx(2 * 2 * 3 / 4)
    assert Preset("x", 1, 1, "fp4").wire_per_param(4) == pytest.approx(0.516 * 3)
    # one of every 64: a 6-bit position, 2 bits of value, a bf16 scale per 128 values
    assert Preset("x", 1, 1, "sparse-int2", 1 / 64).payload_per_param() == pytest.approx((0.75 + 0.25 + 2 / 128) / 64)
    # one of every 1024 (the power of two nearest 1 / density): 10-bit positions
    assert Preset("x", 1, 1, "sparse-fp4", 1 / 1000).payload_per_param() == pytest.approx((1.25 + 0.5 + 2 / 128) / 1024)
    assert Preset("x", 1, 1, "none").wire_per_param(1) == 0


def test_a_level_asked_by_name_is_taken_as_is():
    for level in LEVELS:
        choice = decide(level, None, None, 3)
        assert choice.preset == PRESETS[level] and choice.reason == "asked for"
    with pytest.raises(UsageError, match="--compression 'extreme' is not a preset") as exc:
        decide("extreme", None, None, 3)
    assert "auto, none, low, medium, high" in exc.value.fix


def test_auto_without_a_measurement_or_a_model_size_says_so_and_takes_medium():
    nothing = decide("auto", None, 10**9, 3)
    assert nothing.preset == PRESETS["medium"] and "no `meshrun bench` result" in nothing.reason
    assert "run `meshrun bench`" in nothing.reason
    link = Link(200 * MBIT, "slowest cross-site pair a -> b 200 Mbit/s")
    unknown = decide("auto", link, None, 3)
    assert unknown.preset == PRESETS["medium"] and "model size unknown" in unknown.reason
    assert "--model-size" in unknown.reason and "200 Mbit/s" in unknown.reason


@pytest.mark.parametrize(
    "mbit, params, expected",
    [
        (100_000, 10**6, "none"),  # a fast link and a small model: no compression needed
        (200, 10**7, "low"),  # 10 M parameters over 200 Mbit/s: bf16 fits 5 % of 50 s
        (200, 4 * 10**7, "medium"),
        (200, 10**8, "high"),
        (200, 2 * 10**9, "high"),  # over budget even at high: said so
    ],
)
def test_auto_takes_the_least_compression_that_keeps_syncs_under_the_stated_fraction(mbit, params, expected):
    link = Link(mbit * MBIT, f"slowest cross-site pair {mbit} Mbit/s")
    choice = decide("auto", link, params, 3)
    assert choice.preset == PRESETS[expected], choice.reason
    assert link.what in choice.reason and "3 workers" in choice.reason
    if expected == "high" and _sync_s("high", params, 3, link) > SYNC_FRACTION * PRESETS["high"].sync_every:
        assert "even high" in choice.reason and "expect the syncs to slow training down" in choice.reason
    else:
        assert "at most 5%" in choice.reason and "assumed" in choice.reason


@settings(max_examples=200, deadline=None)
@given(
    mbit=st.floats(1, 1e5),
    params=st.integers(10**4, 10**11),
    workers=st.integers(2, 16),
    step=st.floats(0.01, 10),
)
def test_auto_never_picks_more_compression_than_needed(mbit, params, workers, step):
    link = Link(mbit * MBIT, "x")
    choice = decide("auto", link, params, workers, step)
    assert choice.preset is not None
    picked = LEVELS.index(choice.preset.name)
    for level in LEVELS[:picked]:  # every less compressed level would have been over the budget
        assert _sync_s(level, params, workers, link) > SYNC_FRACTION * PRESETS[level].sync_every * step
    fits = _sync_s(choice.preset.name, params, workers, link) <= SYNC_FRACTION * choice.preset.sync_every * step
    assert fits or choice.preset.name == "high"


def test_a_given_step_time_replaces_the_assumed_one():
    link = Link(200 * MBIT, "x")
    assert decide("auto", link, 10**8, 3).preset == PRESETS["high"]  # at the assumed 1 s per step
    slow_steps = decide("auto", link, 10**8, 3, step_s=20.0)
    assert (
        slow_steps.preset == PRESETS["low"] and "x 20 s (" in slow_steps.reason and "assumed" not in slow_steps.reason
    )


def test_the_link_is_the_slowest_cross_site_figure_of_the_bench_result():
    result = {
        "sites": {"eu": ["a", "b"], "us": ["c"]},
        "pairs": [
            {"src": "a", "dst": "b", "mbit_s": 5.0},  # inside a site: not what a cross-site sync crosses
            {"src": "a", "dst": "c", "mbit_s": 180.0},
            {"src": "c", "dst": "b", "mbit_s": 150.0},
            {"src": "b", "dst": "c", "mbit_s": 0.0},  # failed: not a figure
        ],
        "best_busbw_GBps": 0.5,
        "measured_at": 1_700_000_000.0,
    }
    link = link_from_bench(result)
    assert link is not None and link.bytes_per_s == pytest.approx(150 * MBIT)
    assert "c -> b 150 Mbit/s" in link.what and "2023-11-14 22:13 UTC" in link.what
    # the all-reduce reached less: that is the figure
    slower = link_from_bench({**result, "best_busbw_GBps": 0.01})
    assert slower is not None and slower.bytes_per_s == pytest.approx(1e7) and "all-reduce" in slower.what
    # without sites every pair counts
    flat = link_from_bench({"pairs": result["pairs"]})
    assert flat is not None and flat.bytes_per_s == pytest.approx(5 * MBIT) and "measured" not in flat.what
    assert link_from_bench({"pairs": [], "best_busbw_GBps": None}) is None


@pytest.mark.parametrize(
    "text, count",
    [("1.3B", 1_300_000_000), ("350M", 350_000_000), ("125000000", 125_000_000), ("66k", 66_000), (7, 7)],
)
def test_model_sizes_parse(text, count):
    assert presets.parse_model_size(text) == count


@pytest.mark.parametrize("bad", ["", "1.3X", "a lot", "-5M", "0", True])
def test_bad_model_sizes_name_the_value(bad):
    with pytest.raises(UsageError) as exc:
        presets.parse_model_size(bad)
    assert "--model-size" in exc.value.message and "1.3B" in exc.value.fix


def test_a_preset_reaches_the_workers_as_variables_and_the_choice_round_trips():
    p = PRESETS["high"]
    assert p.env() == {
        "MESHRUN_DILOCO_PRESET": "high",
        "MESHRUN_DILOCO_SYNC_EVERY": "20",
        "MESHRUN_DILOCO_FRAGMENTS": "1",
        "MESHRUN_DILOCO_COMPRESSION": "sparse-int2",
        "MESHRUN_DILOCO_DENSITY": "0.015625",
        # SparseLoCo's outer step: the decayed error feedback plays the momentum
        "MESHRUN_DILOCO_OUTER_LR": "1.0",
        "MESHRUN_DILOCO_OUTER_MOMENTUM": "0.0",
        "MESHRUN_DILOCO_ERROR_DECAY": "0.95",
    }
    assert not {"MESHRUN_DILOCO_DENSITY", "MESHRUN_DILOCO_OUTER_LR"} & set(PRESETS["medium"].env())
    assert Preset.from_dict(p.to_dict()) == p
    choice = decide("auto", None, None, 3)
    assert Choice.from_dict(choice.to_dict()) == choice
    assert choice.line().startswith("compression auto -> medium: DiLoCo H=50, 2 fragments, fp4 (no `meshrun bench`")
    assert (
        decide("high", None, None, 3)
        .line()
        .startswith(
            "compression high: DiLoCo H=20, sparse-int2 (density 1/64), outer lr 1, momentum 0, error decay 0.95 ("
        )
    )
