"""Functions the async-engine tests send to the engine core with `call_engine`, shared by
test_ch09_async_engine.py and test_engine_review_2.py.

The engine core may run in a process of its own, and pickle sends a function there by module
and name. They live in this plain module, imported once: conftest's own functions may not be
found as the same object (pytest can import conftest twice in one process, as the mutation runs
of scripts/mutate.py do), so `pool_is_empty` wraps conftest's check.
"""

from __future__ import annotations

from conftest import assert_pool_is_empty


def engine_is_idle(engine) -> bool:
    return not engine.has_unfinished_requests()


def pool_is_empty(engine) -> None:
    assert_pool_is_empty(engine)
