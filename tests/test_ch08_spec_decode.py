"""Chapter 08 checks: speculative decoding changes how fast tokens come, never which.

Greedy: the engine with n-gram drafts gives the tokens it gives without them (and
transformers'), alone and in a batch, with prefix caching and with preemption. Sampling: the
rejection sampler's output is distributed as the target's, measured over many seeded draws, and
a wrong rule (resampling from the target instead of the residual) fails the same measurement.
The pool: after every step a request holds exactly the blocks of its accepted tokens, and
nothing is left after the requests end or are aborted.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from conftest import ENGINE_TEST_FAMILY, assert_pool_is_empty, chat_prompt_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.config import EngineConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.core.scheduler import Scheduler, SchedulerConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.models.tiny import make_tiny_model
from minivllm.sample.sampler import NOTHING_TO_SAMPLE, Sampler, SamplingRow
from minivllm.spec_decode.draft_model_proposer import DraftModelProposer
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.spec_decode.proposal import ProposalRequest
from minivllm.spec_decode.rejection_sampler import NothingToSample, draw, rejection_sample
from minivllm.structured_output.manager import StructuredOutputManager, apply_token_bitmasks
from minivllm.utils import cdiv

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
# Prompts that repeat themselves, so that n-gram lookups find something to propose.
COPY_PROMPTS = [
    {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]},
    {"prompt_token_ids": list(range(300, 320)) + list(range(300, 310))},
    {"prompt_token_ids": [42, 43] * 6},
    {"prompt_token_ids": [900, 901, 902, 903, 904, 905, 900, 901]},
]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def metrics(llm) -> dict:
    return {m.name: m.value for m in llm.get_metrics()}


# --- the proposer -------------------------------------------------------------------------------


def test_ngram_proposer_copies_what_followed_the_latest_longest_match():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # "1 2 3" occurred before, followed by 4 5 6: the longest suffix match wins.
    assert proposer.propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3]) == [4, 5, 6]
    # "7" occurs twice earlier; the most recent occurrence is followed by 8, 0.
    assert proposer.propose([7, 1, 7, 8, 0, 7]) == [8, 0, 7]
    # Fewer tokens than k follow the match: propose what there is.
    assert proposer.propose([3, 4, 3]) == [4, 3]
    assert proposer.propose([1, 2, 3]) == []  # no repeat
    assert NgramProposer(3, 2, 3).propose([5, 6, 1, 6]) == []  # only a 1-token match
    # The longest match can be all but the last token (the suffix starts at token 1).
    assert NgramProposer(3, 1, 3).propose([5, 5]) == [5]
    assert NgramProposer(3, 2, 3).propose([7, 7, 7]) == [7]


# --- the rejection sampler ----------------------------------------------------------------------

TRIALS = 6000
VOCAB = 5


def total_variation(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    return 0.5 * float((counts / counts.sum() - probs.double()).abs().sum())


def first_token_distribution(sampler, p: torch.Tensor, q: torch.Tensor | None, seed: int):
    """The first emitted token over many trials: a draft drawn from q (or fixed at token 0 for
    an n-gram draft, q one-hot), verified against target p."""
    generator = torch.Generator().manual_seed(seed)
    emitted = []
    for _ in range(TRIALS):
        draft = 0 if q is None else int(torch.multinomial(q, 1, generator=generator))
        target = torch.stack([p, p])  # the draft position and the bonus position
        emitted.append(sampler(target, [draft], None if q is None else q[None], generator)[0])
    return emitted


def _resample_from_target(target_probs, draft_token_ids, draft_probs, generator=None):
    """The wrong rule: on rejection draw from p itself instead of the residual max(0, p - q)."""
    p = target_probs[0]
    token = draft_token_ids[0]
    q_token = 1.0 if draft_probs is None else float(draft_probs[0][token])
    if float(torch.rand((), generator=generator)) < min(1.0, float(p[token]) / q_token):
        return [token]
    return [int(torch.multinomial(p, 1, generator=generator))]


@pytest.mark.parametrize("draft", ["draft model", "n-gram"])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(VOCAB, generator=generator) * 1.5, dim=0)
    q = torch.softmax(torch.randn(VOCAB, generator=generator) * 1.5, dim=0)
    q = None if draft == "n-gram" else q
    right = first_token_distribution(rejection_sample, p, q, seed=1)
    wrong = first_token_distribution(_resample_from_target, p, q, seed=1)
    # With 6,000 draws the sampling noise in total variation is about 0.01; the wrong rule is
    # off by far more (it over-weights tokens the draft proposes too often).
    assert total_variation(right, p) < 0.025
    assert total_variation(wrong, p) > 0.05


def test_greedy_rejection_keeps_the_argmax_and_adds_it_on_rejection():
    one_hot = torch.eye(VOCAB)
    target = one_hot[[2, 3, 1]]  # argmax 2, then 3, then the bonus 1
    assert rejection_sample(target, [2, 3], None) == [2, 3, 1]  # both accepted + bonus
    assert rejection_sample(target, [2, 4], None) == [2, 3]  # second rejected: the argmax
    assert rejection_sample(target, [0, 3], None) == [2]  # first rejected


def test_a_seeded_rejection_sample_follows_its_generator_alone():
    """Acceptance draws, residual draws and bonus draws all come from the request's generator:
    the same seed gives the same tokens, whatever torch's global generator did meanwhile."""
    p = torch.softmax(torch.arange(VOCAB, dtype=torch.float32), dim=0)
    target = torch.stack([p, p, p])
    q = torch.softmax(-torch.arange(VOCAB, dtype=torch.float32), dim=0)
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(0)
        runs.append(
            [rejection_sample(target, [0, 1], torch.stack([q, q]), generator) for _ in range(50)]
        )
    assert runs[0] == runs[1]
    assert len({tuple(tokens) for tokens in runs[0]}) >= 3  # not one fixed answer


