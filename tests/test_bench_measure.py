"""The measuring harness (bench/measure.py): interleaved rounds, warm-ups left out, ratios taken
round by round, and verdicts that say "undecided" when a goal lies within the spread. The
methods here advance a fake clock, so every expected number is known exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.bench.measure import (
    MET,
    NOT_MET,
    UNDECIDED,
    Spread,
    interleaved,
    stopwatch,
    verdict,
)


class FakeClock:
    """A clock that moves only when a fake method says it took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def method(self, name: str, seconds_per_call, calls: list[str]):
        """A method that records its call and takes seconds_per_call(call number) seconds."""
        count = 0

        def run():
            nonlocal count
            calls.append(name)
            self.now += seconds_per_call(count)
            count += 1
            return count

        return run


def test_methods_run_interleaved_in_rounds_and_warmups_are_left_out():
    clock, calls = FakeClock(), []
    runs = {
        "a": clock.method("a", lambda i: 10.0 + i, calls),  # 10, 11, 12, ...
        "b": clock.method("b", lambda i: 1.0, calls),
    }
    timings = interleaved(runs, repeats=3, warmups=2, clock=clock)
    assert calls == ["a", "b"] * 5  # A B, A B, ... not A A A A A B B B B B
    assert timings.seconds == {"a": [12.0, 13.0, 14.0], "b": [1.0, 1.0, 1.0]}
    assert timings.results == {"a": 5, "b": 5}  # the last call's result
    assert timings.round_results == {"a": [3, 4, 5], "b": [3, 4, 5]}  # the timed rounds'
    assert timings.spread("a").median == 13.0


def test_preparation_runs_before_every_call_and_is_not_timed():
    clock, calls = FakeClock(), []
    prepared = []

    def empty_the_cache():
        prepared.append(len(calls))
        clock.now += 100.0  # slow, and none of it counted

    runs = {"a": clock.method("a", lambda i: 2.0, calls)}
    timings = interleaved(runs, repeats=2, warmups=1, prepare={"a": empty_the_cache}, clock=clock)
    assert prepared == [0, 1, 2]
    assert timings.seconds["a"] == [2.0, 2.0]


@settings(max_examples=50)
@given(
    drift=st.lists(st.floats(0.5, 4.0), min_size=2, max_size=8),
    ratio=st.floats(0.25, 4.0),
)
def test_a_ratio_taken_round_by_round_cancels_the_machines_drift(drift, ratio):
    """Each round the machine is slower or faster by `drift[i]` for both methods: their
    seconds spread widely, the ratio within each round does not spread at all."""
    clock, calls = FakeClock(), []
    runs = {
        "base": clock.method("base", lambda i: drift[i], calls),
        "fast": clock.method("fast", lambda i: drift[i] / ratio, calls),
    }
    timings = interleaved(runs, repeats=len(drift), warmups=0, clock=clock)
    speedup = timings.speedup("fast", baseline="base")
    assert speedup.low == pytest.approx(ratio) and speedup.high == pytest.approx(ratio)
    assert timings.spread("base").values == pytest.approx(drift)


ratios = st.lists(st.floats(0.1, 10.0), min_size=1, max_size=10)


@settings(max_examples=100)
@given(values=ratios, goal=st.floats(0.1, 10.0))
def test_a_goal_is_met_only_in_every_round_and_missed_only_in_every_round(values, goal):
    outcome = verdict(Spread(tuple(values)), goal)
    if all(v >= goal for v in values):
        assert outcome == MET
    elif all(v < goal for v in values):
        assert outcome == NOT_MET
    else:
        assert outcome == UNDECIDED


def test_a_few_percent_inside_the_spread_is_undecided():
    assert verdict(Spread((0.97, 1.02, 1.05)), goal=1.0) == UNDECIDED
    assert verdict(Spread((1.01, 1.02, 1.05)), goal=1.0) == MET
    assert verdict(Spread((1.0, 1.2)), goal=1.0) == MET  # reaching the goal is meeting it
    assert verdict(Spread((0.71, 0.69, 0.74)), goal=1.1) == NOT_MET


def test_a_spread_prints_its_median_and_range():
    assert Spread((1.31, 1.1, 1.234)).format(unit="x") == "1.23x (1.10-1.31x)"
    assert Spread((2.0,)).format() == "2.00"  # one value: no range to show
    with pytest.raises(ValueError, match="at least one"):
        Spread(())


@pytest.mark.parametrize("repeats, warmups", [(0, 1), (3, -1)])
def test_impossible_round_counts_are_refused(repeats, warmups):
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"a": lambda: None}, repeats=repeats, warmups=warmups)


def test_a_stopwatch_times_its_block_once_synchronized_on_both_ends():
    clock, synchronized = FakeClock(), []
    with stopwatch(synchronize=lambda: synchronized.append(clock.now), clock=clock) as watch:
        clock.now += 3.5
    assert watch.seconds == 3.5
    assert synchronized == [0.0, 3.5]  # before the clock starts and before it stops
