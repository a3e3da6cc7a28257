"""Properties of the shared sampler (minivllm/sampling.py).

Every expectation here is worked out from the definition with plain Python (sorted lists, math.exp,
list.count) in float64, never by calling the code under test a second time. Float32 code and a
float64 reference can disagree about a token sitting exactly on a threshold, so the top-p, min-p
and support checks allow a small tolerance at the boundary and are exact everywhere else.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.sample.sampler import (
    NOTHING_TO_SAMPLE,
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_generator,
    prompt_token_logprobs,
)
from minivllm.sample.sampling_params import SamplingParams, StructuredOutputsParams

# One settings object for this module's properties (a profile loaded here would replace the
# session's profile for every module collected after this one).
SAMPLING_SETTINGS = settings(max_examples=40, deadline=None)

BOUNDARY_TOLERANCE = 1e-5

# Arbitrary float32 logits, mixed with a few round values so that ties turn up often.
any_logit = st.one_of(
    st.floats(-8, 8, width=32, allow_nan=False),
    st.sampled_from([-1.0, 0.0, 1.0, 2.0]),
)
# Logits on a 0.25 grid: exact in float32 and far enough apart that log_softmax cannot merge
# two different logits into one value, which keeps rank comparisons exact.
grid_logit = st.integers(-32, 32).map(lambda quarter: quarter / 4)


@st.composite
def logit_batches(draw, values=any_logit, max_rows: int = 4, max_vocab: int = 12):
    """A [rows, vocab] batch of logits as nested Python lists."""
    num_rows = draw(st.integers(1, max_rows))
    vocab_size = draw(st.integers(1, max_vocab))
    row = st.lists(values, min_size=vocab_size, max_size=vocab_size)
    return draw(st.lists(row, min_size=num_rows, max_size=num_rows))


def per_row(data, batch, strategy) -> list:
    return data.draw(st.lists(strategy, min_size=len(batch), max_size=len(batch)))


def kept_token_ids(row: torch.Tensor) -> set[int]:
    return {i for i, value in enumerate(row.tolist()) if value != -math.inf}


def softmax(logits: list[float]) -> list[float]:
    largest = max(logits)
    weights = [math.exp(x - largest) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def log_softmax(logits: list[float]) -> list[float]:
    largest = max(logits)
    log_total = largest + math.log(sum(math.exp(x - largest) for x in logits))
    return [x - log_total for x in logits]


def likelihood_order(logits: list[float]) -> list[int]:
    """Token ids from most to least likely; equal logits go by token id."""
    return sorted(range(len(logits)), key=lambda i: (-logits[i], i))


def first_argmax(logits: list[float]) -> int:
    return max(range(len(logits)), key=lambda i: (logits[i], -i))


def sampling_row(params: SamplingParams, output=(), prompt=(), generator=None, eos=()):
    return SamplingRow(
        params=params,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        generator=generator,
        eos_token_ids=tuple(eos),
    )


# --- top-k, top-p, min-p on their own ---


@SAMPLING_SETTINGS
@given(batch=logit_batches(), data=st.data())
def test_top_k_keeps_exactly_the_tokens_with_fewer_than_k_strictly_larger_logits(batch, data):
    """Top-k keeps the k largest logits; a tie at the k-th value keeps every tied token.

    So a token survives exactly when fewer than k tokens beat it outright. k = 0 (off) or k at
    least the vocabulary size keeps everything. Survivors keep their logit unchanged.
    """
    vocab_size = len(batch[0])
    ks = per_row(data, batch, st.integers(0, vocab_size + 2))
    logits = torch.tensor(batch)

    filtered = apply_top_k(logits, torch.tensor(ks))

    for row_logits, k, filtered_row in zip(batch, ks, filtered, strict=True):
        if k == 0 or k >= vocab_size:
            expected = set(range(vocab_size))
        else:
            expected = {i for i, x in enumerate(row_logits) if sum(y > x for y in row_logits) < k}
        assert kept_token_ids(filtered_row) == expected
        for i in expected:
            assert filtered_row[i].item() == torch.tensor(row_logits[i]).item()


@SAMPLING_SETTINGS
@given(batch=logit_batches(), data=st.data())
def test_top_p_keeps_the_smallest_likely_prefix_reaching_p(batch, data):
    """Top-p keeps a prefix of the tokens sorted by likelihood (ties by token id).

    The prefix's probability reaches p, and it would fall short of p without its last token.
    It never keeps fewer than one token, and p = 1 keeps everything.
    """
    ps = per_row(data, batch, st.floats(0.0, 1.0, exclude_min=True))
    filtered = apply_top_p(torch.tensor(batch), torch.tensor(ps))

    for row_logits, p, filtered_row in zip(batch, ps, filtered, strict=True):
        kept = kept_token_ids(filtered_row)
        if p == 1.0:
            assert kept == set(range(len(row_logits)))
            continue
        order = likelihood_order(row_logits)
        probs = softmax(row_logits)
        prefix = order[: len(kept)]
        assert kept == set(prefix), "top-p must keep the most likely tokens first"
        assert sum(probs[i] for i in prefix) >= p - BOUNDARY_TOLERANCE
        if len(prefix) > 1:
            assert sum(probs[i] for i in prefix[:-1]) < p + BOUNDARY_TOLERANCE


@pytest.mark.parametrize(
    ("logits", "p", "expected"),
    [
        ([0.0, 0.0], 0.5, {0}),  # token 0 alone reaches 0.5 exactly, so token 1 is not needed
        ([0.0, 0.0, 0.0, 0.0], 0.5, {0, 1}),
        ([0.0, 0.0, 0.0, 0.0], 0.51, {0, 1, 2}),
        ([5.0, 0.0, 0.0], 0.01, {0}),  # the most likely token always stays
    ],
)
def test_top_p_on_exact_boundaries(logits, p, expected):
    """Equal logits give exactly representable probabilities, so p can sit right on the edge."""
    filtered = apply_top_p(torch.tensor([logits]), torch.tensor([p]))
    assert kept_token_ids(filtered[0]) == expected


def test_top_p_of_one_keeps_even_tokens_a_float_sum_rounds_away():
    """p = 1 keeps every token: token 1's probability (9e-14) is lost in float32's cumulative
    sum, which reaches 1.0 at token 0, so a p = 1 row that went through the filter would drop
    it."""
    filtered = apply_top_p(torch.tensor([[0.0, -30.0], [0.0, 0.0]]), torch.tensor([1.0, 1.0]))
    assert kept_token_ids(filtered[0]) == {0, 1}
    assert kept_token_ids(filtered[1]) == {0, 1}


def test_top_p_ranks_equal_logits_by_token_id():
    """100 equal logits, p = 0.505: the 51 lowest token ids, one prefix of the id order (a sort
    that does not keep equal values in order picks another 51)."""
    filtered = apply_top_p(torch.zeros(1, 100), torch.tensor([0.505]))
    assert kept_token_ids(filtered[0]) == set(range(51))


@SAMPLING_SETTINGS
@given(batch=logit_batches(), data=st.data())
def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability(batch, data):
    """Min-p keeps token i exactly when p_i >= min_p * max_j p_j (the top token always stays)."""
    min_ps = per_row(data, batch, st.floats(0.0, 1.0))
    filtered = apply_min_p(torch.tensor(batch), torch.tensor(min_ps))

    for row_logits, min_p, filtered_row in zip(batch, min_ps, filtered, strict=True):
        kept = kept_token_ids(filtered_row)
        probs = softmax(row_logits)
        threshold = min_p * max(probs)
        assert first_argmax(row_logits) in kept
        for i, prob in enumerate(probs):
            if prob >= threshold * (1 + BOUNDARY_TOLERANCE):
                assert i in kept
            elif prob < threshold * (1 - BOUNDARY_TOLERANCE):
                assert i not in kept


# --- the full sampler ---


def reference_support(logits: list[float], params: SamplingParams, slack: float = 1e-4) -> set[int]:
    """Tokens the sampler may draw, from the definitions.

    Temperature scales the logits first; then top-k, top-p and min-p each remove tokens, the
    later filters seeing the distribution renormalised over what the earlier ones kept. A
    positive `slack` counts tokens within `slack` of a threshold (or of a tie) as kept: the
    tokens the sampler *may* draw. A negative one counts them as removed: the tokens it *must*
    keep. (Each filter keeps more when the one before it kept more, so both bounds are sound.)
    """
    scaled = [x / params.temperature for x in logits]

    def above(j: int, i: int) -> bool:
        return j != i and scaled[j] - scaled[i] > slack

    alive = set(range(len(logits)))
    if 0 < params.top_k < len(logits):
        alive = {i for i in alive if sum(above(j, i) for j in alive) < params.top_k}
    if params.top_p < 1.0 and alive:
        probs = dict(zip(alive, softmax([scaled[i] for i in alive]), strict=True))
        alive = {
            i for i in alive if sum(probs[j] for j in alive if above(j, i)) < params.top_p + slack
        }
    if not alive:  # only when near-ties count as removed: nothing is certain then
        return alive
    top = max(scaled[i] for i in alive)
    return {i for i in alive if math.exp(scaled[i] - top) >= params.min_p - slack}


@SAMPLING_SETTINGS
@given(
    logits=st.lists(any_logit, min_size=2, max_size=10),
    temperature=st.floats(0.1, 2.0),
    top_k=st.integers(0, 10),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.5),
)
def test_sampled_tokens_always_lie_in_the_kept_support(logits, temperature, top_k, top_p, min_p):
    """Whatever the knobs, 200 draws never produce a token that top-k/top-p/min-p removed."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    draws = 200
    batch = torch.tensor([logits] * draws)

    tokens = Sampler(make_generator(0))(batch, [sampling_row(params)] * draws).token_ids

    assert set(tokens) <= reference_support(logits, params)


# Probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04: no filter below lands on a boundary.
HAND_PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]


@pytest.mark.parametrize(
    ("knobs", "expected_support"),
    [
        ({}, {0, 1, 2, 3, 4, 5}),
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1, 2}),  # 0.4 + 0.25 = 0.65 < 0.7, so token 2 is needed
        ({"top_p": 0.6}, {0, 1}),
        ({"min_p": 0.3}, {0, 1, 2}),  # threshold 0.12
        ({"top_k": 4, "top_p": 0.8}, {0, 1, 2}),  # renormalised over 0.9: 0.44, 0.28, 0.17
        ({"top_k": 4, "min_p": 0.5}, {0, 1}),  # threshold 0.2
    ],
)
def test_sampled_tokens_cover_exactly_the_hand_computed_support(knobs, expected_support):
    """On a hand-worked example every kept token shows up in 3000 draws and nothing else does."""
    params = SamplingParams(**knobs)
    draws = 3000
    batch = torch.tensor([[math.log(p) for p in HAND_PROBS]] * draws)

    tokens = Sampler(make_generator(1))(batch, [sampling_row(params)] * draws).token_ids

    assert set(tokens) == expected_support


# Temperature comes first: it reshapes the distribution that top-p and min-p then cut, so at
# T != 1 the kept set differs from the one at T = 1. HAND_PROBS ** (1 / T), renormalised:
#   T = 2:   0.277, 0.219, 0.170, 0.139, 0.107, 0.088  (cumulative 0.277, 0.496, 0.666, 0.805)
#            ratio to the top: 1, 0.79, 0.61, 0.50, 0.39, 0.32
#   T = 0.5: 0.615, 0.240, 0.086, 0.038, 0.014, 0.006  (cumulative 0.615, 0.855)
#            ratio to the top: 1, 0.39, 0.14, 0.06, 0.02, 0.01
#   T = 2 over the 5 best: 0.304, 0.240, 0.186, 0.152, 0.118  (cumulative 0.304, 0.544, 0.730)
# Each case names the set T = 1 would keep, which a sampler cutting before it scales gives.
@pytest.mark.parametrize(
    ("knobs", "expected_support"),
    [
        # 0.666 < 0.7, so token 3 is needed (at T = 1: 0.4 + 0.25 + 0.15 = 0.8, {0, 1, 2})
        ({"temperature": 2.0, "top_p": 0.7}, {0, 1, 2, 3}),
        # 0.615 < 0.7 <= 0.855 (at T = 1: {0, 1, 2})
        ({"temperature": 0.5, "top_p": 0.7}, {0, 1}),
        # ratios 0.50 >= 0.45 > 0.39 (at T = 1 the ratios are 1, 0.625, 0.375: {0, 1})
        ({"temperature": 2.0, "min_p": 0.45}, {0, 1, 2, 3}),
        # ratios 0.39 >= 0.3 > 0.14 (at T = 1 the threshold is 0.12: {0, 1, 2})
        ({"temperature": 0.5, "min_p": 0.3}, {0, 1}),
        # over the 5 best, 0.730 < 0.75 (at T = 1: 0.417, 0.677, 0.833: {0, 1, 2})
        ({"temperature": 2.0, "top_k": 5, "top_p": 0.75}, {0, 1, 2, 3}),
        # top-k before top-p: over the 3 best, 0.5 < 0.75 <= 0.8125; top-p first would need
        # 0.4 + 0.25 + 0.15 of the full distribution and keep {0, 1, 2}
        ({"top_k": 3, "top_p": 0.75}, {0, 1}),
    ],
)
def test_temperature_scales_the_logits_before_top_k_top_p_and_min_p(knobs, expected_support):
    """The pipeline order, temperature -> top-k -> top-p -> min-p, on hand-worked supports at
    T = 2 and T = 0.5: every kept token shows up in 3000 draws and nothing else does."""
    params = SamplingParams(**knobs)
    draws = 3000
    batch = torch.tensor([[math.log(p) for p in HAND_PROBS]] * draws)

    tokens = Sampler(make_generator(8))(batch, [sampling_row(params)] * draws).token_ids

    assert set(tokens) == expected_support, (
        f"{knobs}: drew {sorted(set(tokens))}, the hand-worked support is "
        f"{sorted(expected_support)}"
    )


