"""Chapter 01b's learning checks are themselves checked: each passes on minivllm's sampler
functions and on the published solution, and fails, showing the first wrong token, on the
mistakes a learner typically makes."""

import pytest
import torch

from minivllm.learning_checks import all_checks, get_solution, run_check

CHECKS = ["ch01b.top_k", "ch01b.top_p", "ch01b.min_p", "ch01b.penalties"]

REMOVED = float("-inf")


# --- typical mistakes, one function each ---


def _top_k_keeping_k_plus_one(logits, k):
    """Off by one: compares with the (k+1)-th largest logit, so k + 1 tokens survive."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits.clone()
    threshold = torch.sort(logits, descending=True).values[min(k, logits.shape[-1] - 1)]
    return logits.masked_fill(logits < threshold, REMOVED)


def _top_k_with_torch_topk(logits, k):
    """torch.topk keeps exactly k tokens: of several tied at the k-th value, only some stay."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits.clone()
    kept = torch.full_like(logits, REMOVED)
    indices = torch.topk(logits, k).indices
    kept[indices] = logits[indices]
    return kept


def _top_p_dropping_the_token_that_crosses_p(logits, p):
    """Keeps the tokens whose running sum is at most p, so the token that reaches p is lost
    (and a top token more likely than p on its own leaves nothing at all)."""
    sorted_logits, sorted_ids = torch.sort(logits, descending=True, stable=True)
    running_sum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = torch.zeros(logits.shape, dtype=torch.bool)
    remove[sorted_ids] = running_sum > p
    return logits.masked_fill(remove, REMOVED)


def _top_p_keeping_one_past_an_exact_boundary(logits, p):
    """Removes a token only once the tokens above it *exceed* p: when they reach p exactly,
    one token too many survives (four equal logits and p = 0.5 keep three instead of two)."""
    if p >= 1.0:
        return logits.clone()
    sorted_logits, sorted_ids = torch.sort(logits, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_above = torch.cat([torch.zeros(1), torch.cumsum(probs, dim=-1)[:-1]])
    remove = torch.zeros(logits.shape, dtype=torch.bool)
    remove[sorted_ids] = mass_above > p
    return logits.masked_fill(remove, REMOVED)


def _min_p_as_an_absolute_floor(logits, min_p):
    """Removes tokens less likely than min_p itself, not min_p times the top probability."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p, REMOVED)


def _min_p_on_logits(logits, min_p):
    """Scales the largest *logit* instead of the largest probability."""
    return logits.masked_fill(logits < min_p * logits.max(), REMOVED)


def _penalties_dividing_every_seen_logit(
    logits, prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty,
    frequency_penalty,
):  # fmt: skip
    """Divides every seen logit by r: a negative logit moves towards 0, becoming more likely."""
    penalised = logits.clone()
    for token in set(prompt_token_ids) | set(output_token_ids):
        penalised[token] = penalised[token] / repetition_penalty
    for token in set(output_token_ids):
        penalised[token] -= frequency_penalty * output_token_ids.count(token) + presence_penalty
    return penalised


def _penalties_forgetting_the_prompt(
    logits, prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty,
    frequency_penalty,
):  # fmt: skip
    """Applies the repetition penalty to output tokens only; vLLM's also covers the prompt."""
    penalised = logits.clone()
    for token in set(output_token_ids):
        x = penalised[token]
        penalised[token] = x / repetition_penalty if x > 0 else x * repetition_penalty
        penalised[token] -= frequency_penalty * output_token_ids.count(token) + presence_penalty
    return penalised


def _penalties_counting_the_prompt_for_frequency(
    logits, prompt_token_ids, output_token_ids, repetition_penalty, presence_penalty,
    frequency_penalty,
):  # fmt: skip
    """Charges frequency and presence for prompt tokens too; they look at the output only."""
    penalised = logits.clone()
    history = list(prompt_token_ids) + list(output_token_ids)
    for token in set(history):
        x = penalised[token]
        penalised[token] = x / repetition_penalty if x > 0 else x * repetition_penalty
        penalised[token] -= frequency_penalty * history.count(token) + presence_penalty
    return penalised


MISTAKES = {
    "ch01b.top_k": [_top_k_keeping_k_plus_one, _top_k_with_torch_topk],
    "ch01b.top_p": [
        _top_p_dropping_the_token_that_crosses_p,
        _top_p_keeping_one_past_an_exact_boundary,
    ],
    "ch01b.min_p": [_min_p_as_an_absolute_floor, _min_p_on_logits],
    "ch01b.penalties": [
        _penalties_dividing_every_seen_logit,
        _penalties_forgetting_the_prompt,
        _penalties_counting_the_prompt_for_frequency,
    ],
}


def test_the_chapter_registers_its_checks():
    assert set(CHECKS) <= set(all_checks())


@pytest.mark.parametrize("name", CHECKS)
def test_check_passes_on_minivllms_sampler(name):
    """The check accepts minivllm's own apply_top_k / apply_top_p / apply_min_p /
    apply_penalties, adapted to one row."""
    result = run_check(name, all_checks()[name].reference())
    assert result.passed, str(result)


@pytest.mark.parametrize("name", CHECKS)
def test_check_passes_on_the_solution(name):
    result = run_check(name, get_solution(name))
    assert result.passed, str(result)


@pytest.mark.parametrize(
    ("name", "mistake"),
    [(name, mistake) for name, mistakes in MISTAKES.items() for mistake in mistakes],
    ids=lambda value: getattr(value, "__name__", value).strip("_"),
)
def test_check_fails_on_a_typical_mistake(name, mistake):
    """The report names the first wrong token with expected and actual values, and shows the
    input hypothesis shrank the failure to."""
    result = run_check(name, mistake)
    assert not result.passed
    report = str(result)
    assert "FAIL" in report
    assert "token " in report and "expected" in report and "got" in report, report
    shown_input = ("Falsifying example", "Failing test case", "Failing explicit example")
    assert any(words in report for words in shown_input), report


def test_a_report_on_a_hand_checkable_case():
    """Dropping the token that crosses p shrinks to one token of probability 1 and p = 0.5:
    its running sum exceeds p, so even the most likely token, which must always stay, is
    removed. The report says which token, why it must stay, and what came back."""
    result = run_check("ch01b.top_p", _top_p_dropping_the_token_that_crosses_p)
    report = str(result)
    assert "token 0: expected 0 (kept, unchanged), got -inf" in report, report
    assert "always kept" in report and "logits=[0], p=0.5" in report, report
