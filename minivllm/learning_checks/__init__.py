"""Learning checks: run a chapter's properties against *your* implementation of its piece.

Each chapter's exercises ask you to write one function (an RMSNorm, a greedy loop, a batched
decode attention, ...). A learning check is a property that any correct version of that
function satisfies, tested by hypothesis on many generated inputs against an independent
oracle (transformers, or the mathematical definition). When it fails, hypothesis shrinks the
input to a minimal counterexample, which is what you see, with the expected and the actual
values; when your code raises, the report shows the line of your code that raised and the
arguments your function was called with:

    from minivllm.learning_checks import check
    check("ch00.rms_norm", my_rms_norm)        # in a notebook: prints PASS or FAIL + example

    def test_mine():                           # in pytest
        assert_check("ch00.rms_norm", my_rms_norm)

From a shell: `python -m minivllm.learning_checks ch00.rms_norm mymodule:my_rms_norm`.

The notebooks' exercise cells start as stubs that raise NotImplementedError; `check` then says
"not implemented yet" instead of failing. One solution per check lives apart, in
`minivllm.learning_checks.solutions` (check "chXX.name" -> `solutions.chXX.name`). With
MINIVLLM_CHECK_SOLUTIONS=1, or MINIVLLM_QUICK=1 (how CI runs the notebooks), `check` runs a
still-unwritten exercise's check on that solution instead, and raises if the solution fails.

The test suite runs every check against minivllm's own implementation and against the
solution (both must pass) and against a broken one (it must fail), so the checks themselves
are checked.
"""

from __future__ import annotations

import enum
import functools
import importlib
import inspect
import os
import pkgutil
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import Phase, settings
from hypothesis.reporting import with_reporter

SOLUTIONS_PACKAGE = "minivllm.learning_checks.solutions"


@dataclass
class LearningCheck:
    name: str  # "ch00.rms_norm": chapter and piece
    signature: str  # the function the learner writes
    run_property: Callable[[Callable], None]  # raises (with hypothesis' notes) when impl is wrong
    reference: Callable[
        [], Callable
    ]  # returns minivllm's own implementation, adapted to `signature`