def test_a_token_the_target_rules_out_is_never_accepted(monkeypatch):
    """p(x) = 0: the acceptance probability is 0, refused even by the smallest draw, 0.0."""
    monkeypatch.setattr("minivllm.spec_decode.rejection_sampler.uniform", lambda generator: 0.0)
    target = torch.eye(VOCAB)[[3, 3]]
    assert rejection_sample(target, [1], None) == [3]


def test_a_rejection_without_residual_mass_draws_from_the_target(monkeypatch):
    """Where p <= q everywhere (float rounding, exaggerated here: q is not normalised) the
    residual max(0, p - q) has no mass; the replacement then comes from p itself."""
    monkeypatch.setattr("minivllm.spec_decode.rejection_sampler.uniform", lambda generator: 0.99)
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0])
    q = torch.tensor([0.6, 0.5, 0.0, 0.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    drawn = {rejection_sample(torch.stack([p, p]), [0], q[None], generator)[0] for _ in range(40)}
    assert drawn == {0, 1}


def test_a_one_token_distribution_is_drawn_without_randomness(monkeypatch):
    """draw() returns a one-hot distribution's token without touching the generator (so a
    rejection whose residual is a single token leaves a seeded request's stream alone)."""
    monkeypatch.setattr("minivllm.spec_decode.rejection_sampler.uniform", lambda generator: 0.9)
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert draw(torch.eye(VOCAB)[2], generator) == 2
    p, q = torch.tensor([0.5, 0.5, 0, 0, 0]), torch.tensor([1.0, 0, 0, 0, 0])
    # Rejected (0.9 >= p/q = 0.5): the residual is one-hot at token 1.
    assert rejection_sample(torch.stack([p, p]), [0], q[None], generator) == [1]
    assert torch.equal(generator.get_state(), state)


def test_draw_samples_on_torchs_generator_and_refuses_a_distribution_without_mass():
    torch.manual_seed(0)
    p = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    assert {draw(p, None) for _ in range(40)} == {1, 3}  # no generator: torch's global one
    for empty in (torch.zeros(VOCAB), torch.full((VOCAB,), float("nan"))):
        with pytest.raises(NothingToSample) as refused:
            draw(empty, None)
        assert str(refused.value) == NOTHING_TO_SAMPLE


# --- the engine ---------------------------------------------------------------------------------


class OracleProposer(NgramProposer):
    """A stand-in draft that knows each prompt's true greedy continuation (from a plain run)
    and gets every third token wrong: drafts are proposed at every step, some kept and some
    rolled back, whatever the model. (A tiny random model's output rarely repeats, so the
    n-gram proposer would propose nothing to verify.)"""

    def __init__(self, sequences: list[list[int]], k: int = 4):
        super().__init__(k, prompt_lookup_min=1, prompt_lookup_max=1)
        self.sequences = sequences

    def propose(self, token_ids: list[int]) -> list[int]:
        for full in self.sequences:
            if full[: len(token_ids)] == token_ids:
                continuation = full[len(token_ids) : len(token_ids) + self.k]
                return [
                    t if (len(token_ids) + i) % 3 else t + 1 for i, t in enumerate(continuation)
                ]
        return []


def engine(model_dir, **kwargs) -> LLMEngine:
    settings = dict(model=str(model_dir), block_size=4, enable_prefix_caching=True) | kwargs
    return LLMEngine(EngineConfig(**settings))


def with_oracle(eng: LLMEngine, prompts, outputs) -> LLMEngine:
    sequences = [p["prompt_token_ids"] + o for p, o in zip(prompts, outputs)]
    eng.executor.driver_worker.model_runner.proposer = OracleProposer(sequences)
    return eng


def run_checking_blocks(eng: LLMEngine, prompts, params) -> dict[str, list[int]]:
    """Step the engine to the end; after every step each running request holds exactly the
    blocks of its computed tokens (rejected drafts' blocks went back)."""
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, params)
    finished = {}
    while eng.has_unfinished_requests():
        for output in eng.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        manager = eng.kv_cache_manager
        for request in eng.scheduler.running:
            held = len(manager.block_tables[request.request_id])
            assert held == cdiv(request.num_computed_tokens, manager.block_size)
    assert_pool_is_empty(eng)
    return [finished[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, embedded_dir):
    """Another random tiny model with the same vocabulary: a draft that is almost always wrong."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("draft"), 1, embedded_dir)


# Each proposer, and what its drafts must show for the test to prove anything.
PROPOSERS = ("ngram (oracle)", "draft model (random)", "draft model (the target)", "layer skip")


def speculative_engine(proposer: str, target, draft_dir, prompts, plain, **kwargs) -> LLMEngine:
    if proposer == "ngram (oracle)":
        return with_oracle(engine(target, speculative_config=NGRAM, **kwargs), prompts, plain)
    config = {
        "draft model (random)": {"method": "draft_model", "model": str(draft_dir)},
        "draft model (the target)": {"method": "draft_model", "model": str(target)},
        "layer skip": {"method": "layer_skip", "num_draft_layers": 1},
    }[proposer]
    return engine(target, speculative_config=config | {"num_speculative_tokens": 4}, **kwargs)


def check_drafts_were_tested(proposer: str, stats) -> None:
    assert stats.num_draft_tokens > 0, "no draft was ever proposed: the test proves nothing"
    if proposer == "draft model (the target)":  # a draft that is the target is kept
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    else:  # some rolled back (and, for the oracle, some kept)
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    if proposer == "ngram (oracle)":
        assert stats.num_accepted_tokens > 0


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(
    tiny_model_dirs, tiny_draft_dir, batch, proposer
):
    model = tiny_model_dirs[ENGINE_TEST_FAMILY]
    prompts = (COPY_PROMPTS * 2)[:batch]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_checking_blocks(engine(model), prompts, params)
    speculative = speculative_engine(proposer, model, tiny_draft_dir, prompts, plain)
    assert run_checking_blocks(speculative, prompts, params) == plain
    check_drafts_were_tested(proposer, speculative.scheduler.spec_decode_stats)


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_speculation_survives_preemption_with_the_same_tokens(
    tiny_model_dirs, tiny_draft_dir, proposer
):
    """A pool of 14 blocks of 4 tokens for 8 requests: requests are preempted (their drafts
    dropped) and recomputed, and the tokens do not change."""
    model = tiny_model_dirs[ENGINE_TEST_FAMILY]
    prompts = COPY_PROMPTS * 2
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 14 blocks of 4 tokens: the tiny model's K/V take 512 bytes a token, and a draft model's
    # pool takes as many blocks again (its own bytes per token).
    draft_bytes = {"draft model (random)": 512, "draft model (the target)": 512, "layer skip": 256}
    budget = 14 * 4 * (512 + draft_bytes.get(proposer, 0))
    plain_engine = engine(model, kv_cache_memory_bytes=budget, max_num_seqs=8)
    plain = run_checking_blocks(plain_engine, prompts, params)
    speculative = speculative_engine(
        proposer,
        model,
        tiny_draft_dir,
        prompts,
        plain,
        kv_cache_memory_bytes=budget,
        max_num_seqs=8,
    )
    assert speculative.kv_cache_manager.num_blocks == 14
    assert run_checking_blocks(speculative, prompts, params) == plain
    assert speculative.scheduler.num_preemptions > 0
    assert speculative.scheduler.spec_decode_stats.num_draft_tokens > 0


def test_speculation_never_emits_more_than_max_tokens_and_honours_stops(tiny_model_dirs):
    """Drafts run past max_tokens and past a stop token; neither may show in the output."""
    model = tiny_model_dirs[ENGINE_TEST_FAMILY]
    plain = LLM(model)
    long_run = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    truth = token_ids(plain.generate(COPY_PROMPTS, long_run, use_tqdm=False))
    stop_id = truth[0][5]  # a token the first request emits mid-way
    for params in (
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
    ):
        expected = token_ids(plain.generate(COPY_PROMPTS, params, use_tqdm=False))
        speculative = LLM(model, speculative_config=NGRAM)
        with_oracle(speculative.llm_engine, COPY_PROMPTS, truth)
        got = token_ids(speculative.generate(COPY_PROMPTS, params, use_tqdm=False))
        assert got == expected
        assert all(len(tokens) <= params.max_tokens for tokens in got)
        assert metrics(speculative)["vllm:spec_decode_num_draft_tokens"] > 0
    assert expected[0][-1] == stop_id  # the stop ended the first request where it appeared


def test_seeded_sampling_with_speculation_is_reproducible(tiny_model_dirs):
    model = tiny_model_dirs[ENGINE_TEST_FAMILY]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    truth = token_ids(LLM(model).generate(COPY_PROMPTS, greedy, use_tqdm=False))
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=16) for s in range(4)]
    runs = []
    for order in (slice(None), slice(None, None, -1)):  # in another batch order: same tokens
        llm = LLM(model, speculative_config=NGRAM)
        with_oracle(llm.llm_engine, COPY_PROMPTS, truth)
        outputs = token_ids(llm.generate(COPY_PROMPTS[order], params[order], use_tqdm=False))
        runs.append(outputs[order])
        assert metrics(llm)["vllm:spec_decode_num_draft_tokens"] > 0
    assert runs[0] == runs[1]


def test_ngram_drafts_on_a_tiny_model_that_repeats_itself(tiny_model_dirs):
    """The tiny tied-embedding llama keeps repeating tokens it has seen, so the real n-gram
    proposer finds matches; its greedy tokens stay those of plain decoding."""
    llm = LLM(tiny_model_dirs["llama"], speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    got = token_ids(llm.generate(COPY_PROMPTS, params, use_tqdm=False))
    plain = LLM(tiny_model_dirs["llama"]).generate(COPY_PROMPTS, params, use_tqdm=False)
    assert got == token_ids(plain)
    seen = metrics(llm)
    assert seen["vllm:spec_decode_num_accepted_tokens"] > 0
    per_position = [
        seen[f'vllm:spec_decode_num_accepted_tokens_per_pos{{position="{i}"}}'] for i in range(4)
    ]
    assert sum(per_position) == seen["vllm:spec_decode_num_accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)  # a later draft needs the earlier


def test_aborting_mid_speculation_frees_every_block(tiny_model_dirs):
    eng = engine(tiny_model_dirs[ENGINE_TEST_FAMILY], speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(COPY_PROMPTS):
        eng.add_request(str(i), prompt, params)
    while eng.scheduler.spec_decode_stats.num_drafts < 3:
        eng.step()
    eng.abort_request([str(i) for i in range(len(COPY_PROMPTS))])
    eng.step()  # the runner is told to forget them
    assert_pool_is_empty(eng)


def test_aborting_mid_draft_model_speculation_frees_every_block(tiny_model_dirs, tiny_draft_dir):
    draft = {"method": "draft_model", "model": str(tiny_draft_dir)}
    eng = engine(tiny_model_dirs[ENGINE_TEST_FAMILY], speculative_config=draft)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(COPY_PROMPTS):
        eng.add_request(str(i), prompt, params)
    while eng.scheduler.spec_decode_stats.num_drafts < 6:
        eng.step()
    eng.abort_request(["0", "2"])  # two now, the others at the end of their next step
    eng.step()
    eng.abort_request(["1", "3"])
    eng.step()
    assert_pool_is_empty(eng)


def test_a_sampled_draft_is_verified_against_the_distribution_it_was_drawn_from(tiny_model_dirs):
    """The target as its own draft, sampling at temperature 1: q equals p (up to rounding), so
    min(1, p/q) keeps nearly every draft. Verifying as if the draft were certain (q one-hot, the
    n-gram case) would keep a draft with probability p(x) only, a few percent on a random
    model's flat distribution. Seeded runs repeat themselves in any batch order."""
    model = tiny_model_dirs[ENGINE_TEST_FAMILY]
    itself = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16) for s in range(4)]
    runs = []
    for order in (slice(None), slice(None, None, -1)):
        llm = LLM(model, speculative_config=itself)
        outputs = token_ids(llm.generate(COPY_PROMPTS[order], params[order], use_tqdm=False))
        runs.append(outputs[order])
        seen = metrics(llm)
        assert seen["vllm:spec_decode_num_draft_tokens"] > 0
        assert seen["minivllm:spec_decode_acceptance_rate"] > 0.8
    assert runs[0] == runs[1]


