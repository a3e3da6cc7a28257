"""Chapter 01b's learning checks: the sampler's filters (top-k, top-p, min-p) and penalties.

Each check works on one row of logits, a plain 1-D tensor, and compares the learner's function
with an oracle written straight from the definition in float64 Python (sorted lists, math.exp,
list.count), never with minivllm's own code. Logits come from a coarse grid so that ties turn
up often: the tie rules are part of each definition, and they are the rules of minivllm's
sampler (`minivllm/sample/sampler.py`).

Float32 code and a float64 oracle can disagree about a token that sits within rounding of a
threshold. Such a token may go either way; everywhere else the answer is exact. Exact boundaries
(four equal logits, p = 0.5) still are checked exactly, because their probabilities are exact in
float32 too.
"""

from __future__ import annotations

import math

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from minivllm.learning_checks import check_settings, learning_check

# How close to a threshold, in probability, a token may go either way (float32 rounding).
BOUNDARY_TOLERANCE = 1e-5

# Logits on a 0.5 grid, so that equal logits (ties) are frequent, plus a few wider values.
_grid_logit = st.integers(-8, 8).map(lambda half: half / 2)
_logit = st.one_of(_grid_logit, st.floats(-6, 6, width=32, allow_nan=False))


def _logit_rows(max_vocab: int = 10):
    return st.lists(_logit, min_size=1, max_size=max_vocab)


# --- the definitions, in float64 Python ---