@SAMPLING_SETTINGS
@given(
    logits=st.lists(st.integers(-12, 12).map(lambda quarter: quarter / 4), min_size=2, max_size=8),
    temperature=st.sampled_from([0.25, 0.5, 0.8, 1.5, 2.0, 4.0]),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.6),
)
def test_drawn_tokens_are_exactly_the_reference_support_at_any_temperature(
    logits, temperature, top_k, top_p, min_p
):
    """1000 draws never leave the support the definitions allow, and every token the definitions
    must keep, at probability 2% or more, is drawn (a miss has probability below 2e-9).

    Unlike the subset test above, this sees a sampler that keeps too few tokens, e.g. one that
    cuts before it applies the temperature.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    draws = 1000
    batch = torch.tensor([logits] * draws)

    tokens = set(Sampler(make_generator(9))(batch, [sampling_row(params)] * draws).token_ids)

    may_keep = reference_support(logits, params, slack=1e-4)
    must_keep = reference_support(logits, params, slack=-1e-4)
    assert tokens <= may_keep, f"drew {sorted(tokens - may_keep)}, which the filters remove"
    # A lower bound on each kept token's probability: its share of everything that may be kept.
    scaled = [x / temperature for x in logits]
    weights = {i: math.exp(scaled[i] - max(scaled)) for i in may_keep}
    likely = {i for i in must_keep if weights[i] / sum(weights.values()) >= 0.02}
    assert likely <= tokens, f"never drew {sorted(likely - tokens)}, which the filters keep"


def chi_square(observed: list[int], expected_probs: list[float]) -> float:
    total = sum(observed)
    return sum(
        (count - total * prob) ** 2 / (total * prob)
        for count, prob in zip(observed, expected_probs, strict=True)
    )


def counts(tokens: list[int], vocab_size: int) -> list[int]:
    return [tokens.count(i) for i in range(vocab_size)]


STATS_LOGITS = [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]
# Chi-square with 7 degrees of freedom exceeds 40 with probability about 1e-6.
CHI_SQUARE_BOUND_7_DOF = 40.0


def test_temperature_one_draws_follow_the_softmax():
    """20000 batched draws at temperature 1 match softmax(logits) within a loose chi-square."""
    draws = 20_000
    params = SamplingParams(temperature=1.0)
    batch = torch.tensor([STATS_LOGITS] * draws)

    tokens = Sampler(make_generator(2))(batch, [sampling_row(params)] * draws).token_ids

    observed = counts(tokens, len(STATS_LOGITS))
    assert chi_square(observed, softmax(STATS_LOGITS)) < CHI_SQUARE_BOUND_7_DOF


def test_seeded_draws_step_by_step_follow_the_softmax():
    """A seeded request drawing one token per step also follows the softmax over 3000 steps."""
    steps = 3000
    params = SamplingParams(temperature=1.0, seed=3)
    generator = make_generator(3)
    sampler = Sampler()
    logits = torch.tensor([STATS_LOGITS])

    tokens = [
        sampler(logits, [sampling_row(params, generator=generator)]).token_ids[0]
        for _ in range(steps)
    ]

    observed = counts(tokens, len(STATS_LOGITS))
    assert chi_square(observed, softmax(STATS_LOGITS)) < CHI_SQUARE_BOUND_7_DOF


def test_temperature_and_top_k_draws_follow_the_renormalised_softmax():
    """At temperature 0.5 with top_k=4, draws follow softmax(2 * logits) over the 4 best tokens."""
    draws = 20_000
    params = SamplingParams(temperature=0.5, top_k=4)
    batch = torch.tensor([STATS_LOGITS] * draws)

    tokens = Sampler(make_generator(4))(batch, [sampling_row(params)] * draws).token_ids

    best_four = likelihood_order(STATS_LOGITS)[:4]
    expected = softmax([STATS_LOGITS[i] / 0.5 for i in best_four])
    assert set(tokens) == set(best_four)
    # Chi-square with 3 degrees of freedom exceeds 30 with probability about 1e-6.
    assert chi_square([tokens.count(i) for i in best_four], expected) < 30.0


# --- seeded requests are reproducible whatever their batch ---

VOCAB = 50
STEPS = 12


def model_logits(seed: int) -> torch.Tensor:
    """A stand-in model: a fixed [STEPS, VOCAB] table of logits for one request."""
    return 3 * torch.randn(STEPS, VOCAB, generator=make_generator(seed))


def generate(requests: list[tuple[SamplingParams, torch.Tensor]], default_seed: int):
    """Decode every request together for STEPS steps; return each request's tokens."""
    generators = [None if p.seed is None else make_generator(p.seed) for p, _ in requests]
    outputs: list[list[int]] = [[] for _ in requests]
    sampler = Sampler(make_generator(default_seed))
    for step in range(STEPS):
        logits = torch.stack([table[step] for _, table in requests])
        rows = [
            sampling_row(params, output=output, prompt=[1, 2, 3], generator=generator)
            for (params, _), output, generator in zip(requests, outputs, generators, strict=True)
        ]
        for output, token in zip(outputs, sampler(logits, rows).token_ids, strict=True):
            output.append(token)
    return outputs


SEEDED = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.1, seed=1234)


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch():
    """The seeded request's tokens depend on its seed alone, not on its neighbours or row index.

    Its neighbours include another seeded request, unseeded ones (which use the sampler's default
    generator) and a greedy one, and the default generator's seed changes between runs.
    """
    request = (SEEDED, model_logits(0))
    neighbours = [
        (SamplingParams(temperature=0.8), model_logits(1)),
        (SamplingParams(temperature=1.2, top_k=5, seed=7), model_logits(2)),
        (SamplingParams(temperature=0.0), model_logits(3)),
        (SamplingParams(temperature=1.0, min_p=0.1), model_logits(4)),
    ]

    alone = generate([request], default_seed=0)[0]
    in_the_middle = generate([*neighbours[:2], request, *neighbours[2:]], default_seed=99)[2]
    at_the_end = generate([*neighbours, request], default_seed=5)[4]

    assert alone == in_the_middle == at_the_end