@pytest.mark.parametrize("speculative", [NGRAM, {"method": "layer_skip", "num_draft_layers": 1}])
def test_speculation_reports_the_logprobs_of_plain_decoding(tiny_model_dirs, speculative):
    """Each emitted token's logprobs come from the target's row that scored it, as they would
    have without drafts."""
    model = tiny_model_dirs["llama"]  # repeats itself: n-gram drafts get accepted
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    plain = LLM(model).generate(COPY_PROMPTS, params, use_tqdm=False)
    llm = LLM(model, speculative_config=speculative)
    got = llm.generate(COPY_PROMPTS, params, use_tqdm=False)
    assert metrics(llm)["vllm:spec_decode_num_draft_tokens"] > 0
    for ours, theirs in zip(got, plain):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        assert ours.token_ids == theirs.token_ids
        for mine, reference in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert mine.keys() == reference.keys()
            for token_id in mine:
                assert mine[token_id].logprob == pytest.approx(
                    reference[token_id].logprob, abs=1e-4
                )
                assert mine[token_id].rank == reference[token_id].rank
        assert ours.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-3)


def test_embedded_model_with_speculation_gives_transformers_greedy_tokens(
    tokenizer, transformers_greedy
):
    prompt = chat_prompt_ids(
        tokenizer, "Repeat after me, word for word: the quick brown fox jumps over the lazy dog."
    )
    # Short n-grams (vLLM's default is 5): the model's answer drops a word of the prompt, so
    # only a match of at most 4 tokens proposes drafts it accepts.
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    llm = LLM(
        speculative_config={**ngram, "prompt_lookup_max": 4}, kv_cache_memory_bytes=256 * 1024**2
    )
    output = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=20)
    )
    assert list(output[0].outputs[0].token_ids) == transformers_greedy(prompt, 20)
    assert metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > 0


