"""Small helpers shared by every chapter: ceiling division, one SDPA call in the model's
layout, and the checks that turn a bad setting into a `ValueError` naming it."""

from __future__ import annotations

import math
import numbers
import subprocess
from typing import NoReturn

import torch
import torch.nn.functional as F


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a tokens."""
    return -(-a // b)


def tokens_first_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """PyTorch's `scaled_dot_product_attention` (with `enable_gqa`) for one sequence laid out
    [tokens, heads, head_dim], the model's layout, which SDPA wants as [batch, heads, tokens,
    head_dim]. The batch dimension of 1 matters: SDPA's fused CPU kernel takes only 4-D inputs,
    and 3-D ones fall back to an unfused path that is 3x slower at 300 tokens.
    """
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True
    )
    return out[0].transpose(0, 1)


# --- Validation: every failure names the setting, the value and the rule ---


def reject(name: str, value: object, allowed: str) -> NoReturn:
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def as_int(name: str, value: object) -> int:
    # bool is an int subclass in Python, but n=True is a bug, not a count.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        reject(name, value, "an int")
    return int(value)


def int_at_least(name: str, value: object, minimum: int) -> int:
    number = as_int(name, value)
    if number < minimum:
        reject(name, number, f">= {minimum}")
    return number


def float_in(
    name: str,
    value: object,
    low: float,
    high: float = math.inf,
    low_inclusive: bool = True,
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        reject(name, value, "a number")
    number = float(value)
    if not math.isfinite(number):
        reject(name, number, "a finite number")
    too_low = number < low if low_inclusive else number <= low
    if too_low or number > high:
        lower = f">= {low:g}" if low_inclusive else f"> {low:g}"
        reject(name, number, lower if high == math.inf else f"{lower} and <= {high:g}")
    return number


def string_list(name: str, value: object) -> list[str]:
    if value is None:
        return []
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list | tuple):
        reject(name, value, "None, a str or a list of str")
    for item in strings:
        if not isinstance(item, str) or not item:
            reject(name, value, "None, a str or a list of str, with no empty strings")
    return list(strings)


def token_id_list(name: str, value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        reject(name, value, "None or a list of int token ids")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, numbers.Integral) or item < 0:
            reject(name, value, "None or a list of int token ids, each >= 0")
    return [int(item) for item in value]


def wait_or_kill(process: subprocess.Popen, timeout_s: float) -> None:
    """Give a child process `timeout_s` to exit on its own, then kill it; reaped either way."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# Libraries of operators this package defines, kept alive as long as the process: an operator
# lives only as long as the `torch.library.Library` that defined it.
_OPERATOR_LIBRARIES: dict[str, torch.library.Library] = {}


def define_operator(qualified_name: str, schema: str, impl, fake) -> None:
    """Define `torch.ops.<namespace>.<name>` from a schema, `impl` for every device and `fake`
    for the compiler (a tensor of the result's shape and dtype). This is what
    `torch.library.custom_op` does, less the checks it runs on every call (autograd, aliasing),
    about 10 us each: chapter 11's compiled step calls these operators 150 times a step."""
    namespace, name = qualified_name.split("::")
    if namespace not in _OPERATOR_LIBRARIES:
        _OPERATOR_LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    library = _OPERATOR_LIBRARIES[namespace]
    library.define(f"{name}{schema}")
    library.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(qualified_name, lib=library)(fake)
