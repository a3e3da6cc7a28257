"""Learning checks: run a chapter's properties against *your* implementation of its piece.

Each chapter's exercises ask you to write one function (an RMSNorm, a greedy loop, a batched
decode attention, ...). A learning check is a property that any correct version of that
function satisfies, tested by hypothesis on many generated inputs against an independent
oracle (transformers, or the mathematical definition). When it fails, hypothesis shrinks the
input to a minimal counterexample, which is what you see:

    from minivllm.learning_checks import check
    check("ch00.rms_norm", my_rms_norm)        # in a notebook: prints PASS or FAIL + example

    def test_mine():                           # in pytest
        assert_check("ch00.rms_norm", my_rms_norm)

From a shell: `python -m minivllm.learning_checks ch00.rms_norm mymodule:my_rms_norm`.
The test suite runs every check against minivllm's own implementation (it must pass) and
against a broken one (it must fail), so the checks themselves are checked.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import Phase, settings


@dataclass
class LearningCheck:
    name: str  # "ch00.rms_norm": chapter and piece
    signature: str  # the function the learner writes
    run_property: Callable[[Callable], None]  # raises (with hypothesis' notes) when impl is wrong
    reference: Callable[
        [], Callable
    ]  # returns minivllm's own implementation, adapted to `signature`


@dataclass
class CheckResult:
    name: str
    passed: bool
    report: str  # on failure: the minimal counterexample and the error

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            return f"PASS {self.name}"
        return f"FAIL {self.name}\n{self.report}"


_CHECKS: dict[str, LearningCheck] = {}


def check_settings(max_examples: int) -> settings:
    """Hypothesis settings for a learning check: no deadline (a learner's first version may be
    slow), no example database (every run starts fresh), no "explain" phase, whose
    line-coverage notes point into library code rather than at the learner's mistake, and one
    counterexample per failure: several distinct bugs would otherwise be reported as an
    ExceptionGroup whose one-line summary shows none of them."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        report_multiple_bugs=False,
    )


def first_mismatch(got, expected, atol: float, rtol: float = 0.0) -> tuple[int, ...] | None:
    """Index of the first element, in row-major order, where two tensors of one shape differ by
    more than atol + rtol * |expected| (NaN counts as different); None when all agree."""
    wrong = ~_isclose(got, expected, atol, rtol)
    if not wrong.any():
        return None
    return tuple(wrong.nonzero()[0].tolist())


def num_mismatches(got, expected, atol: float, rtol: float = 0.0, dims: int = 0) -> int:
    """How many of the leading index tuples (the first `dims` dimensions, or single elements
    when dims == 0) hold at least one wrong element."""
    wrong = ~_isclose(got, expected, atol, rtol)
    if dims:
        wrong = wrong.flatten(dims).any(-1)
    return int(wrong.sum())


def show_values(values, limit: int = 8) -> str:
    """A short vector as `[0.123, -1.5, ...]`: enough digits to compare, at most `limit`."""
    flat = values.detach().flatten().tolist()
    shown = [f"{value:.4g}" for value in flat[:limit]]
    if len(flat) > limit:
        shown.append(f"... ({len(flat)} values)")
    return "[" + ", ".join(shown) + "]"


def _isclose(got, expected, atol: float, rtol: float):
    return (got.double() - expected.double()).abs() <= atol + rtol * expected.double().abs()


def learning_check(name: str, signature: str, reference: Callable[[], Callable]):
    """Register a property function `prop(impl)` under `name`."""

    def register(run_property: Callable[[Callable], None]) -> Callable[[Callable], None]:
        _CHECKS[name] = LearningCheck(name, signature, run_property, reference)
        return run_property

    return register


def all_checks() -> dict[str, LearningCheck]:
    _load_chapters()
    return dict(_CHECKS)


def get_check(name: str) -> LearningCheck:
    checks = all_checks()
    if name not in checks:
        raise ValueError(f"no learning check named {name!r}; there are: {', '.join(checks)}")
    return checks[name]


def run_check(name: str, implementation: Callable) -> CheckResult:
    """Run the named check against `implementation`; never raises for a wrong implementation."""
    learning_check_ = get_check(name)
    try:
        learning_check_.run_property(implementation)
    except Exception as error:  # a wrong implementation may fail in any way; report it all
        # The message includes hypothesis' notes: the shrunk, minimal failing input.
        message = "".join(traceback.format_exception_only(type(error), error)).strip()
        report = f"expected: {learning_check_.signature}\n{message}"
        return CheckResult(name, False, report)
    return CheckResult(name, True, "")


def check(name: str, implementation: Callable) -> CheckResult:
    """Run a check and print PASS, or FAIL with the minimal counterexample (for notebooks)."""
    result = run_check(name, implementation)
    print(result)
    return result


def assert_check(name: str, implementation: Callable) -> None:
    """Run a check and raise AssertionError with the counterexample (for pytest)."""
    result = run_check(name, implementation)
    if not result.passed:
        raise AssertionError(str(result))


def _load_chapters() -> None:
    # Importing a chapter's module registers its checks.
    for module in ("chapter00", "chapter01", "chapter02", "chapter03", "chapter04", "chapter05"):
        importlib.import_module(f"minivllm.learning_checks.{module}")