def test_bad_speculative_configs_are_clear_errors():
    for bad, message in (
        ({"method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"draft": 1}, "unknown speculative_config key"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ("{not json", "not valid JSON"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "model": "x"}, "only used with method 'draft_model'"),
        ({"method": "layer_skip"}, "num_draft_layers"),
        ({"method": "layer_skip", "num_draft_layers": 0}, "num_draft_layers"),
        ({"num_draft_layers": 2}, "only used with method 'layer_skip'"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)


def test_bad_draft_models_are_clear_errors(tiny_model_dirs, tmp_path, embedded_dir):
    model = tiny_model_dirs[ENGINE_TEST_FAMILY]  # two layers
    with pytest.raises(ValueError, match="num_draft_layers must be below the target's 2 layers"):
        LLM(model, speculative_config={"method": "layer_skip", "num_draft_layers": 2})
    small_vocab = make_tiny_model("llama", tmp_path / "small_vocab", 0)  # 512 tokens
    with pytest.raises(ValueError, match="vocabulary of 512 tokens"):
        LLM(model, speculative_config={"method": "draft_model", "model": str(small_vocab)})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(
            tensor_parallel_size=2,
            speculative_config={"method": "draft_model", "model": str(model)},
        )


def test_rejection_sampler_check_passes_on_minivllm_and_fails_on_a_typical_mistake():
    from minivllm.learning_checks import all_checks, assert_check, run_check

    assert_check("ch08.rejection_sample", all_checks()["ch08.rejection_sample"].reference())
    result = run_check("ch08.rejection_sample", _resample_from_target_everywhere)
    assert not result.passed
    assert "should follow p" in result.report


def _resample_from_p_after_a_certain_draft(
    target_probs, draft_token_ids, draft_probs, generator=None
):
    """With draft_probs None, a rejected draft is replaced by a draw from p itself (which may
    draw the rejected token again) instead of from p without it. Greedy targets cannot tell."""
    from minivllm.learning_checks.solutions.ch08 import rejection_sample

    if draft_probs is not None:
        return rejection_sample(target_probs, draft_token_ids, draft_probs, generator)
    emitted = []
    for i, token in enumerate(draft_token_ids):
        p = target_probs[i]
        if float(torch.rand((), generator=generator)) < float(p[token]):
            emitted.append(token)
            continue
        emitted.append(int(torch.multinomial(p, 1, generator=generator)))
        return emitted
    last = target_probs[len(draft_token_ids)]
    return emitted + [int(torch.multinomial(last, 1, generator=generator))]


def _greedy_bonus_token(target_probs, draft_token_ids, draft_probs, generator=None):
    """Takes the bonus token as the last row's argmax instead of drawing it. Greedy targets
    cannot tell."""
    from minivllm.learning_checks.solutions.ch08 import rejection_sample

    emitted = rejection_sample(target_probs, draft_token_ids, draft_probs, generator)
    if len(emitted) == len(draft_token_ids) + 1 and emitted[:-1] == list(draft_token_ids):
        emitted[-1] = int(target_probs[len(draft_token_ids)].argmax())
    return emitted


@pytest.mark.parametrize(
    "mistake, words",
    [
        (_resample_from_p_after_a_certain_draft, "a certain draft"),
        (_greedy_bonus_token, "the bonus token should follow"),
    ],
    ids=["one-hot-path", "bonus-row"],
)
def test_rejection_sampler_check_catches_the_one_hot_path_and_the_bonus_row(mistake, words):
    from minivllm.learning_checks import run_check

    result = run_check("ch08.rejection_sample", mistake)
    assert not result.passed
    assert words in result.report


def _resample_from_target_everywhere(target_probs, draft_token_ids, draft_probs, generator=None):
    """The typical mistake, for any number of drafts: on rejection, draw from p itself."""
    emitted = []
    for i, token in enumerate(draft_token_ids):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i][token])
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[token]) / q_token):
            emitted.append(token)
            continue
        emitted.append(int(torch.multinomial(p, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))
    return emitted


# --- drafts under a grammar (chapter 10) ---------------------------------------------------------

GRAMMAR_TRIALS = 20000


def constrained_request(tokenizer, spec: StructuredOutputsParams) -> Request:
    """A sampled request with a grammar, as the engine makes one (its compile awaited)."""
    request = Request.create(
        "r", None, [5, 6], SamplingParams(temperature=1.0), tokenizer, (2,), max_model_len=64
    )
    request.grammar = StructuredOutputManager(tokenizer, len(tokenizer)).grammar_for(spec)
    request.grammar.matcher  # noqa: B018 (waits for the compile)
    return request


def first_token_under_a_grammar(scheduler, request, token_ids, p, q, seed: int) -> list[int]:
    """The first emitted token over many trials, as the engine makes it: a draft drawn from q
    (a draft model that knows nothing of the grammar), kept or cut by the scheduler, then
    verified against the masked target p, or, when cut, sampled from p directly. p and q live
    on the few tokens `token_ids` that carry their mass (a draw over the whole vocabulary
    costs a thousand times more); the scheduler sees the real token ids."""
    generator = torch.Generator().manual_seed(seed)
    emitted = []
    for _ in range(GRAMMAR_TRIALS):
        draft = draw(q, generator)
        if scheduler._draft_room(request, [token_ids[draft]]):
            emitted.append(rejection_sample(torch.stack([p, p]), [draft], q[None], generator)[0])
        else:
            emitted.append(draw(p, generator))
    return emitted


def test_a_sampled_draft_the_grammar_forbids_is_verified_not_cut(tokenizer):
    """The target puts equal weight on "yes", "no" and "maybe"; the grammar allows the first
    two, so p = [0.5, 0.5, 0]. The draft's q = [0.9, 0, 0.1] (on "yes", "no", "maybe"). Cutting
    the forbidden "maybe" and sampling p there gives 0.55 / 0.45; keeping it, the verifier
    rejects it (p = 0) and draws from the residual max(0, p - q), and the output follows p. The
    cut is the rule for certain (n-gram) drafts, where it is exact: run with it, the same draws
    land far from p."""
    token_ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "maybe")]
    request = constrained_request(tokenizer, StructuredOutputsParams(choice=["yes", "no"]))
    logits = torch.full((1, len(tokenizer)), float("-inf"))
    logits[0, token_ids] = 0.0
    apply_token_bitmasks(logits, [0], request.grammar.token_bitmasks([]))
    p = logits[0].softmax(dim=-1)[token_ids]
    assert p.tolist() == [0.5, 0.5, 0.0]  # the mask did it
    q = torch.tensor([0.9, 0.0, 0.1])
    emitted = {}
    for drafts_are_sampled in (True, False):
        config = SchedulerConfig(num_lookahead_tokens=1, drafts_are_sampled=drafts_are_sampled)
        scheduler = Scheduler(config, KVCacheManager(16, 4))
        emitted[drafts_are_sampled] = first_token_under_a_grammar(
            scheduler, request, token_ids, p, q, seed=1
        )
    # With 20,000 draws the sampling noise in total variation is about 0.004; the cut is off
    # by 0.05.
    assert total_variation(emitted[True], p) < 0.015
    assert total_variation(emitted[False], p) > 0.04