def _softmax(logits: list[float]) -> list[float]:
    largest = max(logits)
    weights = [math.exp(x - largest) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def _likelihood_order(logits: list[float]) -> list[int]:
    """Token ids from most to least likely; equal logits go by token id, smaller first."""
    return sorted(range(len(logits)), key=lambda i: (-logits[i], i))


# --- comparing the learner's row with the oracle's decisions ---


def _show(values: list[float]) -> str:
    return "[" + ", ".join("-inf" if v == -math.inf else f"{v:.4g}" for v in values) + "]"


def _as_row(got, vocab_size: int) -> list[float]:
    """The learner's result as a list of floats, after checking that it is one row of logits."""
    assert isinstance(got, torch.Tensor), f"expected a Tensor, got {type(got).__name__}"
    assert tuple(got.shape) == (vocab_size,), (
        f"shape {tuple(got.shape)}, expected ({vocab_size},): one value per token of the "
        "vocabulary, -inf where the token is removed"
    )
    return [float(v) for v in got.tolist()]


def _check_filtered_row(
    got: list[float],
    logits: list[float],
    must_keep: set[int],
    must_drop: set[int],
    setting: str,
    why: dict[int, str],
) -> None:
    """Kept tokens keep their logit unchanged; removed tokens are -inf; tokens in neither set
    (within rounding of the threshold) may go either way. Fails at the first wrong token."""
    for token, (logit, value) in enumerate(zip(logits, got)):
        if token in must_drop and value != -math.inf:
            expected = "-inf (removed)"
        elif token in must_keep and value != logit:
            expected = f"{logit:.4g} (kept, unchanged)"
        elif token not in must_drop and value not in (logit, -math.inf):
            expected = f"{logit:.4g} (kept, unchanged) or -inf (removed)"
        else:
            continue
        either_way = sorted(set(range(len(logits))) - must_keep - must_drop)
        kept = [i for i, v in enumerate(got) if v != -math.inf]
        raise AssertionError(
            f"token {token}: expected {expected}, got {value:.4g} ({why[token]}); "
            f"logits={_show(logits)}, {setting}; expected kept tokens {sorted(must_keep)}"
            + (f" (either way: {either_way})" if either_way else "")
            + f", got kept {kept}"
        )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# --- top-k ---


def _on_one_row(apply_filter):
    """A batched filter of `sample/sampler.py` (rows of logits, one parameter per row) as the
    exercises' signature: one row of logits, one parameter."""
    return lambda logits, value: apply_filter(logits.unsqueeze(0), torch.tensor([value]))[0]


def _our_top_k():
    from minivllm.sample.sampler import apply_top_k

    return _on_one_row(apply_top_k)


@learning_check(
    "ch01b.top_k",
    signature="top_k(logits: Tensor[vocab], k: int) -> Tensor[vocab]  (keep the k largest "
    "logits, and every token tied with the k-th largest; the others become -inf; k = 0, or "
    "k >= vocab, keeps every token)",
    reference=_our_top_k,
)
def check_top_k(top_k) -> None:
    """A token survives exactly when fewer than k tokens have a strictly larger logit: the k
    largest survive, and so does every token tied with the k-th largest (as in vLLM). k = 0
    turns top-k off. Survivors keep their logit unchanged."""

    @check_settings(max_examples=150)
    @given(logits=_logit_rows(), data=st.data())
    def property_(logits, data):
        vocab_size = len(logits)
        k = data.draw(st.integers(0, vocab_size + 2), label="k")
        got = _as_row(top_k(torch.tensor(logits), k), vocab_size)

        why = {}
        if k == 0 or k >= vocab_size:
            must_keep = set(range(vocab_size))
            why = dict.fromkeys(must_keep, f"k={k} keeps every token")
        else:
            must_keep = set()
            for token, x in enumerate(logits):
                larger = sum(y > x for y in logits)
                if larger < k:
                    must_keep.add(token)
                why[token] = (
                    f"logit {x:.4g}, {larger} token(s) strictly larger, "
                    f"{'fewer than' if larger < k else 'at least'} k={k}"
                )
        must_drop = set(range(vocab_size)) - must_keep
        _check_filtered_row(got, logits, must_keep, must_drop, f"k={k}", why)

    property_()


# --- top-p ---


def _our_top_p():
    from minivllm.sample.sampler import apply_top_p

    return _on_one_row(apply_top_p)


@learning_check(
    "ch01b.top_p",
    signature="top_p(logits: Tensor[vocab], p: float) -> Tensor[vocab]  (0 < p <= 1; sort the "
    "tokens by logit, largest first, equal logits by token id; keep the shortest prefix whose "
    "probability adds up to at least p; the others become -inf)",
    reference=_our_top_p,
)
def check_top_p(top_p) -> None:
    """In likelihood order (ties by token id), a token is kept exactly when the tokens ranked
    above it have not yet reached p: the token that crosses p is kept, the ones after it are
    not. The most likely token is always kept; p = 1 keeps every token."""

    @check_settings(max_examples=200)
    @example(logits=[0.0, 0.0, 0.0, 0.0], p=0.5)  # the exact boundary, tried every run
    @given(
        logits=_logit_rows(),
        # Exact fractions put p right on a boundary when equal logits give exact probabilities
        # (four equal logits: 0.25 each, so p = 0.5 is reached by exactly two tokens).
        p=st.one_of(
            st.floats(0.01, 1.0),
            st.sampled_from([0.25, 0.5, 0.75, 1.0]),
        ),
    )
    def property_(logits, p):
        vocab_size = len(logits)
        got = _as_row(top_p(torch.tensor(logits), p), vocab_size)

        probs = _softmax(logits)
        must_keep, must_drop, why = set(), set(), {}
        mass_above = 0.0  # probability of the tokens ranked above the current one
        for rank, token in enumerate(_likelihood_order(logits), start=1):
            reason = (
                f"{_ordinal(rank)} most likely, probability {probs[token]:.4g}; the tokens "
                f"ranked above it add up to {mass_above:.6g}"
            )
            if p >= 1.0 or rank == 1:
                must_keep.add(token)
                why[token] = reason + (", p = 1 keeps all" if p >= 1.0 else ", always kept")
            elif mass_above == p or mass_above > p + BOUNDARY_TOLERANCE:
                must_drop.add(token)
                why[token] = reason + f" >= p={p:.6g}: p is already reached"
            elif mass_above < p - BOUNDARY_TOLERANCE:
                must_keep.add(token)
                why[token] = reason + f" < p={p:.6g}: still needed"
            else:
                why[token] = reason + f", within rounding of p={p:.6g}: either way"
            mass_above += probs[token]
        _check_filtered_row(got, logits, must_keep, must_drop, f"p={p:.6g}", why)

        # The kept tokens must be a prefix of the likelihood order, even in the uncertain band.
        order = _likelihood_order(logits)
        kept = {i for i, v in enumerate(got) if v != -math.inf}
        assert kept == set(order[: len(kept)]), (
            f"kept tokens {sorted(kept)} are not the {len(kept)} most likely ones "
            f"{sorted(order[: len(kept)])} (likelihood order, ties by token id: {order}); "
            f"logits={_show(logits)}, p={p:.6g}"
        )

    property_()


# --- min-p ---


def _our_min_p():
    from minivllm.sample.sampler import apply_min_p

    return _on_one_row(apply_min_p)


@learning_check(
    "ch01b.min_p",
    signature="min_p(logits: Tensor[vocab], min_p: float) -> Tensor[vocab]  (0 <= min_p <= 1; "
    "a token whose probability is below min_p times the largest probability becomes -inf; "
    "the others keep their logit)",
    reference=_our_min_p,
)
def check_min_p(min_p) -> None:
    """Token i is kept exactly when p_i >= min_p * max_j p_j: the threshold scales with the
    most likely token's probability, so the most likely token (and any tie with it) always
    stays, and min_p = 0 keeps every token."""

    @check_settings(max_examples=150)
    @given(
        logits=_logit_rows(),
        min_p_value=st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.1, 0.5, 1.0])),
    )
    def property_(logits, min_p_value):
        vocab_size = len(logits)
        got = _as_row(min_p(torch.tensor(logits), min_p_value), vocab_size)

        probs = _softmax(logits)
        top_prob = max(probs)
        threshold = min_p_value * top_prob
        must_keep, must_drop, why = set(), set(), {}
        for token, (x, prob) in enumerate(zip(logits, probs)):
            reason = (
                f"probability {prob:.4g}; threshold = min_p * largest probability = "
                f"{min_p_value:.4g} * {top_prob:.4g} = {threshold:.4g}"
            )
            if (
                min_p_value == 0.0
                or x == max(logits)
                or prob >= threshold + BOUNDARY_TOLERANCE * top_prob
            ):
                must_keep.add(token)
                why[token] = reason + ", at or above it: kept"
            elif prob < threshold - BOUNDARY_TOLERANCE * top_prob:
                must_drop.add(token)
                why[token] = reason + ", below it: removed"
            else:
                why[token] = reason + ", within rounding of it: either way"
        _check_filtered_row(got, logits, must_keep, must_drop, f"min_p={min_p_value:.4g}", why)

    property_()