def test_unseeded_rows_draw_from_the_samplers_generator_or_else_torchs():
    """Without a generator of its own the sampler draws from torch's global one (its seed
    decides the tokens); with one, torch's seed plays no part. Each row gets its own noise:
    identical uniform rows do not all draw the same token, nor does one row always."""
    logits = torch.zeros(64, 8)
    rows = [sampling_row(SamplingParams())] * 64
    tokens = []
    for global_seed in (1, 1):
        torch.manual_seed(global_seed)
        tokens.append(Sampler()(logits, rows).token_ids)
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0])) > 1
    assert len({Sampler()(logits[:1], rows[:1]).token_ids[0] for _ in range(30)}) > 1
    own = []
    for global_seed in (2, 4):
        torch.manual_seed(global_seed)
        own.append(Sampler(make_generator(3))(logits, rows).token_ids)
    assert own[0] == own[1]


def test_the_seed_decides_the_tokens():
    """A sanity check for the test above: a different seed does give a different sequence."""
    logits = model_logits(0)
    reseeded = dataclasses.replace(SEEDED, seed=4321)

    assert generate([(SEEDED, logits)], 0) != generate([(reseeded, logits)], 0)


# --- penalties ---


def reference_penalised(logits, prompt, output, repetition, frequency, presence) -> list[float]:
    """vLLM's penalty definitions, token by token."""
    result = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / repetition if x > 0 else x * repetition
        x -= frequency * output.count(token)
        x -= presence * (token in output)
        result.append(x)
    return result


def test_penalties_on_a_hand_worked_example():
    """Prompt [0, 1], output [3, 3, 4], repetition 2, frequency 0.5, presence 0.25.

    token 0: seen in prompt, positive: 2 / 2 = 1.
    token 1: seen in prompt, negative: -1 * 2 = -2.
    token 2: never seen: 0.5.
    token 3: 3 / 2 - 0.5 * 2 - 0.25 = 0.25.
    token 4: -2 * 2 - 0.5 * 1 - 0.25 = -4.75.
    """
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])

    penalised = apply_penalties(
        logits,
        [[0, 1]],
        [[3, 3, 4]],
        torch.tensor([2.0]),
        torch.tensor([0.5]),
        torch.tensor([0.25]),
    )

    assert penalised.tolist() == [[1.0, -2.0, 0.5, 0.25, -4.75]]


@SAMPLING_SETTINGS
@given(batch=logit_batches(max_vocab=8), data=st.data())
def test_penalties_match_their_definitions(batch, data):
    """Random logits, histories and penalties agree with the token-by-token definition. A
    history may hold ids past the logits' vocabulary (a tokenizer's added tokens): they have no
    logit to penalise, and must not count for the next row's tokens either."""
    vocab_size = len(batch[0])
    history = st.lists(st.integers(0, vocab_size + 2), max_size=10)
    prompts = per_row(data, batch, history)
    outputs = per_row(data, batch, history)
    repetition = per_row(data, batch, st.floats(0.1, 3.0))
    frequency = per_row(data, batch, st.floats(-2.0, 2.0))
    presence = per_row(data, batch, st.floats(-2.0, 2.0))

    penalised = apply_penalties(
        torch.tensor(batch),
        prompts,
        outputs,
        torch.tensor(repetition),
        torch.tensor(frequency),
        torch.tensor(presence),
    )

    for row in range(len(batch)):
        expected = reference_penalised(
            batch[row], prompts[row], outputs[row], repetition[row], frequency[row], presence[row]
        )
        assert penalised[row].tolist() == pytest.approx(expected, abs=1e-4)


def test_the_sampler_applies_penalties_before_choosing():
    """A repetition penalty turns greedy away from a token it has already produced (and the
    processed logprobs report the penalised distribution)."""
    logits = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.5, 0.0]])
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=1)

    result = Sampler(logprobs_mode="processed_logprobs")(
        logits, [sampling_row(plain, output=[0]), sampling_row(penalised, output=[0])]
    )

    assert result.token_ids == [0, 1]  # the penalised row sees [1.0, 1.5, 0.0]
    assert result.logprobs[1].sampled_logprob == pytest.approx(log_softmax([1.0, 1.5, 0.0])[1])


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_a_frequency_or_presence_penalty_alone_turns_greedy_away(penalty):
    """Either penalty on its own (here 1.0) is applied: token 0, produced once, drops from 2.5
    to 1.5, below token 1."""
    params = SamplingParams(temperature=0.0, **{penalty: 1.0})
    row = sampling_row(params, output=[0])
    assert Sampler()(torch.tensor([[2.5, 2.0, 0.0]]), [row]).token_ids == [1]


def test_a_row_with_nothing_to_sample_is_reported_and_its_neighbours_are_not():
    """A row whose every logit is -inf (a grammar and a ban left nothing) gets the error its
    request ends with; the rows beside it sample as usual."""
    inf = math.inf
    logits = torch.tensor([[1.0, 2.0, 0.0], [-inf, -inf, -inf], [3.0, -inf, 0.0]])
    rows = [sampling_row(SamplingParams(temperature=0.0))] * 3

    output = Sampler()(logits, rows)

    assert output.errors == [None, NOTHING_TO_SAMPLE, None]
    assert (output.token_ids[0], output.token_ids[2]) == (1, 0)


def test_logits_that_are_not_one_row_per_request_are_refused():
    row = sampling_row(SamplingParams(temperature=0.0))
    for logits, rows in ((torch.zeros(3, 4), [row] * 2), (torch.zeros(4), [row] * 4)):
        with pytest.raises(ValueError) as raised:
            Sampler()(logits, rows)
        assert str(raised.value) == (
            f"logits must be [len(rows), vocab] = [{len(rows)}, vocab], got {list(logits.shape)}"
        )


# --- min_tokens ---

EOS, STOP_ID = 0, 1


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_and_stop_ids_until_reached_and_not_after(ignore_eos):
    """Until min_tokens tokens exist, eos and stop ids cannot be chosen; from then on they can.

    Eos and the stop id have the two largest logits, so greedy picks them the moment it may.
    A neighbour row without min_tokens is unaffected. The ban holds under ignore_eos as well.
    """
    logits = torch.tensor([[10.0, 9.0, 1.0, 2.0, 0.5]] * 2)
    waiting = SamplingParams(
        temperature=0.0, min_tokens=3, stop_token_ids=[STOP_ID], ignore_eos=ignore_eos
    )
    free = SamplingParams(temperature=0.0)
    sampler = Sampler()

    for generated in range(5):
        output = [3] * generated
        rows = [
            sampling_row(waiting, output=output, eos=[EOS]),
            sampling_row(free, output=output, eos=[EOS]),
        ]
        waiting_token, free_token = sampler(logits, rows).token_ids
        assert waiting_token == (3 if generated < 3 else EOS)
        assert free_token == EOS