def test_a_sampled_draft_model_under_a_grammar_is_verified_and_rolled_back(
    tiny_model_dirs, tiny_draft_dir
):
    """A random draft knows nothing of the grammar: almost all its drafts are forbidden. A
    sampled request keeps the first forbidden one to be verified (so drafts are tested at
    all), the verifier rejects it, and the grammar, rolled back, still gives full matches."""
    phone = StructuredOutputsParams(regex=r"\d{3}-\d{4}")
    draft = {"method": "draft_model", "model": str(tiny_draft_dir), "num_speculative_tokens": 3}
    eng = engine(tiny_model_dirs[ENGINE_TEST_FAMILY], speculative_config=draft)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=16, structured_outputs=phone)
        for seed in range(4)
    ]
    for i, (prompt, request_params) in enumerate(zip(COPY_PROMPTS, params)):
        eng.add_request(str(i), prompt, request_params)
    finished = {}
    while eng.has_unfinished_requests():
        for output in eng.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    stats = eng.scheduler.spec_decode_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    for output in finished.values():
        assert re.fullmatch(r"\d{3}-\d{4}", output.text), output
        assert output.finish_reason == "stop"
    assert_pool_is_empty(eng)


# --- the draft model's catch-up -----------------------------------------------------------------


def test_the_draft_models_catch_up_stays_within_the_token_budget(
    tiny_model_dirs, tiny_draft_dir, monkeypatch
):
    """The target finds a shared prompt in the prefix cache, or prefills it in chunks of the
    step's budget; the draft has read none of it. It catches up in chunks under the same
    budget, over several steps (no drafts until it has), and greedy tokens stay those of plain
    decoding."""
    budget = 32
    sizes = []
    forward = DraftModelProposer.forward

    def counting_forward(self, block_tables, chunks):
        sizes.append(sum(len(tokens) for tokens, _ in chunks))
        return forward(self, block_tables, chunks)

    monkeypatch.setattr(DraftModelProposer, "forward", counting_forward)
    target = tiny_model_dirs[ENGINE_TEST_FAMILY]
    shared = list(range(1000, 1150))
    prompts = [{"prompt_token_ids": shared + [50 + i, 60 + i]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    settings = dict(max_num_batched_tokens=budget, max_num_seqs=8)
    plain = run_checking_blocks(engine(target, **settings), prompts, params)
    itself = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 2}
    eng = engine(target, speculative_config=itself, **settings)
    assert run_checking_blocks(eng, prompts, params) == plain
    assert max(sizes) <= budget
    assert sum(sizes) >= len(shared)  # the draft did read the prompt
    assert eng.scheduler.spec_decode_stats.num_accepted_tokens > 0


def bare_draft_proposer(k: int = 3, max_num_tokens: int | None = None) -> DraftModelProposer:
    """A draft proposer without a model, for its bookkeeping alone (no forward runs): blocks
    of 4 slots, a sampler of its own."""
    return DraftModelProposer(
        model=SimpleNamespace(device=torch.device("cpu")),
        kv_cache=SimpleNamespace(block_size=4),
        attention_backend=None,
        sampler=Sampler(),
        num_speculative_tokens=k,
        max_num_tokens=max_num_tokens,
    )


def proposal_request(num_tokens: int, num_draft_cached: int = 0, num_blocks: int = 1, **params):
    params = SamplingParams(**({"temperature": 0.0} | params))
    token_ids = list(range(10, 10 + num_tokens))
    row = SamplingRow(params, token_ids, [], generator=None)
    return ProposalRequest("r", token_ids, list(range(num_blocks)), num_draft_cached, row)


def test_the_draft_reads_its_unread_tokens_in_batch_order_within_the_budget():
    unread_5_3_2 = [proposal_request(9, 4), proposal_request(3), proposal_request(6, 4)]
    assert bare_draft_proposer().catch_up_lengths(unread_5_3_2) == [5, 3, 2]  # no budget
    assert bare_draft_proposer(max_num_tokens=6).catch_up_lengths(unread_5_3_2) == [5, 1, 0]
    assert bare_draft_proposer(max_num_tokens=10).catch_up_lengths(unread_5_3_2) == [5, 3, 2]


@pytest.mark.parametrize(
    "num_tokens, num_blocks, fit",
    # Guess j's K/V go at position n + j - 1: n tokens and k = 3 guesses need n + 2 slots.
    [(5, 2, 3), (6, 2, 3), (7, 2, 2), (8, 2, 1), (9, 2, 0), (12, 2, 0), (8, 3, 3)],
)
def test_a_draft_guesses_only_as_far_as_its_blocks_reach(num_tokens, num_blocks, fit):
    request = proposal_request(num_tokens, num_blocks=num_blocks)
    assert bare_draft_proposer(k=3).num_guesses_that_fit(request) == fit


VOCAB_OF_GUESS_TEST = 8


def test_each_guess_is_drawn_with_the_requests_settings_and_a_dead_row_ends_alone():
    """Row 0 greedy; row 1 all -inf (nothing to sample: its guesses end, not the batch's);
    row 2 greedy with a presence penalty, after a first guess of 7: the penalty counts the
    guesses as output, so 7 (3.0 - 2.0) loses to 3 (1.5)."""
    proposer = bare_draft_proposer()
    requests = [proposal_request(4), proposal_request(4), proposal_request(4, presence_penalty=2)]
    guesses, probs = [[], [], [7]], [[], [], [torch.zeros(VOCAB_OF_GUESS_TEST)]]
    logits = torch.zeros(3, VOCAB_OF_GUESS_TEST)
    logits[0, 5] = 1.0
    logits[1] = float("-inf")
    logits[2, 7], logits[2, 3] = 3.0, 1.5
    proposer.guess([0, 1, 2], logits, requests, guesses, probs)
    assert guesses == [[5], [], [7, 3]]
    assert [len(q) for q in probs] == [1, 0, 2]
    assert torch.equal(probs[0][0], torch.eye(VOCAB_OF_GUESS_TEST)[5])  # greedy: one-hot q
    proposer.guess([], logits[:0], requests, guesses, probs)  # nobody active: nothing drawn
    assert guesses == [[5], [], [7, 3]]


def test_memory_profiling_runs_the_draft_model_at_the_full_token_budget(tiny_model_dirs):
    """On a GPU the KV pool gets what a forward of the largest batch leaves; the draft model's
    catch-up forward is as large as the target's, so the profile runs it too."""
    target = tiny_model_dirs[ENGINE_TEST_FAMILY]
    itself = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 2}
    eng = engine(target, speculative_config=itself, max_num_batched_tokens=48)
    worker = eng.executor.driver_worker
    seen = {}
    for name, model in (("target", worker.model), ("draft", worker.draft_model)):
        forward = model.forward

        def recording_forward(input_ids, *args, _name=name, _forward=forward, **kwargs):
            seen[_name] = len(input_ids)
            return _forward(input_ids, *args, **kwargs)

        model.forward = recording_forward
    worker.run_largest_batch()
    assert seen == {"target": 48, "draft": 48}


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram k=4"])
def test_memory_profiling_samples_every_row_a_step_can_score(tiny_model_dirs, speculative):
    """The profile's logits and sampler cover the most rows a step scores: one per sequence,
    or with speculation k + 1 per sequence, on the sampler's most expensive path, and the
    rejection sampler's distributions too."""
    from minivllm.worker.worker import Worker

    extra = {} if speculative is None else {"speculative_config": speculative}
    eng = engine(tiny_model_dirs[ENGINE_TEST_FAMILY], max_num_seqs=4, **extra)
    seen = []
    original = Worker.profile_sampler

    def recording(logits, is_speculative):
        seen.append((len(logits), is_speculative))
        original(logits, is_speculative)

    eng.executor.driver_worker.profile_sampler = recording
    eng.executor.driver_worker.run_largest_batch()
    rows = 4 * (1 + (0 if speculative is None else speculative["num_speculative_tokens"]))
    assert seen == [(rows, speculative is not None)]


