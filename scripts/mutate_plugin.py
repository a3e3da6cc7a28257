"""A pytest plugin for the mutation runs of scripts/mutate.py: tiny models are made once.

mutmut runs the tests of every mutant in a fresh pytest session, forked from the process that
ran them all once first. The session fixtures are made again in each: the four random tiny
models of tests/conftest.py alone cost ten seconds or more a mutant, more than most tests.
A tiny model depends only on its arguments (family, seed, tokenizer, overrides), so this
plugin keeps the first one made for each in a directory of the parent process, and later
calls copy it into the directory they asked for: the same files, without building the model.
Every fork inherits what the parent made before it.

Loaded by scripts/mutate.py through PYTEST_PLUGINS (not mutmut's pytest arguments, which
would make mutmut forget its past results); nothing else uses it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import minivllm.models.tiny as tiny

_original = tiny.make_tiny_model
_cache_root = Path(tempfile.mkdtemp(prefix="minivllm-mutate-tiny-"))
_owner = os.getpid()
_made: dict[tuple, Path] = {}


@atexit.register
def _remove_cache() -> None:
    if os.getpid() == _owner:  # not in a fork: the parent's directory outlives its children
        shutil.rmtree(_cache_root, ignore_errors=True)


def make_tiny_model(family, out_dir, seed=0, tokenizer_dir=None, **overrides) -> Path:
    key = (
        family,
        seed,
        str(tokenizer_dir),
        tuple(sorted((k, repr(v)) for k, v in overrides.items())),
    )
    if key not in _made:
        _made[key] = _original(
            family, _cache_root / str(len(_made)), seed, tokenizer_dir, **overrides
        )
    out_dir = Path(out_dir)
    shutil.copytree(_made[key], out_dir, dirs_exist_ok=True)
    return out_dir


def _patch_loaded_modules() -> None:
    """Every module that imported make_tiny_model by name (conftest, test modules) gets ours."""
    for module in list(sys.modules.values()):
        if getattr(module, "make_tiny_model", None) is _original:
            module.make_tiny_model = make_tiny_model


def pytest_collection_finish(session) -> None:
    _patch_loaded_modules()