def test_the_min_tokens_ban_gives_way_row_by_row_where_nothing_else_is_left():
    """Row 0: a complete grammar allows only eos, so the ban would leave nothing to sample and
    eos stays; row 1, beside it: the ban holds and the runner-up is chosen."""
    inf = math.inf
    logits = torch.tensor([[0.0, -inf, -inf, -inf, -inf], [5.0, 4.0, 1.0, 0.5, -inf]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[STOP_ID])
    rows = [sampling_row(params, eos=[EOS])] * 2

    output = Sampler()(logits, rows)

    assert output.token_ids == [EOS, 2]  # eos, and 2 after eos and the stop id in row 1
    assert output.errors == [None, None]


def test_min_tokens_also_bans_stop_ids_for_random_sampling():
    """With eos and the stop id nearly certain, 2000 random draws still avoid them all."""
    draws = 2000
    logits = torch.tensor([[10.0, 10.0, 1.0, 2.0, 0.5]] * draws)
    params = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[STOP_ID])
    rows = [sampling_row(params, eos=[EOS])] * draws

    tokens = Sampler(make_generator(5))(logits, rows).token_ids

    assert set(tokens) == {2, 3, 4}


# --- greedy and logprobs ---


@SAMPLING_SETTINGS
@given(batch=logit_batches(), data=st.data())
def test_greedy_rows_take_the_argmax_even_beside_random_rows(batch, data):
    """Temperature 0 (or below vLLM's 1e-5 threshold) is argmax, first index on ties."""
    temperatures = per_row(data, batch, st.sampled_from([0.0, 1e-6, 1.0]))
    rows = [sampling_row(SamplingParams(temperature=t)) for t in temperatures]

    tokens = Sampler(make_generator(6))(torch.tensor(batch), rows).token_ids

    for row_logits, temperature, token in zip(batch, temperatures, tokens, strict=True):
        if temperature < 1e-5:
            assert token == first_argmax(row_logits)


@SAMPLING_SETTINGS
@given(batch=logit_batches(values=grid_logit), data=st.data())
def test_logprobs_report_the_log_softmax_around_the_sampled_token(batch, data):
    """Logprobs are log_softmax of the logits (before temperature), for greedy and random rows.

    The top list has the requested length, is sorted best first and holds the most likely
    tokens; the sampled token's rank is 1 plus the number of tokens strictly more likely.
    """
    vocab_size = len(batch[0])
    counts_wanted = per_row(data, batch, st.one_of(st.none(), st.integers(0, vocab_size)))
    temperatures = per_row(data, batch, st.sampled_from([0.0, 0.7]))
    rows = [
        sampling_row(SamplingParams(temperature=t, logprobs=k))
        for t, k in zip(temperatures, counts_wanted, strict=True)
    ]

    result = Sampler(make_generator(7))(torch.tensor(batch), rows)

    for row_logits, wanted, token, logprobs in zip(
        batch, counts_wanted, result.token_ids, result.logprobs, strict=True
    ):
        if wanted is None:
            assert logprobs is None
            continue
        reference = log_softmax(row_logits)
        assert logprobs.sampled_token_id == token
        assert logprobs.sampled_logprob == pytest.approx(reference[token], abs=1e-5)
        assert logprobs.sampled_rank == 1 + sum(x > row_logits[token] for x in row_logits)

        top_ids = [token_id for token_id, _ in logprobs.top]
        top_values = [value for _, value in logprobs.top]
        assert len(logprobs.top) == wanted
        assert len(set(top_ids)) == wanted
        assert top_values == sorted(top_values, reverse=True)
        for token_id, value in logprobs.top:
            assert value == pytest.approx(reference[token_id], abs=1e-5)
        if wanted:
            left_out = [row_logits[i] for i in range(vocab_size) if i not in top_ids]
            assert all(x <= min(row_logits[i] for i in top_ids) for x in left_out)


def test_asking_for_more_logprobs_than_the_vocabulary_returns_the_whole_vocabulary():
    """The top list is capped at the vocabulary size."""
    params = SamplingParams(temperature=0.0, logprobs=10)

    result = Sampler()(torch.tensor([[0.0, 1.0, 2.0]]), [sampling_row(params)])

    assert [token_id for token_id, _ in result.logprobs[0].top] == [2, 1, 0]


def test_the_sampler_leaves_its_input_alone_and_accepts_low_precision_logits():
    """Logits are read, never written, and bfloat16 logits are sampled in float32."""
    logits = torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.bfloat16)
    before = logits.clone()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, min_tokens=1, logprobs=1)

    result = Sampler()(logits, [sampling_row(params, output=[], prompt=[1], eos=[2])])

    assert torch.equal(logits, before)
    assert result.token_ids == [1]  # token 1: 3 / 1.5 = 2, token 2 banned, token 0: 1


def test_nan_and_inf_logits_never_decide_a_token():
    """NaN counts as -inf; in a row with +inf logits those tokens share all the mass (logit 0,
    the others -inf) and the row beside it is left as it was; a token that came in at -inf
    stays there even where a repetition penalty of 5e-324 (0 in float32) turns -inf * 0 into
    NaN, and a positive logit / 0 into +inf, a sure token."""
    inf, nan = math.inf, math.nan
    logits = torch.tensor([[nan, 1.0, 0.0], [inf, 1.0, inf], [2.0, 1.0, 0.0]])
    greedy = sampling_row(SamplingParams(temperature=0.0, logprobs=3))
    processed_logits = Sampler(logprobs_mode="processed_logits")

    output = processed_logits(logits, [greedy] * 3)

    assert output.token_ids == [1, 0, 0]
    assert [dict(logprobs.top) for logprobs in output.logprobs] == [
        {1: 1.0, 2: 0.0, 0: -inf},
        {0: 0.0, 2: 0.0, 1: -inf},
        {0: 2.0, 1: 1.0, 2: 0.0},
    ]
    random = sampling_row(SamplingParams(temperature=1.0))
    assert Sampler().probabilities(logits, [random] * 3)[1].tolist() == [0.5, 0.0, 0.5]

    zero_penalty = SamplingParams(temperature=0.0, repetition_penalty=5e-324, logprobs=3)
    row = sampling_row(zero_penalty, prompt=[0, 1])
    output = processed_logits(torch.tensor([[-inf, 1.0, 0.0]]), [row])
    assert output.token_ids == [1]
    assert dict(output.logprobs[0].top) == {1: 0.0, 0: -inf, 2: -inf}