def test_the_gpu_kv_budget_leaves_out_what_pytorch_did_not_allocate():
    """gpu_memory_utilization of the whole GPU, less PyTorch's peak, less every byte in use that
    PyTorch's allocator does not hold (another process, the CUDA context, NCCL's buffers): 10
    GB more used elsewhere is 10 GB less KV cache; memory PyTorch keeps cached but free is not
    counted twice."""
    from minivllm.worker.worker import kv_cache_budget

    GB = 10**9
    alone = kv_cache_budget(
        total=100 * GB, free=60 * GB, torch_reserved=30 * GB, torch_peak=20 * GB, utilization=0.9
    )
    assert alone == 90 * GB - 20 * GB - 10 * GB
    beside_another = kv_cache_budget(
        total=100 * GB, free=50 * GB, torch_reserved=30 * GB, torch_peak=20 * GB, utilization=0.9
    )
    assert alone - beside_another == 10 * GB
    more_cached = kv_cache_budget(
        total=100 * GB, free=50 * GB, torch_reserved=40 * GB, torch_peak=20 * GB, utilization=0.9
    )
    assert more_cached == alone


# --- the scheduler's room for drafts and their K/V -----------------------------------------------


@given(
    max_tokens=st.integers(1, 12),
    num_outputs=st.integers(0, 11),
    prompt_len=st.integers(1, 40),
    num_drafts=st.integers(0, 8),
)
@settings(max_examples=60, deadline=None)
def test_drafts_never_take_a_request_past_max_tokens_or_its_context(
    tokenizer, max_tokens, num_outputs, prompt_len, num_drafts
):
    """A verification step emits the accepted drafts plus one token of its own, so a request
    keeps at most (tokens it may still emit) - 1 drafts, and none whose token would land past
    the context; within that room, every draft is kept."""
    num_outputs = min(num_outputs, max_tokens - 1)  # a request still running
    max_model_len = 48
    prompt_len = min(prompt_len, max_model_len - num_outputs - 1)
    request = Request.create(
        "r", None, list(range(5, 5 + prompt_len)), SamplingParams(max_tokens=max_tokens),
        tokenizer, (2,), max_model_len=max_model_len,
    )  # fmt: skip
    request.output_token_ids.extend([7] * num_outputs)
    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(64, 4))
    kept = scheduler._draft_room(request, list(range(100, 100 + num_drafts)))
    emitted_at_most = len(kept) + 1
    assert num_outputs + emitted_at_most <= max_tokens
    assert request.num_tokens + emitted_at_most <= max_model_len
    room = min(max_tokens - num_outputs, max_model_len - request.num_tokens) - 1
    assert len(kept) == min(num_drafts, room)