# --- penalties ---


def _our_penalties():
    from minivllm.sample.sampler import apply_penalties

    def penalties(
        logits: torch.Tensor,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        repetition_penalty: float,
        presence_penalty: float,
        frequency_penalty: float,
    ) -> torch.Tensor:
        return apply_penalties(
            logits.unsqueeze(0),
            [list(prompt_token_ids)],
            [list(output_token_ids)],
            torch.tensor([repetition_penalty]),
            torch.tensor([frequency_penalty]),
            torch.tensor([presence_penalty]),
        )[0]

    return penalties


@learning_check(
    "ch01b.penalties",
    signature="penalties(logits: Tensor[vocab], prompt_token_ids: list[int], "
    "output_token_ids: list[int], repetition_penalty: float, presence_penalty: float, "
    "frequency_penalty: float) -> Tensor[vocab]  (vLLM's three penalties: repetition on "
    "tokens seen in prompt or output, then presence and frequency on output tokens)",
    reference=_our_penalties,
)
def check_penalties(penalties) -> None:
    """Token by token, as vLLM defines them: a token seen in the prompt or the output has its
    logit divided by repetition_penalty when positive and multiplied by it otherwise (either
    way it becomes less likely for r > 1); then every token loses frequency_penalty times its
    count in the output, and presence_penalty once if it occurs in the output at all."""

    @check_settings(max_examples=150)
    @given(
        logits=_logit_rows(max_vocab=8),
        # Round values first, so that a failure shrinks to numbers one can check by hand.
        repetition_penalty=st.one_of(st.sampled_from([2.0, 1.0]), st.floats(0.1, 3.0)),
        presence_penalty=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-2.0, 2.0)),
        frequency_penalty=st.one_of(st.sampled_from([0.0, 0.5]), st.floats(-2.0, 2.0)),
        data=st.data(),
    )
    def property_(logits, repetition_penalty, presence_penalty, frequency_penalty, data):
        vocab_size = len(logits)
        history = st.lists(st.integers(0, vocab_size - 1), max_size=8)
        prompt = data.draw(history, label="prompt_token_ids")
        output = data.draw(history, label="output_token_ids")
        got = _as_row(
            penalties(
                torch.tensor(logits),
                list(prompt),
                list(output),
                repetition_penalty,
                presence_penalty,
                frequency_penalty,
            ),
            vocab_size,
        )

        for token, x in enumerate(logits):
            steps = [f"logit {x:.4g}"]
            expected = x
            if token in prompt or token in output:
                where = "prompt" if token in prompt else "output"
                if expected > 0:
                    expected = expected / repetition_penalty
                    steps.append(f"seen in the {where}, positive: / {repetition_penalty:.4g}")
                else:
                    expected = expected * repetition_penalty
                    steps.append(f"seen in the {where}, not positive: * {repetition_penalty:.4g}")
            count = output.count(token)
            if count:
                expected -= frequency_penalty * count + presence_penalty
                steps.append(
                    f"{count} time(s) in the output: - {frequency_penalty:.4g} * {count} "
                    f"- {presence_penalty:.4g}"
                )
            if not abs(got[token] - expected) <= 1e-4 + 1e-5 * abs(expected):
                raise AssertionError(
                    f"token {token}: expected {expected:.6g} ({'; '.join(steps)}), "
                    f"got {got[token]:.6g}; logits={_show(logits)}, prompt_token_ids={prompt}, "
                    f"output_token_ids={output}, repetition_penalty={repetition_penalty:.4g}, "
                    f"presence_penalty={presence_penalty:.4g}, "
                    f"frequency_penalty={frequency_penalty:.4g}"
                )

    property_()