def test_a_temperature_past_float32s_range_keeps_masked_tokens_out():
    """A temperature of 1e308 is a valid float but inf in float32, and -inf / inf is NaN: the
    grammar's masked tokens (-inf) would come back, and a NaN row samples token 0 (the server
    answered 500, "token 0 was emitted although the grammar forbids it"). Such a temperature
    means the uniform distribution over the tokens left, and only those."""
    inf = math.inf
    logits = torch.tensor([[-inf, 3.0, -inf, 1.0, -inf]] * 64)
    rows = [sampling_row(SamplingParams(temperature=1e308, seed=seed)) for seed in range(64)]

    output = Sampler().probabilities(logits[:1], rows[:1])
    tokens = Sampler()(logits, rows).token_ids

    assert output.tolist() == [[0.0, 0.5, 0.0, 0.5, 0.0]]
    assert set(tokens) == {1, 3}


@pytest.mark.parametrize("temperature", [0.0, 2e-5, 0.5, 1.0, 1e308])
def test_a_repetition_penalty_past_float32s_range_makes_seen_tokens_unlikely_not_impossible(
    temperature,
):
    """A repetition penalty of 6e307 is a valid float but inf in float32, and a negative logit
    times inf is -inf: where the grammar leaves only tokens already seen, every one of them
    went to -inf and the request failed with "no token can be sampled" (the server answered
    500). In exact arithmetic they are very unlikely, not impossible: each stays the lowest
    finite float32 (too low for float32 to tell them apart: they tie), so the row still
    samples one of them, and never a masked token; a positive logit / inf is 0 as before."""
    inf = math.inf
    logits = torch.tensor([[-inf, -3.0, -inf, -1.0, 2.0]])
    lowest = torch.finfo(torch.float32).min
    params = SamplingParams(temperature=temperature, repetition_penalty=6e307)
    seeded = [dataclasses.replace(params, seed=seed) for seed in range(32)]
    rows = [sampling_row(row_params, prompt=[1, 3]) for row_params in seeded]

    penalised = apply_penalties(logits, [[1, 3, 4]], [[]], *torch.tensor([[6e307], [0.0], [0.0]]))
    only_seen_left = logits[:, :4].expand(32, 4)
    output = Sampler()(only_seen_left, rows)

    assert penalised.tolist() == [[-inf, lowest, -inf, lowest, 0.0]]
    assert output.errors == [None] * 32
    assert set(output.token_ids) <= {1, 3}


def test_a_temperature_holds_finite_logits_inside_float32s_range():
    """Dividing by a temperature below 1 can push a finite logit past float32's range: as -inf
    a token could no longer be drawn (a row of seen tokens held at the lowest float32 by a huge
    repetition penalty went all -inf and drew masked token 0), as +inf the softmax is NaN (an
    offline logit_bias of 3e38 at T=0.5 drew masked token 0). Each is held at the range's end;
    -inf stays -inf."""
    inf, finfo = math.inf, torch.finfo(torch.float32)
    logits = torch.tensor([[-inf, -3e38, 3e38, 1.0], [-inf, -3e38, 3e38, 1.0]])

    scaled = apply_temperature(logits, torch.tensor([0.5, 1e308]))
    params = [SamplingParams(temperature=0.5, logit_bias={1: 3e38}, seed=seed) for seed in range(8)]
    tokens = Sampler()(torch.tensor([[-inf, 1.0, 2.0]] * 8), [sampling_row(p) for p in params])

    assert scaled[0].tolist() == [-inf, finfo.min, finfo.max, 2.0]
    assert scaled[1, 0] == -inf
    assert scaled[1, 1:].tolist() == pytest.approx([-3e38 / finfo.max, 3e38 / finfo.max, 0.0])
    assert tokens.token_ids == [1] * 8


# --- the distributions and logprobs chapter 08's verifier reads ---


def test_probabilities_are_the_distributions_the_rows_draw_from():
    """Greedy: one-hot at the argmax of the adjusted logits (here a repetition penalty moves
    it from token 0 to token 1); random: the softmax of the logits after temperature and
    top-k; a row with nothing to sample (its only tokens banned or -inf): no mass at all."""
    inf = math.inf
    logits = torch.tensor(
        [[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0], [-inf] * 4, [-inf] * 4, [0.0, 0.0, -inf, 1.0]]
    )
    rows = [
        sampling_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0]),
        sampling_row(SamplingParams(temperature=0.5, top_k=3)),  # logits 6, 4, 2 (and 0, cut)
        sampling_row(SamplingParams(temperature=0.0)),
        sampling_row(SamplingParams(temperature=1.0)),
        sampling_row(SamplingParams(temperature=1.0)),
    ]

    probs = Sampler().probabilities(logits, rows)

    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1].tolist() == pytest.approx(softmax([6.0, 4.0, 2.0]) + [0.0], abs=1e-6)
    assert probs[2].tolist() == probs[3].tolist() == [0.0] * 4
    assert probs[4].tolist() == pytest.approx(
        softmax([0.0, 0.0, 1.0])[:2] + [0.0] + softmax([0.0, 0.0, 1.0])[2:], abs=1e-6
    )
    # An all-greedy batch: one-hot rows, the min_tokens ban applied (eos 2 is the argmax).
    greedy = [sampling_row(SamplingParams(temperature=0.0, min_tokens=1), eos=[2])]
    assert Sampler().probabilities(torch.tensor([[1.0, 0.0, 5.0]]), greedy).tolist() == [
        [1.0, 0.0, 0.0]
    ]


def test_logprobs_of_given_tokens_are_those_the_sampler_would_report():
    """Sampler.logprobs scores tokens chosen elsewhere (the rejection sampler's): in the
    processed modes, from what each row would have drawn from (for a random row after
    temperature and top-k), in the raw ones from the model's logits; rank 1 is the best."""
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]] * 3)
    rows = [
        sampling_row(SamplingParams(temperature=0.5, top_k=2, logprobs=1)),
        sampling_row(SamplingParams(temperature=0.0, logit_bias={3: 5.0}, logprobs=0)),
        sampling_row(SamplingParams(temperature=0.0)),  # no logprobs asked for
    ]
    processed = Sampler(logprobs_mode="processed_logprobs").logprobs(logits, [1, 0, 2], rows)
    raw = Sampler().logprobs(logits, [1, 0, 2], rows)

    random_row = log_softmax([6.0, 4.0])  # the two tokens top-k keeps, after temperature 0.5
    assert processed[0].sampled_token_id == 1
    assert processed[0].sampled_logprob == pytest.approx(random_row[1], abs=1e-5)
    assert processed[0].sampled_rank == 2
    assert processed[0].top == [(0, pytest.approx(random_row[0], abs=1e-5))]
    biased = log_softmax([3.0, 2.0, 1.0, 4.0])
    assert processed[1].sampled_logprob == pytest.approx(biased[0], abs=1e-5)
    assert (processed[1].sampled_rank, processed[1].top) == (2, [])
    assert processed[2] is None and raw[2] is None
    model = log_softmax([3.0, 2.0, 1.0, -1.0])
    assert raw[0].sampled_logprob == pytest.approx(model[1], abs=1e-5)
    assert raw[1].sampled_logprob == pytest.approx(model[0], abs=1e-5)
    assert raw[1].sampled_rank == 1