@pytest.mark.parametrize("lookahead", [1, 3])
def test_a_grant_that_reaches_the_last_token_holds_the_lookahead_slots_too(tokenizer, lookahead):
    """With a draft model, the k guesses after a step write their K/V past the grant: the
    blocks reserved cover grant + k slots (within the context), not a slot fewer."""
    block_size = 4
    config = SchedulerConfig(num_lookahead_tokens=lookahead)
    scheduler = Scheduler(config, KVCacheManager(64, block_size))
    for prompt_len in (3, 4, 7, 8):
        request = Request.create(
            f"r{prompt_len}", None, list(range(5, 5 + prompt_len)), SamplingParams(max_tokens=8),
            tokenizer, (2,), max_model_len=64,
        )  # fmt: skip
        scheduler.add_request(request)
    output = scheduler.schedule()
    tables = scheduler.kv_cache_manager.block_tables
    for req_id, granted in output.num_scheduled_tokens.items():
        assert len(tables[req_id]) == cdiv(granted + lookahead, block_size), req_id


@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_model_engine_holds_k_slots_past_the_grant(tiny_model_dirs, k):
    """The engine's scheduler gets the draft model's k as its lookahead: a prompt's first grant
    reserves its tokens and k more slots, one per guess the draft will write (block size 1: no
    rounding up to whole blocks hides a missing slot)."""
    target = tiny_model_dirs[ENGINE_TEST_FAMILY]
    draft = {"method": "draft_model", "model": str(target), "num_speculative_tokens": k}
    eng = engine(target, block_size=1, speculative_config=draft)
    eng.add_request("r", {"prompt_token_ids": list(range(5, 12))}, SamplingParams(max_tokens=8))
    output = eng.scheduler.schedule()
    ((req_id, granted),) = output.num_scheduled_tokens.items()
    assert granted == 7
    assert len(eng.scheduler.kv_cache_manager.block_tables[req_id]) == 7 + k