class Status(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    NOT_IMPLEMENTED = "not implemented"  # the function still raises NotImplementedError


@dataclass
class CheckResult:
    name: str
    status: Status
    report: str = ""  # on failure: the minimal counterexample and the error
    # When `check` ran the solution in place of a stub (MINIVLLM_CHECK_SOLUTIONS or
    # MINIVLLM_QUICK): the solution's own result.
    solution: CheckResult | None = None
    printed: bool = field(default=False, repr=False, compare=False)  # by `check`, already

    @property
    def passed(self) -> bool:
        return self.status is Status.PASSED

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.status is Status.PASSED:
            return f"PASS {self.name}"
        if self.status is Status.NOT_IMPLEMENTED:
            return f"{self.name}: {self.report}"
        return f"FAIL {self.name}\n{self.report}"

    def _ipython_display_(self) -> None:
        # A notebook cell that ends with `check(...)` shows the result once: `check` printed it.
        if not self.printed:
            print(self)


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
        # Continuous integration (CI set) draws the same examples on every run: a red run is
        # a real failure that the next run reproduces, never an unlucky draw.
        derandomize=bool(os.environ.get("CI")),
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
    """Run the named check against `implementation`; never raises for a wrong implementation.
    A function that still raises NotImplementedError (a stub) gets Status.NOT_IMPLEMENTED."""
    learning_check_ = get_check(name)
    calls = _RecordedCalls(implementation)
    reports: list[str] = []
    try:
        # Hypothesis' own messages (the seed to reproduce a failure) are held back: the
        # report below says what matters.
        with with_reporter(reports.append):
            learning_check_.run_property(calls)
    except _StillAStub as stub:
        report = f"not implemented yet: write {short_signature(learning_check_.signature)}"
        if calls.num_returned:  # written in part: say which input is not handled yet
            error = stub.__cause__
            frame = _learner_frame(error)
            where = f" at {_where(frame)}" if frame is not None else ""
            report += (
                f"\n  it returned for {calls.num_returned} input(s), then raised "
                f"{type(error).__name__}({str(error)!r}){where}\n"
                f"  in the call {_shorten(calls.describe_call(), 600)}"
            )
        return CheckResult(name, Status.NOT_IMPLEMENTED, report)
    except Exception as error:  # a wrong implementation may fail in any way; report it all
        report = f"signature: {learning_check_.signature}\n{_explain(error, calls)}"
        return CheckResult(name, Status.FAILED, report)
    return CheckResult(name, Status.PASSED)


def check(name: str, implementation: Callable) -> CheckResult:
    """Run a check and print PASS, or FAIL with the minimal counterexample (for notebooks).

    A stub (a function that raises NotImplementedError) prints "not implemented yet" and no
    traceback. With MINIVLLM_CHECK_SOLUTIONS=1 or MINIVLLM_QUICK=1 (CI), the check then runs
    on the solution instead and raises AssertionError if the solution fails."""
    result = run_check(name, implementation)
    result.printed = True
    if result.status is not Status.NOT_IMPLEMENTED:
        print(result)
        return result
    first_line, _, details = str(result).partition("\n")
    print(f"{first_line} in the cell above; then run this cell again")
    if details:
        print(details)
    if checks_solutions_instead():
        result.solution = run_check(name, get_solution(name))
        print(f"checking the solution {solution_path(name)} instead: {result.solution}")
        if not result.solution.passed:
            raise AssertionError(
                f"the solution {solution_path(name)} fails its check:\n{result.solution}"
            )
    return result


def assert_check(name: str, implementation: Callable) -> None:
    """Run a check and raise AssertionError with the counterexample (for pytest)."""
    result = run_check(name, implementation)
    if not result.passed:
        raise AssertionError(str(result))


def checks_solutions_instead() -> bool:
    """Whether `check` runs the solution in place of a stub: MINIVLLM_CHECK_SOLUTIONS=1, or
    MINIVLLM_QUICK=1 (the notebooks in CI, whose exercise cells are stubs)."""
    return "1" in (os.environ.get("MINIVLLM_CHECK_SOLUTIONS"), os.environ.get("MINIVLLM_QUICK"))


def solution_path(name: str) -> str:
    """Where the solution of check "chXX.name" lives: minivllm.learning_checks.solutions.chXX.name."""
    return f"{SOLUTIONS_PACKAGE}.{name}"


def get_solution(name: str) -> Callable:
    """The solution of the named check: a plain function with the check's signature."""
    get_check(name)  # the check must exist
    chapter, _, function = name.partition(".")
    module = importlib.import_module(f"{SOLUTIONS_PACKAGE}.{chapter}")
    solution = getattr(module, function, None)
    if solution is None:
        raise LookupError(f"no solution for {name}: expected {solution_path(name)}")
    return solution


def short_signature(signature: str) -> str:
    """The function's head, `name(args) -> result`, without the explanation after it."""
    for separator in (";", "  ("):
        signature = signature.split(separator)[0]
    return signature.strip()


def _load_chapters() -> None:
    # Importing a chapter's module registers its checks; every module named chapter* counts.
    for module in pkgutil.iter_modules(__path__):
        if module.name.startswith("chapter"):
            importlib.import_module(f"{__name__}.{module.name}")


# --- Calling the learner's function, and explaining what went wrong --------------------------


class _StillAStub(BaseException):
    """Raised in place of a stub's NotImplementedError. Not an Exception, so hypothesis does
    not treat it as a failure to shrink: it stops the check at the first call."""


_NOTHING = object()


class _RecordedCalls:
    """The learner's function, remembering its latest call: the arguments it got and what it
    returned, which the report shows when something goes wrong."""

    def __init__(self, implementation: Callable):
        functools.update_wrapper(self, implementation)
        self.implementation = implementation
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.returned = _NOTHING
        self.called = False
        self.num_returned = 0

    def __call__(self, *args, **kwargs):
        self.args, self.kwargs, self.returned, self.called = args, kwargs, _NOTHING, True
        try:
            result = self.implementation(*args, **kwargs)
        except NotImplementedError as error:
            if _raised_by_a_stub(error):
                raise _StillAStub() from error
            raise
        self.returned = result
        if not inspect.isasyncgen(result):  # a generator's body has not run yet: not an answer
            self.num_returned += 1
        return result

    def describe_call(self) -> str:
        """`rms_norm(x=Tensor[1, 1] float32 [0.001541], weight=..., eps=1e-06)`."""
        name = getattr(self.implementation, "__name__", "your function")
        try:
            bound = inspect.signature(self.implementation).bind(*self.args, **self.kwargs)
            named = list(bound.arguments.items())
        except (TypeError, ValueError):  # no signature, or one that does not fit the call
            named = [(None, value) for value in self.args] + list(self.kwargs.items())
        arguments = [
            _describe(value) if key is None else f"{key}={_describe(value)}" for key, value in named
        ]
        return f"{name}({', '.join(arguments)})"


def reraise_if_stub(error: BaseException) -> None:
    """For a check that runs the learner's code later than the call (an async generator's body
    runs when it is iterated): a stub's NotImplementedError, caught there, stops the check as a
    stub, as it would at the call."""
    if isinstance(error, NotImplementedError) and _raised_by_a_stub(error):
        raise _StillAStub() from error


def _raised_by_a_stub(error: NotImplementedError) -> bool:
    """A `raise NotImplementedError` in the learner's own code (not, say, a PyTorch operator
    missing for some dtype, which raises the same exception from inside the library)."""
    innermost = traceback.extract_tb(error.__traceback__)[-1]
    if not _is_learners_file(innermost.filename):
        return False
    line = (innermost.line or "").strip()
    return not line or line.startswith("raise")  # not a call into a library that raised


def _explain(error: BaseException, calls: _RecordedCalls) -> str:
    """The error, where the learner's code raised it (if it did), with the call's arguments;
    then hypothesis' notes: the minimal failing input."""
    exception = traceback.TracebackException.from_exception(error)
    notes = exception.__notes__ or []
    exception.__notes__ = None
    lines = ["".join(exception.format_exception_only()).rstrip()]
    frame = _learner_frame(error)
    if frame is not None:
        lines.append(f"  raised by your code at {_where(frame)}:")
        if frame.line:
            lines.append(f"    {frame.line.strip()}")
        lines.append(f"  in the call {_shorten(calls.describe_call(), 600)}")
    elif calls.called and calls.returned is not _NOTHING and not isinstance(error, AssertionError):
        lines.append(
            f"  raised by the check, on what your function returned: "
            f"{_shorten(_describe(calls.returned), 300)}"
        )
    return "\n".join(lines + [str(note) for note in notes])


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    import hypothesis

    dirs = {str(Path(__file__).resolve().parent.parent), str(Path(hypothesis.__file__).parent)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if key in sysconfig.get_paths():
            dirs.add(sysconfig.get_paths()[key])
    dirs.update(getattr(site, "getsitepackages", lambda: [])())
    if getattr(site, "ENABLE_USER_SITE", False):
        dirs.add(site.getusersitepackages())
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


_SOLUTIONS_DIR = os.path.realpath(Path(__file__).parent / "solutions") + os.sep


def _is_learners_file(filename: str) -> bool:
    """Code the learner wrote: a notebook cell, a test, a script; or a solution. Not minivllm,
    hypothesis, the standard library or an installed package."""
    if filename.startswith("<frozen"):
        return False
    path = os.path.realpath(filename) if not filename.startswith("<") else filename
    if path.startswith(_SOLUTIONS_DIR):
        return True
    return not path.startswith(_library_dirs())


def _learner_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The last frame of the traceback in the learner's code: the line that raised, or that
    called into the library that raised."""
    learner = None
    for frame in traceback.extract_tb(error.__traceback__):
        if _is_learners_file(frame.filename):
            learner = frame
    return learner


def _where(frame: traceback.FrameSummary) -> str:
    """`Cell In[12], line 5, in rms_norm` for a notebook cell, as IPython writes it; else the
    file."""
    place = f"{frame.filename}, line {frame.lineno}"
    ipython = sys.modules.get("IPython")
    if ipython is not None:
        try:
            shell = ipython.get_ipython()
            cell = shell.compile._filename_map.get(frame.filename) if shell else None
        except Exception:  # another IPython version: the file name will do
            cell = None
        if cell is not None:
            place = f"Cell In[{cell}], line {frame.lineno}"
    return f"{place}, in {frame.name}"


def _describe(value, limit: int = 8) -> str:
    """A value as a learner wants to see it in a report: a tensor's shape, dtype and (first)
    values; a model's class; anything else by repr."""
    import torch

    if isinstance(value, torch.Tensor):
        shape = ", ".join(str(size) for size in value.shape)
        dtype = str(value.dtype).removeprefix("torch.")
        if value.is_floating_point():
            return f"Tensor[{shape}] {dtype} {show_values(value, limit)}"
        flat = value.detach().flatten().tolist()
        shown = ", ".join(str(x) for x in flat[:limit])
        more = f", ... ({len(flat)} values)" if len(flat) > limit else ""
        return f"Tensor[{shape}] {dtype} [{shown}{more}]"
    if isinstance(value, torch.nn.Module):
        return f"<{type(value).__name__}>"
    return _shorten(repr(value), 200)


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 4] + " ..."