def test_prompt_logprobs_score_each_next_prompt_token_under_the_model():
    """Row i of the logits scores prompt token i + 1: its log_softmax and rank, and the
    num_top best tokens (-1: the whole vocabulary, best first), from float32 whatever came in."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 1.0]], dtype=torch.bfloat16)

    scored = prompt_token_logprobs(logits, [2, 0], 1)

    first, second = log_softmax([1.0, 3.0, 2.0]), log_softmax([0.0, 0.0, 1.0])
    assert [t.sampled_token_id for t in scored] == [2, 0]
    assert [t.sampled_rank for t in scored] == [2, 2]  # equal scores share the better rank
    assert scored[0].sampled_logprob == pytest.approx(first[2], abs=1e-6)
    assert scored[1].sampled_logprob == pytest.approx(second[0], abs=1e-6)
    assert [t.top for t in scored] == [
        [(1, pytest.approx(first[1], abs=1e-6))],
        [(2, pytest.approx(second[2], abs=1e-6))],
    ]
    whole = prompt_token_logprobs(logits[:1], [0], -1)[0]
    assert [token_id for token_id, _ in whole.top] == [1, 2, 0]


# --- SamplingParams validation ---

INVALID_PARAMS = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("n", {"n": True}),
    ("temperature", {"temperature": -1.0}),
    ("temperature", {"temperature": "hot"}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 1.5}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.1}),
    ("seed", {"seed": 1.0}),
    ("seed", {"seed": "42"}),
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": -(2**63) - 1}),
    ("seed", {"seed": 2**64 - 1, "n": 2}),  # completion 1 would get seed 2**64
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": True}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("stop", {"stop": 3}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["fine", ""]}),
    ("stop", {"stop": ["fine", 3]}),
    ("stop_token_ids", {"stop_token_ids": ["a"]}),
    ("stop_token_ids", {"stop_token_ids": 5}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 2.0}),
    ("prompt_logprobs", {"prompt_logprobs": -2}),
    ("prompt_logprobs", {"prompt_logprobs": 1.0}),
    ("prompt_logprobs", {"prompt_logprobs": False}),
    ("logit_bias", {"logit_bias": [5, 1.0]}),
    ("logit_bias", {"logit_bias": {"5": 1.0}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {True: 1.0}}),
    ("logit_bias", {"logit_bias": {5: math.nan}}),
    ("logit_bias", {"logit_bias": {5: math.inf}}),
    ("logit_bias", {"logit_bias": {5: "high"}}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.1}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("frequency_penalty", {"frequency_penalty": 2.01}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("skip_special_tokens", {"skip_special_tokens": None}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": 1}),
    ("detokenize", {"detokenize": "no"}),
    ("stop", {"stop": ["###"], "detokenize": False}),  # a stop string is found in text
    ("structured_outputs", {"structured_outputs": {"json": {"type": "object"}}}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID_PARAMS)
def test_invalid_sampling_params_raise_value_error_naming_field_and_value(field, kwargs):
    """Each bad value is refused with a message that names the field and quotes the value."""
    with pytest.raises(ValueError) as raised:
        SamplingParams(**kwargs)

    message = str(raised.value)
    assert message.startswith(f"{field} must be ")
    assert repr(kwargs[field]) in message


def test_a_seed_out_of_range_is_refused_naming_the_range_its_n_allows():
    with pytest.raises(ValueError) as raised:
        SamplingParams(seed=2**64 - 2, n=3)
    assert str(raised.value) == (
        "seed must be an int from -2**63 to 2**64 - 3 (n=3), got 18446744073709551614"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens (4), got 5"),
        ({"top_k": -2}, "top_k must be -1 or >= 0 (-1 and 0 both disable top-k), got -2"),
        (
            {"logit_bias": {5: math.nan}},
            "logit_bias must be a dict of token ids to finite numbers, got {5: nan}",
        ),
        ({"detokenize": "no"}, "detokenize must be a bool, got 'no'"),
        (
            {"stop": ["###"], "detokenize": False},
            "stop must be empty when detokenize is False (stop strings need text), got ['###']",
        ),
        (
            {"structured_outputs": {"regex": "a+"}},
            "structured_outputs must be a StructuredOutputsParams, got {'regex': 'a+'}",
        ),
    ],
)
def test_a_refusal_states_the_rule_that_was_broken(kwargs, message):
    with pytest.raises(ValueError) as raised:
        SamplingParams(**kwargs)
    assert str(raised.value) == message


def test_the_smallest_valid_values_are_accepted():
    """The edges of each range are inside it: one token, min_tokens equal to max_tokens,
    prompt_logprobs -1 (the whole vocabulary) and 0 (the prompt token's own only)."""
    assert SamplingParams(max_tokens=1).max_tokens == 1
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(prompt_logprobs=-1).prompt_logprobs == -1
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    # An unseeded request's completions stay unseeded.
    assert SamplingParams(n=2).for_completion(1).seed is None


def test_every_field_has_an_invalid_example():
    """The table above covers every field of SamplingParams."""
    validated = {field.name for field in dataclasses.fields(SamplingParams)}
    assert {field for field, _ in INVALID_PARAMS} == validated


# --- StructuredOutputsParams validation (chapter 10's spec, checked where it is made) ---

INVALID_STRUCTURED_OUTPUTS = [
    (
        {},
        "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got none",
    ),
    (
        {"json": {"type": "object"}, "regex": "a+"},
        "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
        "got ['json', 'regex']",
    ),
    ({"json": 5}, "structured_outputs.json must be a JSON schema (dict or string), got 5"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string, got ''"),
    ({"regex": 5}, "structured_outputs.regex must be a non-empty string, got 5"),
    ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string, got ''"),
    ({"grammar": ["root ::= 'a'"]}, "structured_outputs.grammar must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a list of non-empty strings, got []"),
    ({"choice": ["yes", ""]}, "structured_outputs.choice must be None, a str or a list of str"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be a bool, got 'yes'"),
]


@pytest.mark.parametrize(("fields", "message"), INVALID_STRUCTURED_OUTPUTS)
def test_an_invalid_structured_outputs_spec_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError) as raised:
        StructuredOutputsParams(**fields)
    assert str(raised.value).startswith(message)


def test_a_structured_outputs_spec_names_its_kind_and_keys_equal_specs_alike():
    """kind() is the one field set (json_object=False is not set); key() is equal for equal
    specs and keeps a schema's property order, the order of the fields the output has."""
    assert StructuredOutputsParams(regex="a+", json_object=False).kind() == ("regex", "a+")
    assert StructuredOutputsParams(json_object=True).kind() == ("json_object", True)
    assert StructuredOutputsParams(choice="yes").kind() == ("choice", ["yes"])  # one string
    assert StructuredOutputsParams(grammar="root ::= 'a'").key() == "grammar:\"root ::= 'a'\""
    name_age = {"properties": {"name": {}, "age": {}}}
    age_name = {"properties": {"age": {}, "name": {}}}
    key = StructuredOutputsParams(json=name_age).key()
    assert key == 'json:{"properties": {"name": {}, "age": {}}}'
    assert StructuredOutputsParams(json=dict(name_age)).key() == key
    assert StructuredOutputsParams(json=age_name).key() != key
    assert StructuredOutputsParams(choice=["a", "b"]).key() == 'choice:["a", "b"]'


def test_sampling_params_normalise_their_inputs():
    """top_k=-1 means off (0), one stop string becomes a list, ids become a list, ints floats."""
    params = SamplingParams(top_k=-1, stop="###", stop_token_ids=(7, 8), temperature=1)

    assert params.top_k == 0
    assert params.stop == ["###"]
    assert params.stop_token_ids == [7, 8]
    assert isinstance(params.temperature, float)
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_defaults_match_vllm_and_greedy_means_temperature_below_1e_5():
    """Defaults are vLLM's; temperatures below 1e-5 count as greedy; greedy with n > 1 is fine."""
    defaults = SamplingParams()
    assert (defaults.n, defaults.temperature, defaults.top_p, defaults.top_k) == (1, 1.0, 1.0, 0)
    assert (defaults.max_tokens, defaults.min_tokens, defaults.logprobs) == (16, 0, None)
    assert not defaults.is_greedy
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(n=4, temperature=0.0).n == 4


def test_make_generator_is_reproducible():
    """Two generators made from one seed produce the same numbers."""
    first = torch.rand(5, generator=make_generator(11))
    second = torch.rand(5, generator=make_generator(11))
    assert torch.equal(first, second)


def test_the_extremes_of_torchs_seed_range_are_accepted_and_sample():
    """-2**63 and 2**64 - 1 are seeds torch's generator takes, so they are valid (with n = 1)."""
    for seed in (-(2**63), 2**64 - 1):
        params = SamplingParams(seed=seed, n=1)
        row = sampling_row(params, generator=make_generator(params.seed))
        assert Sampler()(torch.zeros(1, 4), [row]).token_ids[0] in range(4)


def test_prompt_logprobs_belong_to_the_first_of_n_completions():
    """Siblings share the prompt: only completion 0 scores it; seeds still step by one."""
    params = SamplingParams(n=3, seed=7, prompt_logprobs=2)
    siblings = [params.for_completion(i) for i in range(3)]
    assert [p.prompt_logprobs for p in siblings] == [2, None, None]
    assert [p.seed for p in siblings] == [7, 8, 9]


# --- logit_bias ---


def test_logit_bias_forces_and_bans_tokens_before_choosing():
    """+100 on a token makes it greedy's choice; -100 on the argmax hands it to the runner-up.
    The processed logprobs are those of the biased logits; the raw ones ignore the bias."""
    logits = torch.tensor([[2.0, 1.5, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, logprobs=0, logit_bias={2: 100.0}),
        SamplingParams(temperature=0.0, logprobs=0, logit_bias={0: -100.0}),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    rows = [sampling_row(p) for p in params]

    processed = Sampler(logprobs_mode="processed_logprobs")(logits, rows)
    raw = Sampler()(logits, rows)

    assert processed.token_ids == raw.token_ids == [2, 1, 0]
    biased = [[2.0, 1.5, 100.0], [-98.0, 1.5, 0.0], [2.0, 1.5, 0.0]]
    for row, token, row_logits in zip(range(3), [2, 1, 0], biased, strict=True):
        expected = log_softmax(row_logits)[token]
        assert processed.logprobs[row].sampled_logprob == pytest.approx(expected, abs=1e-5)
        assert raw.logprobs[row].sampled_logprob == pytest.approx(
            log_softmax([2.0, 1.5, 0.0])[token], abs=1e-5
        )


def test_logit_bias_shifts_random_draws():
    """-100 on the likeliest token: 2000 draws never pick it, and the others still turn up."""
    draws = 2000
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]] * draws)
    params = SamplingParams(temperature=1.0, logit_bias={0: -100.0})

    tokens = Sampler(make_generator(12))(logits, [sampling_row(params)] * draws).token_ids

    assert set(tokens) == {1, 2, 3}


# --- logprobs_mode ---


def test_logprobs_modes_report_raw_or_processed_logits_and_logprobs():
    """vLLM's four modes on one greedy and one random row, with a repetition penalty, a bias
    and min_tokens: raw reads the model's logits as they came, processed reads what the token
    was chosen from (for the random row after temperature and top-k too), and the _logits
    modes give the values themselves instead of their log_softmax."""
    raw_logits = [3.0, 2.0, 1.0, -1.0]
    greedy = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, logit_bias={3: 0.5}, min_tokens=1, logprobs=4
    )
    random = SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0, logprobs=4)
    rows = [sampling_row(greedy, prompt=[0], eos=[1]), sampling_row(random, prompt=[0])]
    # Greedy row: token 0 (in the prompt) 3 / 2, eos banned, 1 as it is, -1 + the 0.5 bias.
    greedy_processed = [1.5, -math.inf, 1.0, -0.5]
    # Random row: token 0 penalised to 1.5, then / 0.5, then only the two largest survive.
    random_processed = [3.0, 4.0, -math.inf, -math.inf]
    expected = {
        "raw_logits": [raw_logits, raw_logits],
        "raw_logprobs": [log_softmax(raw_logits), log_softmax(raw_logits)],
        "processed_logits": [greedy_processed, random_processed],
        "processed_logprobs": [log_softmax(greedy_processed), log_softmax(random_processed)],
    }
    logits = torch.tensor([raw_logits, raw_logits])
    for mode, rows_expected in expected.items():
        result = Sampler(make_generator(13), logprobs_mode=mode)(logits, rows)
        assert result.token_ids[0] == 0
        assert result.token_ids[1] in (0, 1)
        for logprobs, reference in zip(result.logprobs, rows_expected, strict=True):
            reported = dict(logprobs.top)
            assert len(reported) == 4, mode
            for token_id, value in enumerate(reference):
                assert reported[token_id] == pytest.approx(value, abs=1e-5), (mode, token_id)
            token = logprobs.sampled_token_id
            assert logprobs.sampled_logprob == pytest.approx(reference[token], abs=1e-5)


def test_an_unknown_logprobs_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="processed")
