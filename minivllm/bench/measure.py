"""Chapter 11 — one way to time things, for every comparison the book makes.

One timing on a small shared machine says little: two runs of the same engine on the same
workload can differ by a quarter (another process wakes up, the CPU changes its clock, memory
was just freed). A difference of a few percent between two methods timed once each is then no
finding at all. So a comparison here is made the same way everywhere:

1. The methods run **interleaved**, in rounds (A B C, A B C, ...), not one after the other, so
   that a slow minute of the machine falls on all of them alike.
2. **Warm-up rounds are discarded**: the first call compiles, fills caches and touches memory
   for the first time, which later calls do not pay.
3. Every method is **repeated** and reported as the **median and the range** of its rounds.
4. A **ratio is taken within each round** (B's seconds over A's in the same round), so that
   drift from round to round cancels, and its median and range are reported.
5. A goal gets a **verdict** from the range of that ratio: "met" when even the worst round
   reaches it, "not met" when even the best round misses it, and "undecided" when the goal lies
   inside the spread: that difference is noise until more rounds or a quieter machine say
   otherwise.

What happens once and cannot be repeated in rounds (an engine's start-up, a first compilation)
is timed by `stopwatch`, so that every timing of the book goes through this module.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

Result = TypeVar("Result")


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one quantity: their median and range."""

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("a spread needs at least one measurement")

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def format(self, digits: int = 2, unit: str = "") -> str:
        """'1.23x (1.10-1.31x)': the median, then the range when there is more than one value."""
        median = f"{self.median:.{digits}f}{unit}"
        if len(self.values) == 1:
            return median
        return f"{median} ({self.low:.{digits}f}-{self.high:.{digits}f}{unit})"


@dataclass
class Timings(Generic[Result]):
    """What `interleaved` measured: each method's seconds and results round by round (warm-ups
    left out), and the result its last call returned."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    results: dict[str, Result] = field(default_factory=dict)
    round_results: dict[str, list[Result]] = field(default_factory=dict)

    def spread(self, method: str) -> Spread:
        return Spread(tuple(self.seconds[method]))

    def speedup(self, method: str, baseline: str) -> Spread:
        """The baseline's seconds over the method's, round by round: above 1, the method is
        faster (for the same work)."""
        return ratio_within_rounds(self.seconds[baseline], self.seconds[method])


def ratio_within_rounds(numerators: Sequence[float], denominators: Sequence[float]) -> Spread:
    """Each round's numerator over the same round's denominator, so that the machine's drift
    from round to round cancels; both must have one value per round."""
    pairs = zip(numerators, denominators, strict=True)
    return Spread(tuple(a / b for a, b in pairs))


def rate_spread(amount: float, seconds: Spread) -> Spread:
    """`amount` (tokens, say) per second, round by round."""
    return Spread(tuple(amount / s for s in seconds.values))


def ratio_spread(numerators: Spread, denominators: Spread) -> Spread:
    """`ratio_within_rounds` of two spreads measured in the same rounds."""
    return ratio_within_rounds(numerators.values, denominators.values)


def interleaved(
    runs: Mapping[str, Callable[[], Result]],
    repeats: int = 5,
    warmups: int = 1,
    prepare: Mapping[str, Callable[[], None]] | None = None,
    synchronize: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> Timings[Result]:
    """Time every method of `runs` in `warmups + repeats` rounds, each round calling every
    method once in the order given; `prepare[name]`, if given, runs untimed before each of that
    method's calls (say, emptying a cache so that every call starts cold). `synchronize` waits
    for a device's queued work, so that the clock stops when the work is done."""
    if repeats < 1 or warmups < 0:
        raise ValueError(f"repeats must be >= 1 and warmups >= 0, not {repeats} and {warmups}")
    prepare = prepare or {}
    timings: Timings[Result] = Timings(
        {name: [] for name in runs}, round_results={name: [] for name in runs}
    )
    for round_number in range(warmups + repeats):
        for name, run in runs.items():
            if name in prepare:
                prepare[name]()
            synchronize()
            start = clock()
            result = run()
            synchronize()
            seconds = clock() - start
            if round_number >= warmups:
                timings.seconds[name].append(seconds)
                timings.round_results[name].append(result)
            timings.results[name] = result
    return timings


def synchronize(device: torch.device | str) -> None:
    """Wait for a GPU's queued work (nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


MET, NOT_MET, UNDECIDED = "met", "not met", "undecided (within the spread)"


def verdict(ratio: Spread, goal: float) -> str:
    """Whether a ratio (higher is better) reaches `goal`: in every round, in none, or the goal
    lies within the rounds' spread."""
    if ratio.low >= goal:
        return MET
    if ratio.high < goal:
        return NOT_MET
    return UNDECIDED


@dataclass
class Stopwatch:
    seconds: float = 0.0


@contextmanager
def stopwatch(
    synchronize: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter
) -> Iterator[Stopwatch]:
    """The duration of a one-off event: `with stopwatch() as watch: ...`, then `watch.seconds`.
    A one-off number has no spread: say so where it is quoted, and compare in rounds instead
    wherever the event can be repeated."""
    watch = Stopwatch()
    synchronize()
    start = clock()
    try:
        yield watch
    finally:
        synchronize()
        watch.seconds = clock() - start
